"""Fork mode on a scratch copy of the installed torch (a symlink tree: replacing a file never touches .venv).

The series used here is generated from a synthetic overlay holding only the summon_full_params warning fix,
so the red test test_fsdp_unshard_offload_warning.py proves fork mode end to end: it passes in the scratch
interpreter with fork mode applied (no overlay: TORCH_OVERLAY=0, no boot directory); once reverted, every file
is the stock file again, byte for byte (where `pytest --stock` proves the test red).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path
from unittest import mock

import expecttest

from tools.patches import generate, write
from tools.pristine import pristine_base
from tools.project import REPO_ROOT, Project
from torch_overlay import _fork
from torch_overlay._guard import find_torch_dir
from torch_overlay._manifest import MANIFEST_PATH, load_manifest

WARNING_FILE = "torch/distributed/fsdp/_unshard_param_utils.py"
RED_TEST = REPO_ROOT / "test/distributed/fsdp/test_fsdp_unshard_offload_warning.py"
SERIES = """
[[patch]]
name = "warning"
title = "[FSDP] Fix the offload warning"
summary = "Add the missing space."
test_plan = "python test/distributed/fsdp/test_fsdp_unshard_offload_warning.py"
claims = [{ file = "torch/distributed/fsdp/_unshard_param_utils.py", match = 'may result in the "' }]
tests = ["test/distributed/fsdp/test_fsdp_unshard_offload_warning.py"]
"""


def _hashes(torch_dir: Path) -> dict[str, str]:
    return {
        m.path: hashlib.sha256((torch_dir.parent / m.path).read_bytes()).hexdigest() for m in load_manifest().modules
    }


class TestForkMode(expecttest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory(prefix="torch-overlay-fork-test-")
        tmp = Path(cls._tmp.name)
        cls.site = tmp / "site"
        cls.site.mkdir()
        real_torch = find_torch_dir()
        subprocess.run(["cp", "-rs", str(real_torch), str(cls.site / "torch")], check=True)
        # NOTE: a real __init__.py, so that torch.__file__ resolves inside the scratch tree, not in .venv.
        (cls.site / "torch/__init__.py").unlink()
        shutil.copy2(real_torch / "__init__.py", cls.site / "torch/__init__.py")
        cls.torch_dir = cls.site / "torch"
        project = Project(tmp / "project")
        (project.root / "torch_overlay").mkdir(parents=True)
        shutil.copy2(MANIFEST_PATH, project.manifest_path)
        base = pristine_base(project.manifest())
        for path, content in base.items():
            if path == WARNING_FILE:
                content = content.replace(b'may result in the"', b'may result in the "')
            project.overlay_file(path).parent.mkdir(parents=True, exist_ok=True)
            project.overlay_file(path).write_bytes(content)
        project.patches_dir.mkdir()
        project.series_toml.write_text(textwrap.dedent(SERIES))
        (project.root / RED_TEST.relative_to(REPO_ROOT)).parent.mkdir(parents=True)
        shutil.copy2(RED_TEST, project.root / RED_TEST.relative_to(REPO_ROOT))
        write(project, generate(project, base))
        cls.patches_dir = project.patches_dir
        cls.pristine = _hashes(cls.torch_dir)

    @classmethod
    def tearDownClass(cls) -> None:
        _fork.revert(cls.torch_dir)
        cls._tmp.cleanup()

    def run_scratch(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A Python of the scratch environment: the scratch torch first on the path, no overlay at all."""
        env = dict(os.environ, PYTHONPATH=str(self.site), TORCH_OVERLAY="0")
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=REPO_ROOT)

    def cli(self, *args: str) -> str:
        proc = self.run_scratch("-m", "torch_overlay", *args)
        return (proc.stdout + proc.stderr).replace(str(self.site), "<site>")

    def test_apply_revert_end_to_end(self) -> None:
        patches = ["--patches", str(self.patches_dir)]
        self.assertExpectedInline(
            self.cli("apply-patches", *patches),
            """\
torch-overlay: fork mode applied: 1 patches to torch 2.13.0: torch/distributed/fsdp/_unshard_param_utils.py
Revert with `torch-overlay revert-patches`.
""",
        )
        self.assertNotEqual(_hashes(self.torch_dir)[WARNING_FILE], self.pristine[WARNING_FILE])
        self.assertExpectedInline(
            self.cli("apply-patches", *patches),
            """\
torch-overlay: fork mode already applied (1 patches; nothing changed)
""",
        )
        self.assertIn("fork mode:     applied (1 patches in place)", self.cli("status"))
        refused = self.run_scratch("-c", "import torch_overlay._loader as l; l.activate()")
        self.assertIn("refusing to activate the overlay: fork mode is active", refused.stderr)
        self.assertIn("refusing to install the persistent overlay: fork mode is active", self.cli("apply-overlay"))
        green = self.run_scratch(str(RED_TEST))
        self.assertEqual(green.returncode, 0, green.stderr[-3000:])

        self.assertExpectedInline(
            self.cli("revert-patches"),
            """\
torch-overlay: fork mode reverted: 1 files restored to torch 2.13.0
""",
        )
        self.assertEqual(_hashes(self.torch_dir), self.pristine)
        self.assertFalse(_fork.state_dir(self.torch_dir).exists())
        self.assertIn("fork mode:     not applied", self.cli("status"))
        # Every file is stock again, byte for byte, and `pytest --stock` proves the red test red on stock.

    def assert_refused(self, expected: str) -> None:
        with self.assertRaises(_fork.ForkError) as e:
            _fork.apply(self.patches_dir, self.torch_dir)
        self.assertIn(expected, str(e.exception))
        self.assertIn("Nothing was changed", str(e.exception))
        self.assertEqual(_hashes(self.torch_dir), self.pristine)
        self.assertFalse(_fork.state_dir(self.torch_dir).exists())

    def test_refusals_change_nothing(self) -> None:
        with mock.patch.object(_fork, "installed_hook", return_value=Path("/x/torch_overlay_startup.pth")):
            self.assert_refused("the overlay is active persistently (/x/torch_overlay_startup.pth)")
        with mock.patch.object(_fork.os, "access", return_value=False):
            self.assert_refused("is not writable")
        target = self.torch_dir.parent / WARNING_FILE
        original = target.read_bytes()
        target.unlink()
        target.write_bytes(original + b"# local edit\n")
        try:
            with self.assertRaises(_fork.ForkError) as e:
                _fork.apply(self.patches_dir, self.torch_dir)
            self.assertIn("the installed torch is not the series' base", str(e.exception))
            self.assertIn(f"{WARNING_FILE}: sha256 ", str(e.exception))
            self.assertFalse(_fork.state_dir(self.torch_dir).exists())
        finally:
            target.write_bytes(original)
        broken = Path(self._tmp.name) / "broken"
        shutil.copytree(self.patches_dir, broken)
        patch = broken / "0001-warning.patch"
        patch.write_text(patch.read_text().replace("warnings.warn(", "warnings.warm("))
        with self.assertRaises(_fork.ForkError) as e:
            _fork.apply(broken, self.torch_dir)
        self.assertIn("0001-warning.patch does not apply to the installed torch", str(e.exception))
        self.assertEqual(_hashes(self.torch_dir), self.pristine)


if __name__ == "__main__":
    unittest.main()
