"""Installing torch-overlay never installs, upgrades or downgrades torch, on any torch or none."""

import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import unittest
from pathlib import Path

from scratch_env import REPO_ROOT, clean_env, run

import torch_overlay
from tools.quickstart import commands
from torch_overlay._guard import check_base


def build_wheel(into: Path) -> Path:
    """The package's wheel, built from a copy of the checkout (the build writes build/ and *.egg-info)."""
    source = into / "source"
    shutil.copytree(REPO_ROOT / "torch_overlay", source / "torch_overlay", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO_ROOT / name, source / name)
    args = ["wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(into), str(source)]
    result = run([sys.executable, "-m", "pip", *args])
    if result.returncode != 0:
        raise AssertionError(f"building the wheel failed:\n{result.stdout}{result.stderr}")
    return next(into.glob("torch_overlay-*.whl"))


def fake_distribution(site_packages: Path, name: str, version: str) -> None:
    """What pip reads of an installed distribution: its metadata (the package itself is not needed)."""
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("")


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.wheel = build_wheel(cls.root)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def would_install(self, torch_version: str | None) -> list[tuple[str, str]]:
        """What `pip install 'torch-overlay[example]'` would install into an environment holding that torch
        (None: no torch) and numpy, as pip's own resolver decides it (`--dry-run --report`), offline."""
        venv = self.root / f"env-{torch_version}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = venv / "bin" / "python"
        site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
        fake_distribution(site, "numpy", "2.0.0")
        if torch_version is not None:
            fake_distribution(site, "torch", torch_version)
        # NOTE: --isolated: none of this machine's pip configuration (its torch cap, its local wheel directories);
        # --no-index: no registry, so a torch requirement could only fail, never download.
        args = ["--isolated", "--python", str(python), "install", "--dry-run", "--quiet", "--no-index"]
        result = run([sys.executable, "-m", "pip", *args, "--report", "-", f"{self.wheel}[example]"], env=clean_env())
        self.assertEqual(result.returncode, 0, f"pip could not install it next to torch {torch_version}:\n{result}")
        report = json.loads(result.stdout)
        return [(item["metadata"]["name"], item["metadata"]["version"]) for item in report["install"]]

    def test_pip_installs_nothing_but_the_package_on_any_torch(self):
        """A torch that is not a base (an older one, a newer one) or none at all: pip touches no torch. The guard
        refuses the release at activation instead (test_guard.py)."""
        for torch_version in ("2.12.1", "2.16.0", None, check_base().found_version):
            with self.subTest(torch=torch_version):
                self.assertEqual(self.would_install(torch_version), [("torch-overlay", torch_overlay.__version__)])

    def test_the_version_has_one_source(self):
        """pyproject.toml reads the version from the package; the wheel, both commands and the changelog agree."""
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["dynamic"], ["version"])
        self.assertNotIn("version", pyproject["project"])
        self.assertIn(f"torch_overlay-{torch_overlay.__version__}-", self.wheel.name)
        for command in (["-m", "torch_overlay", "--version"], ["-m", "torch_overlay.activate", "--version"]):
            result = run([sys.executable, *command])
            self.assertEqual((result.returncode, result.stdout), (0, f"torch-overlay {torch_overlay.__version__}\n"))
        changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
        self.assertIn(f"\n## {torch_overlay.__version__} ", changelog)

    def test_the_licence_travels_with_the_package(self):
        """The payload is modified PyTorch source: BSD-3-Clause, PyTorch's notice kept, in the wheel too."""
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["license"], "BSD-3-Clause")
        licence = (REPO_ROOT / "LICENSE").read_text()
        self.assertIn("Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)", licence)
        self.assertIn("Redistributions of source code must retain the above copyright", licence)
        listing = run([sys.executable, "-m", "zipfile", "-l", str(self.wheel)]).stdout
        self.assertRegex(listing, r"torch_overlay-[^/]+\.dist-info/licenses/LICENSE")

    def test_the_quick_start_installs_what_the_example_needs(self):
        """The README's quick start (what `make quickstart` runs, in CI, in a venv with only torch) installs the
        `example` extra, which brings numpy: DCP's object collectives need it on every rank."""
        quick_start = commands(REPO_ROOT / "README.md")
        self.assertRegex(quick_start[0], r"^pip install '\.\[example\]' ")
        self.assertTrue(any(c.startswith("torchrun ") and "examples/tp_ddp_train.py" in c for c in quick_start))
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["optional-dependencies"]["example"], ["numpy"])
        self.assertEqual(pyproject["project"]["dependencies"], [], "installing torch-overlay must never touch torch")


if __name__ == "__main__":
    unittest.main()
