"""The manifest's rule for the payloads: a runtime file may differ between bases in comments where its module
records the code digest they share (``code_sha256``), and in code where the other base has its own payload
(``base_payloads``)."""

from __future__ import annotations

import json
import re
import tempfile
import unittest
from pathlib import Path

from _patch_project import BASE, BETA, manifest_text

from torch_overlay._manifest import PACKAGE_DIR, code_sha256, load_manifest

CODE = b'''"""A module."""

import os  # for the path


def f(x):
    # the answer
    return os.path.join(x, f"{x!r:>{4}}")  # done
'''


class TestCodeSha256(unittest.TestCase):
    def test_comments_and_layout_do_not_count(self) -> None:
        comments = CODE.replace(b"# the answer", b"# the answer, originally created").replace(b"  # done", b"")
        layout = CODE.replace(b"import os  #", b"\n\nimport os#").replace(b"(x, ", b"(\n        x,\n        ")
        self.assertEqual(code_sha256(comments), code_sha256(CODE))
        self.assertEqual(code_sha256(layout), code_sha256(CODE))

    def test_code_docstrings_and_strings_count(self) -> None:
        for old, new in [
            (b"return os", b"return  not os"),  # code
            (b'"""A module."""', b'"""A module!"""'),  # docstring
            (b'f"{x!r:>{4}}"', b'f"{x!r:>{5}}"'),  # inside an f-string (Python 3.12+ splits it in tokens)
            (b"    return", b"\treturn"),  # indentation
        ]:
            with self.subTest(new=new):
                self.assertIn(old, CODE)
                self.assertNotEqual(code_sha256(CODE.replace(old, new)), code_sha256(CODE))

    def test_known_digest(self) -> None:
        """The digest is the same on every Python version: a change here breaks every recorded code_sha256."""
        self.assertEqual(code_sha256(CODE), "0897dd92b7b7a2a56da1a56e60f40af324ac75f39eed3304cac022c920a55532")


class TestRuntimeFileRule(unittest.TestCase):
    """``torch/fake/beta.py`` is served at run time (see _patch_project); 9.8.0's differs in a comment."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.path = Path(self._tmp.name) / "manifest.json"
        self.old = {**BASE, "torch/fake/beta.py": "# originally created for testing\n" + BETA}

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_runtime_file_differing_between_bases_is_refused(self) -> None:
        self.path.write_text(manifest_text({"9.8.0": self.old, "9.9.0": BASE}))
        with self.assertRaises(RuntimeError) as raised:
            load_manifest(self.path)
        self.assertIn(
            "base 9.8.0: runtime file torch/fake/beta.py differs from the payload base 9.9.0's and has no payload of "
            'its own: list the base in the module\'s "base_payloads" (`make rebase` does, `make patches` writes the '
            "file; `make check` verifies it), or, if they differ only in comments, record their code digest as its "
            '"code_sha256"',
            str(raised.exception),
        )

    def test_runtime_file_differing_in_code_is_served_from_its_base_payload(self) -> None:
        """One payload per distinct upstream file: 9.7.0 ships 9.8.0's beta.py, so it is served 9.8.0's payload."""
        bases = {"9.7.0": self.old, "9.8.0": self.old, "9.9.0": BASE}
        self.path.write_text(manifest_text(bases, base_payloads={"torch/fake/beta.py": ["9.7.0"]}))
        manifest = load_manifest(self.path)
        beta = manifest.module("torch.fake.beta")
        served = {b.version: manifest.payload_file(beta, b) for b in manifest.bases}
        own = str(Path(PACKAGE_DIR, "bases", "9.7.0", "torch", "fake", "beta.py"))
        self.assertEqual(served, {"9.7.0": own, "9.8.0": own, "9.9.0": beta.overlay_file})
        self.assertEqual(beta.payload_files, (beta.overlay_file, own))

    def test_base_payloads_name_each_distinct_file_once_by_its_oldest_base(self) -> None:
        bases = {"9.7.0": self.old, "9.8.0": self.old, "9.9.0": BASE}
        for listed, problem in [
            (["9.8.0"], "base_payloads lists 9.8.0, but the payload of torch 9.7.0's file"),
            (["9.7.0", "9.8.0"], "base_payloads lists 9.8.0, but the payload of torch 9.7.0's file"),
            (["9.9.0"], "base_payloads lists 9.9.0, not a base older than 9.9.0"),
            (["9.6.0"], "base_payloads lists 9.6.0, not a base older than 9.9.0"),
        ]:
            with self.subTest(listed=listed):
                self.path.write_text(manifest_text(bases, base_payloads={"torch/fake/beta.py": listed}))
                with self.assertRaisesRegex(RuntimeError, re.escape(problem)):
                    load_manifest(self.path)

    def test_runtime_file_with_code_sha256_is_accepted(self) -> None:
        digest = code_sha256(BETA.encode())
        self.path.write_text(manifest_text({"9.8.0": self.old, "9.9.0": BASE}, {"torch/fake/beta.py": digest}))
        manifest = load_manifest(self.path)
        self.assertEqual(manifest.module("torch.fake.beta").code_sha256, digest)
        self.assertIsNone(manifest.module("torch.fake.alpha").code_sha256)

    def test_code_sha256_must_be_a_sha256(self) -> None:
        self.path.write_text(manifest_text({"9.9.0": BASE}, {"torch/fake/beta.py": "abc"}))
        with self.assertRaisesRegex(RuntimeError, "module torch.fake.beta has code_sha256 'abc', not a sha256"):
            load_manifest(self.path)


class TestNewModule(unittest.TestCase):
    """A new module (no upstream counterpart) is recorded absent (null) on every base, and only it is."""

    def manifest(self, gamma_sha256: str | None, new: bool = True) -> Path:
        raw = json.loads(manifest_text({"9.9.0": BASE}))
        raw["modules"].append({"name": "torch.fake.gamma", "path": "torch/fake/gamma.py", "new": new})
        raw["bases"][0]["sha256"]["torch/fake/gamma.py"] = gamma_sha256
        path = Path(self._tmp.name) / "manifest.json"
        path.write_text(json.dumps(raw))
        return path

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_new_module_recorded_absent(self) -> None:
        manifest = load_manifest(self.manifest(None))
        self.assertEqual([m.name for m in manifest.new_modules], ["torch.fake.gamma"])
        self.assertNotIn("torch/fake/gamma.py", manifest.payload_base.upstream)

    def test_new_module_with_a_sha256_or_absent_file_of_a_replaced_module_is_refused(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "gamma.py must be recorded as null .a new module"):
            load_manifest(self.manifest("0" * 64))
        with self.assertRaisesRegex(RuntimeError, "gamma.py must be recorded as its upstream file's sha256"):
            load_manifest(self.manifest(None, new=False))


if __name__ == "__main__":
    unittest.main()
