"""Fork mode on a scratch copy of the installed torch (a symlink tree: replacing a file never touches .venv).

The series used here is generated from a synthetic overlay holding only the summon_full_params warning fix
(and a one-line version of each new module, which fork mode creates and removes), so its red test,
TestUnshardOffloadWarning in test_fsdp_unshard_params.py, proves fork mode end to end: it passes in the scratch
interpreter with fork mode applied (no overlay: TORCH_OVERLAY=0, no boot directory); once reverted, every file
is the stock file again, byte for byte, and each new module is gone (where `pytest --stock` proves the test red).
"""

from __future__ import annotations

import hashlib
import json
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
from tools.pristine import pristine
from tools.project import REPO_ROOT, Project, default_project
from tools.series import load_series, series_for
from torch_overlay import _fork
from torch_overlay._guard import check_base, find_torch_dir
from torch_overlay._manifest import MANIFEST_PATH, load_manifest

WARNING_FILE = "torch/distributed/fsdp/_unshard_param_utils.py"
RED_TEST = REPO_ROOT / "test/distributed/fsdp/test_fsdp_unshard_params.py"
RED_CLASS = "TestUnshardOffloadWarning"  # runs alone, in one process
SERIES = """
author = "Pat Maintainer <pat@example.com>"

[[patch]]
name = "warning"
title = "[FSDP] Fix the offload warning"
summary = "Add the missing space."
test_plan = "python test/distributed/fsdp/test_fsdp_unshard_params.py TestUnshardOffloadWarning"
claims = [
  { file = "torch/distributed/fsdp/_unshard_param_utils.py", match = 'may result in the "' },
  NEW_CLAIMS
]
tests = []
"""


def installed_base_project(root: Path) -> tuple[Project, dict[str, bytes], str]:
    """(a project whose manifest lists only the installed base, that base's files, its version)."""
    version = check_base().matched.version
    project = Project(root)
    raw = json.loads(Path(MANIFEST_PATH).read_text())
    raw["bases"] = [b for b in raw["bases"] if b["version"] == version]
    for module in raw["modules"]:
        module.pop("base_payloads", None)  # one base: its payload serves it
    project.manifest_path.parent.mkdir(parents=True)
    project.manifest_path.write_text(json.dumps(raw, indent=2) + "\n")
    return project, pristine(project).files(project.manifest().payload_base), version


NEW_FILES = [m.path for m in load_manifest().new_modules]
"""The new modules (no release ships them): fork mode creates them, and removes them on revert."""
NEW_CONTENT = b"# a new module of the series\n"


def _new_claims(match: str) -> str:
    return ", ".join(f'{{ file = "{path}", match = "{match}" }}' for path in NEW_FILES)


