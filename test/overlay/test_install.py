"""Installing torch-overlay into an environment of any base installs nothing over its torch."""

import os
import sys
import tomllib
import unittest

from scratch_env import REPO_ROOT, clean_env, run

from tools.quickstart import commands
from torch_overlay._guard import check_base


class InstallTest(unittest.TestCase):
    def test_pip_keeps_the_installed_torch(self):
        """pip's own resolver, offline: the package's torch requirement is met by the base running the suite."""
        version = check_base().found_version
        # NOTE: this workplace caps torch with a pip constraint file; a user's pip has none.
        env = clean_env(PIP_CONSTRAINT=os.devnull)
        args = ["install", "--dry-run", "--no-index", "--no-build-isolation", str(REPO_ROOT)]
        result = run([sys.executable, "-m", "pip", *args], env=env)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("Would install torch-overlay-", result.stdout)
        self.assertNotRegex(result.stdout, r"Would install.* torch-\d", f"pip would replace torch {version}")

    def test_the_quick_start_installs_what_the_example_needs(self):
        """The README's quick start (what `make quickstart` runs, in CI, in a venv with only torch) installs the
        `example` extra, which brings numpy: DCP's object collectives need it on every rank."""
        quick_start = commands(REPO_ROOT / "README.md")
        self.assertRegex(quick_start[0], r"^pip install '\.\[example\]' ")
        self.assertTrue(any(c.startswith("torchrun ") and "examples/tp_ddp_train.py" in c for c in quick_start))
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["optional-dependencies"]["example"], ["numpy"])


if __name__ == "__main__":
    unittest.main()
