"""The version guard refuses a torch that is not the base, names what differs, and changes nothing."""

import json
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from scratch_env import clean_env, run, tamper, torch_tree

from torch_overlay._guard import BaseMismatchError, check_base, require_base
from torch_overlay._manifest import load_manifest

MANIFEST = load_manifest()
UNSHARD = MANIFEST.module("torch.distributed.fsdp._unshard_param_utils")


class GuardTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.torch_dir = torch_tree(self.root, tuple(m.path.removeprefix("torch/") for m in MANIFEST.modules))

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_installed_base_matches(self):
        check = check_base(torch_dir=self.torch_dir)
        self.assertTrue(check.ok, check.problems())
        self.assertEqual(check.expected_version, "2.13.0")

    def test_edited_file_is_named_with_both_hashes(self):
        upstream = UNSHARD.upstream_file(self.torch_dir)
        tamper(upstream, "FLAT_PARAM = ", "FLAT_PARAM  = ")
        with self.assertRaises(BaseMismatchError) as raised:
            require_base("activate the overlay", torch_dir=self.torch_dir)
        message = str(raised.exception)
        self.assertIn("refusing to activate the overlay", message)
        self.assertIn(f"{UNSHARD.path}: sha256 ", message)
        self.assertIn(f"expected {UNSHARD.base_sha256}", message)
        self.assertIn("Nothing was changed", message)
        self.assertIn("pip install --force-reinstall --no-deps torch==2.13.0", message)

    def test_other_version_and_missing_file(self):
        tamper(self.torch_dir / "version.py", "__version__ = '2.13.0", "__version__ = '2.14.0")
        UNSHARD.upstream_file(self.torch_dir).unlink()
        problems = check_base(torch_dir=self.torch_dir).problems()
        self.assertEqual(len(problems), 2, problems)
        self.assertIn("is version 2.14.0+cpu, the overlay's base is 2.13.0", problems[0])
        self.assertIn(f"{UNSHARD.path}: missing", problems[1])

    def test_activate_refuses_in_a_process_and_changes_nothing(self):
        tamper(UNSHARD.upstream_file(self.torch_dir), "FLAT_PARAM = ", "FLAT_PARAM  = ")
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


if __name__ == "__main__":
    unittest.main()
