"""Rebase onto a newer torch on synthetic upstream edits: one merges cleanly, one conflicts."""

from __future__ import annotations

import contextlib
import io
import subprocess
import tempfile
import unittest
from pathlib import Path

import expecttest
from _patch_project import BASE, OVERLAY, make_project

from tools import rebase
from tools.check import check
from tools.project import Project


class TestRebase(expecttest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, self.base_dir = make_project(self.tmp)
        root = self.project.root
        (root / "Makefile").write_text("check:\n\ttrue\n")
        (root / ".gitignore").write_text("build/\n")
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        subprocess.run(["git", "-C", str(root), "add", "."], check=True)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def upstream(self, edits: dict[str, tuple[str, str]]) -> Path:
        directory = self.tmp / "upstream"
        for path, text in BASE.items():
            old, new = edits.get(path, ("", ""))
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            (directory / path).write_text(text.replace(old, new) if old else text)
        return directory

    def run_rebase(self, upstream: Path, out: Path) -> str:
        args = ["--root", str(self.project.root), "--wheel", str(self.base_dir), "--upstream", str(upstream)]
        with _Capture() as captured:
            code = rebase.main([*args, "--out", str(out), "--version", "10.0.0"])
        return f"exit {code}\n" + captured.text.replace(str(self.tmp), "<tmp>")

    def test_clean_merge_writes_rebased_project(self) -> None:
        upstream = self.upstream({"torch/fake/alpha.py": ("line 9\n", "line 9 upstream\n")})
        out = self.tmp / "out"
        self.assertExpectedInline(
            self.run_rebase(upstream, out),
            """\
exit 0
torch/fake/alpha.py: clean
torch/fake/beta.py: clean
rebase: torch 9.9.0 -> 10.0.0, all files clean; written to <tmp>/out
patches/ regenerated: 0001-fix-alpha.patch, 0002-extend.patch, series
""",
        )
        rebased = Project(out)
        merged = rebased.overlay_file("torch/fake/alpha.py").read_text()
        self.assertIn("line 9 upstream\n", merged)
        self.assertIn("line 3 fixed\n", merged)
        self.assertEqual(rebased.manifest().version, "10.0.0")
        self.assertEqual(check(rebased, upstream), [], "the rebased project is in sync against the new base")
        # The whole tracked tree travels, so the output can run its own `make check` and `make test`.
        for path in ["Makefile", ".gitignore", "test/fake/test_upstream.py", "test/upstream_edits"]:
            self.assertTrue((out / path).exists(), path)
        self.assertTrue((out / rebase.MARKER).is_file())
        self.assertIn("exit 0", self.run_rebase(upstream, out), "a previous rebase output is replaced")
        inside = self.project.root / "build" / "rebase"
        self.assertIn("exit 0", self.run_rebase(upstream, inside), "an ignored directory of the project is fine")

    def test_refuses_an_out_it_could_destroy(self) -> None:
        upstream = self.upstream({})
        other = self.tmp / "other"
        other.mkdir()
        (other / "keep.txt").write_text("mine\n")
        for out in [self.project.root, self.tmp, self.project.root / "torch_overlay", other]:
            text = self.run_rebase(upstream, out)
            self.assertTrue(text.startswith("exit 1\n"), text)
            self.assertIn(f"rebase: --out {out}".replace(str(self.tmp), "<tmp>"), text)
        self.assertEqual((other / "keep.txt").read_text(), "mine\n")
        self.assertTrue((self.project.root / ".git").is_dir())
        self.assertEqual(OVERLAY["torch/fake/beta.py"], self.project.overlay_file("torch/fake/beta.py").read_text())
        self.assertEqual([p.name for p in self.tmp.iterdir() if p.name.startswith(".")], [])

    def test_conflict_writes_nothing(self) -> None:
        upstream = self.upstream({"torch/fake/beta.py": ("return 1", "return 10")})
        out = self.tmp / "out"
        self.assertExpectedInline(
            self.run_rebase(upstream, out),
            """\
exit 1
torch/fake/alpha.py: clean
torch/fake/beta.py: CONFLICT (1 conflicting hunks)
rebase: conflicts; nothing written. Resolve them by hand on torch 10.0.0.
""",
        )
        self.assertFalse(out.exists())
        self.assertEqual(OVERLAY["torch/fake/beta.py"], self.project.overlay_file("torch/fake/beta.py").read_text())


class _Capture:
    """stdout and stderr of a CLI call, in order."""

    def __enter__(self) -> _Capture:
        self._buffer = io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._buffer))
        self._stack.enter_context(contextlib.redirect_stderr(self._buffer))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self.text = self._buffer.getvalue()


if __name__ == "__main__":
    unittest.main()
