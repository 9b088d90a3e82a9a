"""The version guard matches the installed torch against every base, names what differs, and changes nothing."""

import json
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import unittest
from pathlib import Path

from scratch_env import REPO_ROOT, clean_env, run, tamper, torch_tree

from torch_overlay._guard import BaseMismatchError, check_base, read_torch_version, require_base
from torch_overlay._manifest import load_manifest

MANIFEST = load_manifest()
UNSHARD = MANIFEST.module("torch.distributed.fsdp._unshard_param_utils")


class GuardTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.torch_dir = torch_tree(self.root, tuple(m.path.removeprefix("torch/") for m in MANIFEST.modules))
        self.version = read_torch_version(self.torch_dir)
        self.base = MANIFEST.base(self.version)
        self.assertIsNotNone(self.base, f"the suite runs on a base; torch {self.version} is none")

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def set_version(self, version: str, old: str | None = None) -> None:
        """Make the scratch torch say it is ``version`` (it says ``old``, by default the installed version)."""
        tamper(self.torch_dir / "version.py", f"__version__ = '{old or self.version}'", f"__version__ = '{version}'")

    def test_installed_base_matches(self):
        check = check_base(torch_dir=self.torch_dir)
        self.assertTrue(check.ok, check.problems())
        self.assertIs(check.matched, self.base)
        self.assertIsNone(check.warning)
        self.assertEqual(check.summary(), f"torch {self.base.version}, {len(MANIFEST.modules)} files: matches")

    def test_edited_file_is_named_with_both_hashes(self):
        tamper(Path(UNSHARD.upstream_file(self.torch_dir)), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        with self.assertRaises(BaseMismatchError) as raised:
            require_base("activate the overlay", torch_dir=self.torch_dir)
        message = str(raised.exception)
        self.assertIn("refusing to activate the overlay", message)
        self.assertIn(f"its replaced files are not those of the torch {self.base.version} release", message)
        self.assertIn(f"{UNSHARD.path}: sha256 ", message)
        self.assertIn(f"expected {self.base.sha256[UNSHARD.path]}", message)
        self.assertEqual(message.count("sha256"), 1, "only the edited file is named")
        self.assertIn("Nothing was changed", message)
        self.assertIn(f"pip install --force-reinstall --no-deps torch=={self.base.version}", message)
        self.assertIn("MISMATCH", check_base(torch_dir=self.torch_dir).summary())

    def test_missing_file(self):
        Path(UNSHARD.upstream_file(self.torch_dir)).unlink()
        problems = check_base(torch_dir=self.torch_dir).problems()
        self.assertEqual(len(problems), 2, problems)
        self.assertIn(f"{UNSHARD.path}: missing (expected sha256 {self.base.sha256[UNSHARD.path]})", problems[1])

    def test_a_torch_shipping_a_new_module_is_refused(self):
        """The overlay adds modules no release ships; a torch that has one would have them shadowed."""
        for module in MANIFEST.new_modules:
            Path(module.upstream_file(self.torch_dir)).write_text("upstream = True\n")
        problems = check_base(torch_dir=self.torch_dir).problems()
        self.assertEqual(len(problems), 1 + len(MANIFEST.new_modules), problems)
        self.assertRegex(
            problems[1],
            r"^torch/\S+\.py: present \(sha256 [0-9a-f]{64}\), expected absent: the overlay adds this module, "
            "and this torch ships its own$",
        )

    def test_unlisted_release_with_a_base_files_is_served_with_a_warning(self):
        self.set_version("99.0.0+cpu")
        check = check_base(torch_dir=self.torch_dir)
        self.assertTrue(check.ok, check.problems())
        same = MANIFEST.bases_with_files(check.found)
        self.assertIn(self.base, same)
        self.assertIs(check.matched, same[0], "the newest base not newer than 99.0.0 with the same files")
        self.assertEqual(
            check.warning,
            f"torch_overlay: torch 99.0.0+cpu is not a listed base, but its {len(MANIFEST.modules)} replaced files "
            f"are exactly those of torch {same[0].version}, so the overlay serves it as {same[0].version}; add the "
            "release with `make rebase UPSTREAM=<its wheel>` in a torch-overlay checkout",
        )
        self.set_version("0.1.0", old="99.0.0+cpu")
        self.assertIs(check_base(torch_dir=self.torch_dir).matched, same[-1], "older than every base: the oldest")

    def test_unlisted_release_with_other_files_is_refused(self):
        self.set_version("99.0.0")
        tamper(Path(UNSHARD.upstream_file(self.torch_dir)), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        with self.assertRaises(BaseMismatchError) as raised:
            require_base("activate the overlay", torch_dir=self.torch_dir)
        message = str(raised.exception)
        versions = ", ".join(MANIFEST.versions)
        self.assertIn(f"torch 99.0.0 at {self.torch_dir} is not a listed base ({versions})", message)
        self.assertIn(f"{UNSHARD.path}: sha256 ", message)
        self.assertIn(f"pip install torch=={MANIFEST.payload_base.version}", message)
        self.assertIn("make rebase UPSTREAM=", message)

    def test_activate_refuses_in_a_process_and_changes_nothing(self):
        tamper(Path(UNSHARD.upstream_file(self.torch_dir)), "FLAT_PARAM = ", "FLAT_PARAM  = ")
        code = textwrap.dedent(
            """
            import json, sys
            import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_api
            import torch_overlay
            import torch_overlay._loader  # the machinery loads lazily; only torch must stay untouched
            before = (list(sys.meta_path), dict(sys.modules), dict(vars(fsdp_api)))
            try:
                torch_overlay.activate()
                error = None
            except torch_overlay.BaseMismatchError as e:
                error = str(e)
            after = (list(sys.meta_path), dict(sys.modules), dict(vars(fsdp_api)))
            unchanged = before[0] == after[0] and all(
                a.keys() == b.keys() and all(a[k] is b[k] for k in a) for a, b in zip(before[1:], after[1:])
            )
            print(json.dumps({"error": error, "unchanged": unchanged, "torch": fsdp_api.__file__}))
            """
        )
        result = run([sys.executable, "-c", code], env=clean_env(PYTHONPATH=str(self.root)))
        self.assertEqual(result.returncode, 0, result.stderr)
        report = json.loads(result.stdout)
        self.assertTrue(report["torch"].startswith(str(self.root)), report["torch"])
        self.assertIn(UNSHARD.path, report["error"])
        self.assertTrue(report["unchanged"])


class NamesTest(unittest.TestCase):
    def test_every_error_is_a_name_of_the_package(self):
        """What the docs tell users to catch is importable from the package: GraftError and ForkError too."""
        import torch_overlay
        from torch_overlay._fork import ForkError
        from torch_overlay._graft import GraftError

        self.assertIs(torch_overlay.ForkError, ForkError)
        self.assertIs(torch_overlay.GraftError, GraftError)
        for name in torch_overlay.__all__:
            self.assertTrue(hasattr(torch_overlay, name), name)

    def test_no_torch_names_the_releases_it_serves(self):
        """The README's default is 2.13.0 of several: with no torch, the error names every base, no one release."""
        with tempfile.TemporaryDirectory() as tmp:
            venv = Path(tmp) / "venv"
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            python = str(venv / "bin" / "python")
            purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
            self.assertNotEqual(purelib, sysconfig.get_path("purelib"))
            (Path(purelib) / "reach_checkout.pth").write_text(f"{REPO_ROOT}\n")
            result = run([python, "-m", "torch_overlay.activate", "--check"], cwd=Path(tmp))
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        versions = MANIFEST.versions
        self.assertIn(
            f"torch is not installed for {python}. Install one of the releases it serves first, "
            f"{', '.join(versions[:-1])} or {versions[-1]}: `pip install torch==<version>`.",
            result.stdout + result.stderr,
        )


if __name__ == "__main__":
    unittest.main()
