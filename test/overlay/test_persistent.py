"""Persistent activation in a scratch virtual environment: install, every new process, spawned child and torchrun rank,
TORCH_OVERLAY=0, status and check, revert, and a start-up hook that can never break interpreter start-up."""

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from expecttest import TestCase
from scratch_env import PROBE, REPO_ROOT, ScratchVenv, clean_env, probe, run, tamper, torch_tree

import torch_overlay
from torch_overlay._guard import check_base
from torch_overlay._manifest import load_manifest
from torch_overlay._persistent import hook_text

UNSHARD = load_manifest().module("torch.distributed.fsdp._unshard_param_utils")


class PersistentHookTest(TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.venv = ScratchVenv(self.root / "venv")

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def cli(self, *args: str, env: dict[str, str] | None = None):
        return run([self.venv.python, "-m", "torch_overlay.activate", *args], env=env)

    def test_install_reaches_new_processes_and_spawned_children_then_reverts(self):
        first, second = self.cli(), self.cli()
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertIn(f"persistent overlay installed: {self.venv.hook}", first.stdout)
        self.assertIn("already installed", second.stdout)
        # site skips a .pth it cannot read, without a word: other users of the environment must read it.
        self.assertEqual(stat.S_IMODE(self.venv.hook.stat().st_mode), 0o644)

        report = probe(self.venv.python, "--spawn")
        self.assertFalse(report["at_start"]["torch_imported"], "the start-up hook must not import torch")
        self.assertTrue(report["here"]["warning_fixed"], report)
        self.assertTrue(report["spawned_child"]["warning_fixed"], report)
        # DDP is served from the first import of torch on, from this base's payload, torch's subclass on it.
        ddp = load_manifest().module("torch.nn.parallel.distributed")
        ddp_file = load_manifest().payload_file(ddp, check_base().matched)
        for process in ("here", "spawned_child"):
            self.assertEqual((report[process]["ddp_file"], report[process]["ddp_subclass_on_it"]), (ddp_file, True))
        out = self.root / "ranks"
        out.mkdir()
        torchrun = run(
            [self.venv.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(PROBE)]
            + ["--out", str(out)]
        )
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank-*.json"))]
        self.assertEqual([r["here"]["warning_fixed"] for r in ranks], [True, True], torchrun.stdout + torchrun.stderr)
        off = probe(self.venv.python, env=clean_env(TORCH_OVERLAY="0"))
        self.assertTrue(off["here"]["warning_stock"], off)

        status = self.cli("--status").stdout.replace(str(self.root), "<tmp>").replace(str(REPO_ROOT), "<repo>")
        status = status.replace(f"torch-overlay: {torch_overlay.__version__} ", "torch-overlay: <version> ")
        status = re.sub(r"torch: .*\n", "torch: <version> at <path>\n", status)
        status = status.replace(f"torch {check_base().matched.version},", "torch <base>,")
        # What is served and on which bases comes from the manifest: every runtime module, one row each.
        manifest = load_manifest()
        status = status.replace(f"{len(manifest.modules)} files", "<n> files")
        status = status.replace(f"bases:         {', '.join(manifest.versions)}\n", "bases:         <bases>\n")
        status = status.replace(f"served:        {len(manifest.runtime_modules)} modules", "served:        <n> modules")
        not_served = ", ".join(m.name for m in manifest.modules if not m.runtime)
        status = status.replace(f"not served:    {not_served} (", "not served:    <the docstring-only modules> (")
        rows = [line.split()[0] for line in status.splitlines() if line.startswith("  ")]
        self.assertEqual(rows, [m.name for m in manifest.runtime_modules])
        status = re.sub(r"(  \S+ +not imported\n)+", "  <each runtime module>  not imported\n", status)
        self.assertExpectedInline(
            status,
            """\
torch-overlay: <version> at <repo>/torch_overlay
torch: <version> at <path>
base:          torch <base>, <n> files: matches
bases:         <bases>
served:        <n> modules at run time (below)
not served:    <the docstring-only modules> (docstrings only: fork mode, series)
persistent:    installed (<tmp>/venv/lib/python3.11/site-packages/torch_overlay_startup.pth)
fork mode:     not applied
TORCH_OVERLAY: unset
this process:  active (the base is checked at the first import of a replaced module)
  <each runtime module>  not imported
""",
        )
        self.assertEqual(self.cli("--check").returncode, 0)

        reverted = self.cli("--revert")
        self.assertIn(f"persistent overlay removed: {self.venv.hook}", reverted.stdout)
        self.assertFalse(self.venv.hook.exists())
        self.assertTrue(probe(self.venv.python)["here"]["warning_stock"])
        self.assertIn("nothing changed", self.cli("--revert").stdout)

    def test_install_refused_on_a_tampered_base_and_nothing_written(self):
        torch_tree(self.root / "tree", (UNSHARD.path.removeprefix("torch/"),))
        tamper(Path(UNSHARD.upstream_file(self.root / "tree" / "torch")), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        result = self.cli(env=clean_env(PYTHONPATH=str(self.root / "tree")))
        self.assertEqual(result.returncode, 1)
        self.assertIn("refusing to install the persistent overlay", result.stderr)
        self.assertIn(UNSHARD.path, result.stderr)
        self.assertFalse(self.venv.hook.exists())

    def test_hook_stands_down_on_a_base_changed_after_install(self):
        self.assertEqual(self.cli().returncode, 0)
        torch_tree(self.root / "tree", (UNSHARD.path.removeprefix("torch/"),))
        tamper(Path(UNSHARD.upstream_file(self.root / "tree" / "torch")), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        result = run(
            [self.venv.python, "-W", "always", "-c", "import torch.distributed.fsdp; print('ok')"],
            env=clean_env(PYTHONPATH=str(self.root / "tree")),
        )
        self.assertEqual((result.returncode, result.stdout), (0, "ok\n"), result.stderr)
        warnings = [line for line in result.stderr.splitlines() if "torch_overlay" in line]
        self.assertEqual(len(warnings), 1, result.stderr)
        self.assertIn("the overlay is NOT active in this process", warnings[0])
        # The warning, --status and --check name the cause (the file) and the fix, activate()'s own.
        fix = f"Reinstall torch with `pip install --force-reinstall --no-deps torch=={check_base().matched.version}`"
        self.assertIn(UNSHARD.path, warnings[0])
        self.assertIn(fix, warnings[0])
        # A script can test it: --status and --check exit 1 on a mismatch.
        for flag in ("--status", "--check"):
            status = self.cli(flag, env=clean_env(PYTHONPATH=str(self.root / "tree")))
            self.assertEqual(status.returncode, 1, status.stdout + status.stderr)
            self.assertIn(UNSHARD.path, status.stdout + status.stderr)
            self.assertIn(fix, status.stdout + status.stderr)

    def test_hook_serves_an_unlisted_release_with_the_base_files_and_one_warning(self):
        self.assertEqual(self.cli().returncode, 0)
        tree = torch_tree(self.root / "tree")
        version = check_base().found_version
        tamper(tree / "version.py", f"__version__ = '{version}'", "__version__ = '99.0.0'")
        env = clean_env(PYTHONPATH=str(self.root / "tree"))
        result = run([self.venv.python, "-W", "always", str(PROBE)], env=env)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(json.loads(result.stdout.splitlines()[-1])["here"]["warning_fixed"], "the overlay serves it")
        warnings = [line for line in result.stderr.splitlines() if "torch_overlay" in line]
        self.assertEqual(len(warnings), 1, result.stderr)
        self.assertIn(
            f"torch 99.0.0 is not a listed base, but its {len(load_manifest().modules)} replaced files are exactly "
            "those of",
            warnings[0],
        )
        self.assertIn("warning: torch_overlay: torch 99.0.0 is not a listed base", self.cli("--status", env=env).stdout)

    def test_broken_or_missing_package_never_breaks_startup(self):
        """A broken package costs one line; an uninstalled one (no distribution beside the hook, as after `pip
        uninstall torch-overlay`) nothing: the hook removes itself, so no process of the environment says a word."""
        self.assertEqual(self.cli().returncode, 0)
        broken = self.root / "broken" / "torch_overlay"
        broken.mkdir(parents=True)
        (broken / "__init__.py").write_text("raise RuntimeError('half-uninstalled')\n")
        half = ScratchVenv(self.root / "half", with_package=False)  # its distribution is there, its package is not
        half.hook.write_text(hook_text(half.hook))
        (half.site_packages / "torch_overlay-0.0.0.dist-info").mkdir()
        gone = ScratchVenv(self.root / "gone", with_package=False)
        gone.hook.write_text(hook_text(gone.hook))
        code = ["-c", "import sys; print('torch' in sys.modules)"]
        for python, env in ((self.venv.python, clean_env(PYTHONPATH=str(broken.parent))), (half.python, clean_env())):
            result = run([python, *code], env=env)
            self.assertEqual((result.returncode, result.stdout), (0, "False\n"), result.stderr)
            lines = result.stderr.splitlines()
            self.assertEqual(len(lines), 1, result.stderr)
            self.assertIn("torch_overlay: start-up hook", lines[0])
            self.assertIn("did nothing", lines[0])
        for _ in range(2):
            result = run([gone.python, *code])
            self.assertEqual((result.returncode, result.stdout, result.stderr), (0, "False\n", ""))
            self.assertFalse(gone.hook.exists())


class EnvVariableTest(TestCase):
    """TORCH_OVERLAY takes the documented values only, and each does what docs/activation.md says, under the persistent
    hook: unset or 1/on/true/yes in any case (served), 0/off/false/no (stock), require (served, or importing torch
    raises where it cannot be), anything else (importing torch ends the process with one line naming the values,
    activate() raises)."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.venv = ScratchVenv(self.root / "venv")
        installed = run([self.venv.python, "-m", "torch_overlay.activate"])
        self.assertEqual(installed.returncode, 0, installed.stderr)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def python(self, code: str, value: str, tree: Path | None = None) -> subprocess.CompletedProcess:
        env = clean_env(TORCH_OVERLAY=value, **({"PYTHONPATH": str(tree.parent)} if tree else {}))
        return run([self.venv.python, "-W", "always", "-c", code], env=env)

    def test_each_value_does_what_it_says(self):
        finder = "import sys; print([type(f).__name__ for f in sys.meta_path if 'Overlay' in type(f).__name__])"
        values = (("", True), ("0", False), ("Off", False), ("false", False), ("NO", False))
        values += (("1", True), ("On", True), ("TRUE", True), ("yes", True))  # the spellings of "on": the default
        for value, installed in values:
            with self.subTest(value=value):  # the hook's own test of the value (no torch needed)
                self.assertEqual(self.python(finder, value).stdout, f"{['OverlayFinder'] if installed else []}\n")
        for value, served in (("", True), ("1", True), ("off", False), ("require", True)):
            with self.subTest(value=value):
                report = probe(self.venv.python, env=clean_env(TORCH_OVERLAY=value))
                self.assertEqual(
                    (report["here"]["warning_fixed"], report["here"]["warning_stock"]), (served, not served)
                )
        takes = (
            "unset or 1, on, true, yes (the overlay serves where it is activated), 0, off, false, no (stock torch), "
        )
        takes += "or require (raise where it cannot serve)"
        for value in ("00", "enable"):
            with self.subTest(value=value):
                said = f"torch_overlay: TORCH_OVERLAY={value!r} is not a value it takes: {takes}"
                activated = self.python("import torch_overlay; torch_overlay.activate()", value)
                self.assertIn(f"EnvValueError: {said}", activated.stderr)
                status = run(
                    [self.venv.python, "-m", "torch_overlay.activate", "--status"], clean_env(TORCH_OVERLAY=value)
                )
                self.assertEqual(status.returncode, 1)
                self.assertIn(f"problem: {said}", status.stdout)
        # Start-up went on; the first import of a replaced module ends the process with that one line, exit 1,
        # never a traceback through torch's modules.
        imported = self.python("import torch; print('imported')", "enable")
        said = f"torch_overlay: TORCH_OVERLAY='enable' is not a value it takes: {takes}\n"
        self.assertEqual((imported.returncode, imported.stdout, imported.stderr), (1, "", said))

    def test_require_raises_where_the_overlay_cannot_serve(self):
        """A torch file changed under the installed hook, and a release that is not a base: the first import of a
        replaced module raises under require (on stock torch, with one warning, by default)."""
        changed = torch_tree(self.root / "changed", (UNSHARD.path.removeprefix("torch/"),))
        tamper(Path(UNSHARD.upstream_file(changed)), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        unlisted = torch_tree(self.root / "unlisted", (UNSHARD.path.removeprefix("torch/"),))
        tamper(unlisted / "version.py", f"__version__ = '{check_base().found_version}'", "__version__ = '2.12.1'")
        tamper(Path(UNSHARD.upstream_file(unlisted)), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        for tree, why in ((changed, "its replaced files are not those of"), (unlisted, "torch 2.12.1 at ")):
            with self.subTest(tree=tree.parent.name):
                default = self.python("import torch; print('stock')", "", tree)
                self.assertEqual(default.stdout, "stock\n", default.stderr)
                self.assertIn("the overlay is NOT active in this process", default.stderr)
                strict = self.python("import torch; print('stock')", "require", tree)
                self.assertNotEqual(strict.returncode, 0)
                self.assertEqual(strict.stdout, "")
                self.assertIn(
                    "NotServedError: torch_overlay: TORCH_OVERLAY=require is set, and the overlay cannot serve this "
                    "process: ",
                    strict.stderr,
                )
                self.assertIn(why, strict.stderr)
                self.assertIn(UNSHARD.path, strict.stderr)

    def test_require_active(self):
        """One line in a training script: raises unless the overlay serves this process."""
        script = "import torch, torch_overlay; torch_overlay.require_active(); print('served')"
        self.assertEqual(self.python(script, "").stdout, "served\n")
        off = self.python(script, "0")
        self.assertIn("NotActiveError: torch_overlay: the overlay is not active in this process: TORCH_OVERLAY=0 "
                      "turns it off. Unset TORCH_OVERLAY;", off.stderr)  # fmt: skip
        changed = torch_tree(self.root / "changed", (UNSHARD.path.removeprefix("torch/"),))
        tamper(Path(UNSHARD.upstream_file(changed)), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        stood_down = self.python(script, "", changed)
        self.assertIn("NotActiveError: torch_overlay: the overlay is not active in this process: it stood down: ",
                      stood_down.stderr)  # fmt: skip
        self.assertIn(UNSHARD.path, stood_down.stderr)
        # Its fix is the reinstall, not activating (the overlay is activated, and stood down on this torch).
        fix = f"Reinstall torch with `pip install --force-reinstall --no-deps torch=={check_base().matched.version}`"
        self.assertIn(fix, stood_down.stderr)
        self.assertNotIn("Activate it before building models", stood_down.stderr)
        removed = run([self.venv.python, "-m", "torch_overlay.activate", "--revert"])
        self.assertEqual(removed.returncode, 0, removed.stderr)
        late = self.python(script, "")
        self.assertIn("the overlay is not active in this process: it was not activated.", late.stderr)
        activated = "import torch, torch_overlay; torch_overlay.activate(); torch_overlay.require_active(); print('ok')"
        self.assertEqual(self.python(activated, "").stdout, "ok\n")


class ClosedStdoutTest(unittest.TestCase):
    def test_a_closed_stdout_ends_the_cli_quietly(self):
        """`--status | head -1`: the reader goes away; the command ends as a Unix tool killed by SIGPIPE does
        (status 141, no message), and does not blame the environment's permissions."""
        read, write = os.pipe()
        os.close(read)  # gone before the first write, so that every write fails
        try:
            result = subprocess.run(
                [sys.executable, "-m", "torch_overlay.activate", "--status"],
                stdout=write, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=REPO_ROOT, timeout=300,
            )  # fmt: skip
        finally:
            os.close(write)
        self.assertEqual((result.returncode, result.stderr), (141, ""))


if __name__ == "__main__":
    unittest.main()