def _hashes(torch_dir: Path) -> dict[str, str | None]:
    """Each manifest file's sha256; None where it is absent (a new module before fork mode)."""
    files = {m.path: torch_dir.parent / m.path for m in load_manifest().modules}
    return {p: hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None for p, f in files.items()}


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
        project, base, cls.version = installed_base_project(tmp / "project")
        for path, content in base.items():
            if path == WARNING_FILE:
                content = content.replace(b'may result in the"', b'may result in the "')
            project.overlay_file(path).parent.mkdir(parents=True, exist_ok=True)
            project.overlay_file(path).write_bytes(content)
        for path in NEW_FILES:
            project.overlay_file(path).parent.mkdir(parents=True, exist_ok=True)
            project.overlay_file(path).write_bytes(NEW_CONTENT)
        project.patches_dir.mkdir()
        project.series_toml.write_text(textwrap.dedent(SERIES).replace("NEW_CLAIMS", _new_claims("a new module")))
        write(project, generate(project, pristine(project)))
        cls.patches_dir = project.patches_dir
        cls.pristine = _hashes(cls.torch_dir)

    @classmethod
    def tearDownClass(cls) -> None:
        _fork.revert(cls.torch_dir)
        cls._tmp.cleanup()

    def setUp(self) -> None:
        # The scratch torch is shared by the tests: each starts from stock, whatever the one before left.
        _fork.revert(self.torch_dir)

    def run_scratch(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A Python of the scratch environment: the scratch torch first on the path, no overlay at all."""
        # NOTE: without CI: under CI=true, PyTorch's run_tests() writes XML reports and needs xmlrunner.
        env = {k: v for k, v in os.environ.items() if k != "CI"}
        env.update(PYTHONPATH=str(self.site), TORCH_OVERLAY="0")
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=REPO_ROOT)

    def cli(self, *args: str) -> str:
        proc = self.run_scratch("-m", "torch_overlay", *args)
        return (proc.stdout + proc.stderr).replace(str(self.site), "<site>")

    def test_apply_revert_end_to_end(self) -> None:
        patches = ["--patches", str(self.patches_dir)]
        changed = ", ".join([WARNING_FILE, *NEW_FILES])
        self.assertEqual(
            self.cli("apply-patches", *patches),
            f"torch-overlay: fork mode applied: 1 patches to torch {self.version}: {changed}\n"
            "Revert with `torch-overlay revert-patches`.\n",
        )
        self.assertNotEqual(_hashes(self.torch_dir)[WARNING_FILE], self.pristine[WARNING_FILE])
        for path in NEW_FILES:
            self.assertIsNone(self.pristine[path])
            self.assertEqual((self.torch_dir.parent / path).read_bytes(), NEW_CONTENT)
        self.assertExpectedInline(
            self.cli("apply-patches", *patches),
            """\
torch-overlay: fork mode already applied (1 patches; nothing changed)
""",
        )
        status = self.cli("status")
        self.assertIn("fork mode:     applied (1 patches in place)", status)
        # Fork mode serves this process (and every other): the patched files are torch's own.
        self.assertIn("served:        by fork mode: 1 patches applied in place to torch's files", status)
        self.assertIn("this process:  served by fork mode (torch's own files are patched; nothing to activate)", status)
        self.assertTrue(_fork.notice_path(self.torch_dir).is_file(), "the line that outlives `pip uninstall`")
        files = len(load_manifest().modules)
        self.assertIn(f"base:          torch {self.version}, {files} files: patched by fork mode", status)
        self.assertNotIn("problem:", status, "fork mode's patched files are no mismatch")
        # TORCH_OVERLAY=0 cannot turn fork mode off (its files are torch's): status and activate() say so, and
        # require_active() counts fork mode as serving the change.
        ignored = "fork mode ignores it (the series is applied in place: `torch-overlay revert-patches`)"
        self.assertIn(f"TORCH_OVERLAY: 0 (off: the start-up hook and activate() do nothing in this process); {ignored}",
                      status)  # fmt: skip
        script = "import torch_overlay; torch_overlay.activate(); torch_overlay.require_active(); print('served')"
        off = self.run_scratch("-W", "always", "-c", script)
        self.assertEqual(off.stdout, "served\n", off.stderr)
        self.assertIn("torch_overlay.activate() ignored: TORCH_OVERLAY=0 is set; but fork mode is applied to the "
                      "installed torch, and the variable does not turn it off", off.stderr)  # fmt: skip
        # A job gated on --check passes on a healthy fork, and fails on a patched file changed since.
        check = self.run_scratch("-m", "torch_overlay", "check")
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        self.assertExpectedInline(
            check.stdout,
            """\
torch-overlay: check passed: fork mode serves torch VERSION (1 patches applied in place, every file as fork mode wrote it)
""".replace("VERSION", self.version),  # noqa: E501
        )
        patched = self.torch_dir.parent / WARNING_FILE
        content = patched.read_bytes()
        patched.write_bytes(content + b"# local edit\n")
        try:
            check = self.run_scratch("-m", "torch_overlay", "check")
        finally:
            patched.write_bytes(content)
        self.assertEqual(check.returncode, 1, check.stdout + check.stderr)
        self.assertIn(f"check failed: {patched} changed since fork mode was applied", check.stderr)
        self.assertIn(f"pip install --force-reinstall --no-deps torch=={self.version}", check.stderr)
        refused = self.run_scratch("-c", "import torch_overlay._loader as l; l.activate()")
        self.assertIn("refusing to activate the overlay: fork mode is active", refused.stderr)
        self.assertIn("refusing to install the persistent overlay: fork mode is active", self.cli("apply-overlay"))
        green = self.run_scratch(str(RED_TEST), RED_CLASS)
        self.assertEqual(green.returncode, 0, green.stderr[-3000:])

        self.assertEqual(
            self.cli("revert-patches"),
            f"torch-overlay: fork mode reverted: {1 + len(NEW_FILES)} files restored to torch {self.version}\n",
        )
        self.assertEqual(_hashes(self.torch_dir), self.pristine)
        self.assertFalse(_fork.state_dir(self.torch_dir).exists())
        self.assertFalse(_fork.notice_path(self.torch_dir).exists())
        self.assertIn("fork mode:     not applied", self.cli("status"))
        # Every file is stock again, byte for byte, and `pytest --stock` proves the red test red on stock.

    def test_a_wrong_patches_path_is_named(self) -> None:
        """`--patches` naming no series says so (and where the series this package carries is), not `make patches`."""
        empty = Path(self._tmp.name) / "empty"
        empty.mkdir(exist_ok=True)
        for path, what in ((Path(self._tmp.name) / "nope", "no such directory"), (empty, "a directory without")):
            said = self.cli("apply-patches", "--patches", str(path))
            self.assertIn(f"torch_overlay: --patches {path}: {what}", said)
            self.assertIn("Nothing was changed. Pass a torch-overlay checkout's patches/ directory, or leave --patches "
                          "out: this package carries the series", said)  # fmt: skip
            self.assertNotIn("make patches", said)
        self.assertEqual(_hashes(self.torch_dir), self.pristine)

    def test_the_package_carries_the_series(self) -> None:
        """What `torch-overlay apply-patches` uses without --patches: every base's series, in the package (a link
        to patches/ in a checkout, package data in a wheel: test_install.py)."""
        for base in load_manifest().bases:
            carried = [(p.name, p.read_bytes()) for p in _fork.series(None, base.version)]
            self.assertEqual(
                carried, [(p.name, p.read_bytes()) for p in _fork.series(REPO_ROOT / "patches", base.version)]
            )

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
            # What works where torch cannot be written: in-process activation, which writes nothing.
            self.assert_refused("is not writable. Nothing was changed. Use the overlay in the process instead, which "
                                "writes nothing: `import torch_overlay; torch_overlay.activate()`")  # fmt: skip
        target = self.torch_dir.parent / WARNING_FILE
        original = target.read_bytes()
        target.unlink()
        target.write_bytes(original + b"# local edit\n")
        try:
            with self.assertRaises(_fork.ForkError) as e:
                _fork.apply(self.patches_dir, self.torch_dir)
            self.assertIn("the installed torch is not a base of the series", str(e.exception))
            self.assertIn(f"not those of the torch {self.version} release", str(e.exception))
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


class TestSeriesPerBase(unittest.TestCase):
    def test_each_base_gets_its_series(self) -> None:
        """Fork mode applies what the base needs: the upstream series plus the backports of older bases."""
        patches = load_series(default_project().series_toml)
        for base in load_manifest().bases:
            names = [p.name.split("-", 1)[1].removesuffix(".patch") for p in _fork.series(None, base.version)]
            self.assertEqual(names, [p.name for p in series_for(patches, base.version)], base.version)
        newest, oldest = load_manifest().bases[-1], load_manifest().bases[0]
        if any(not p.needed_on(newest.version) for p in patches):  # backports: the oldest base needs more
            self.assertLess(len(_fork.series(None, newest.version)), len(_fork.series(None, oldest.version)))


class _Killed(Exception):
    """Stands for a kill: raised by every os.replace after the allowed ones, so no roll-back can run."""


class TestForkInterrupted(expecttest.TestCase):
    """Fork mode killed half-way, in process, on a scratch tree holding only version.py and the manifest's files.

    The series changes the first two files, so a kill can fall between them.
    """

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="torch-overlay-fork-kill-")
        tmp = Path(self._tmp.name)
        self.torch_dir = tmp / "site" / "torch"
        self.torch_dir.mkdir(parents=True)
        shutil.copy2(find_torch_dir() / "version.py", self.torch_dir / "version.py")
        project, base, self.version = installed_base_project(tmp / "project")
        self.changed = [m.path for m in load_manifest().modules][:2]
        for path, content in base.items():
            (self.torch_dir.parent / path).parent.mkdir(parents=True, exist_ok=True)
            (self.torch_dir.parent / path).write_bytes(content)
            if path in self.changed:
                content += b"# fork-kill-test\n"
            project.overlay_file(path).parent.mkdir(parents=True, exist_ok=True)
            project.overlay_file(path).write_bytes(content)
        for path in NEW_FILES:  # created after the two files, removed after them
            project.overlay_file(path).parent.mkdir(parents=True, exist_ok=True)
            project.overlay_file(path).write_bytes(b"# fork-kill-test\n")
        project.patches_dir.mkdir()
        claims = ", ".join(f'{{ file = "{p}", match = "fork-kill-test" }}' for p in self.changed + NEW_FILES)
        project.series_toml.write_text(
            'author = "Pat Maintainer <pat@example.com>"\n'
            f'[[patch]]\nname = "two"\ntitle = "Two files"\nsummary = "s"\ntest_plan = "t"\nclaims = [{claims}]\n'
        )
        write(project, generate(project, pristine(project)))
        self.patches_dir = project.patches_dir
        self.pristine = _hashes(self.torch_dir)
        hook = mock.patch.object(_fork, "installed_hook", return_value=None)
        hook.start()
        self.addCleanup(hook.stop)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def killed_after(self, allowed: int) -> mock._patch:
        real, calls = os.replace, []

        def replace(src: object, dst: object) -> None:
            calls.append(dst)
            if len(calls) > allowed:
                raise _Killed(f"killed at os.replace #{len(calls)}")
            real(src, dst)

        return mock.patch.object(_fork.os, "replace", replace)

    def at(self) -> list[str]:
        """Which of the two changed files are patched."""
        now = _hashes(self.torch_dir)
        return [("patched" if now[p] != self.pristine[p] else "original") for p in self.changed]

    def test_interrupted_apply_completes_and_revert_restores(self) -> None:
        # os.replace #1 saves the state, #2 replaces the first file, #3 would replace the second.
        with self.killed_after(2), self.assertRaises(_fork.InterruptedForkError) as e:
            _fork.apply(self.patches_dir, self.torch_dir)
        self.assertIn("Run `torch-overlay apply-patches` to finish", str(e.exception))
        self.assertEqual(self.at(), ["patched", "original"])
        self.assertIsNotNone(_fork.read_state(self.torch_dir))
        state, changed = _fork.apply(self.patches_dir, self.torch_dir)
        self.assertTrue(changed)
        self.assertEqual(self.at(), ["patched", "patched"])
        self.assertFalse(_fork.apply(self.patches_dir, self.torch_dir)[1])

        with self.killed_after(1), self.assertRaises(_fork.InterruptedForkError) as e:
            _fork.revert(self.torch_dir)
        self.assertIn("Run `torch-overlay revert-patches` to finish", str(e.exception))
        self.assertEqual(self.at(), ["original", "patched"])
        self.assertEqual(_fork.revert(self.torch_dir), state)
        self.assertEqual(_hashes(self.torch_dir), self.pristine)
        self.assertFalse(_fork.state_dir(self.torch_dir).exists())

    def test_revert_killed_before_removing_the_state(self) -> None:
        _fork.apply(self.patches_dir, self.torch_dir)
        with self.killed_after(2), self.assertRaises(_Killed):
            _fork.revert(self.torch_dir)
        self.assertEqual(self.at(), ["original", "original"])
        self.assertIsNotNone(_fork.read_state(self.torch_dir))
        self.assertIsNotNone(_fork.revert(self.torch_dir))
        self.assertEqual(_hashes(self.torch_dir), self.pristine)
        self.assertIsNone(_fork.read_state(self.torch_dir))

    def test_damaged_state_and_missing_original_name_the_file(self) -> None:
        _fork.apply(self.patches_dir, self.torch_dir)
        saved = _fork.originals_dir(self.torch_dir) / self.changed[0]
        content = saved.read_bytes()
        saved.unlink()
        with self.assertRaises(_fork.ForkError) as e:
            _fork.revert(self.torch_dir)
        self.assertIn(f"the saved original {saved} is missing or unreadable", str(e.exception))
        self.assertIn(f"pip install --force-reinstall --no-deps torch=={self.version}", str(e.exception))
        self.assertEqual(self.at(), ["patched", "patched"])
        saved.write_bytes(content)
        state_file = _fork.state_dir(self.torch_dir) / "state.json"
        good = state_file.read_text()
        state_file.write_text('{"mode": "fork", "files": [{"path": "x"}]}')
        with self.assertRaises(_fork.ForkError) as e:
            _fork.revert(self.torch_dir)
        self.assertIn(f"the fork mode state {state_file} is unreadable or damaged", str(e.exception))
        state_file.write_text(good)
        _fork.revert(self.torch_dir)
        self.assertEqual(_hashes(self.torch_dir), self.pristine)

    def test_no_default_patches_in_a_wheel_install(self) -> None:
        with mock.patch.object(_fork, "DEFAULT_PATCHES_DIR", self.torch_dir / "nope"):
            with self.assertRaises(_fork.ForkError) as e:
                _fork.apply(None, self.torch_dir)
        self.assertIn(
            "pass a checkout's patches/ directory: `torch-overlay apply-patches --patches DIR`", str(e.exception)
        )
        self.assertEqual(_hashes(self.torch_dir), self.pristine)


if __name__ == "__main__":
    unittest.main()
