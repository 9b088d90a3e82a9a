"""Adding a torch release in place, on synthetic upstream files: clean (newer and older), conflicting, a
changed runtime file (in code: a payload of its own for the other bases; in comments only: the code digest), a
failed sync check, and a release already listed."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import unittest
from pathlib import Path

import expecttest
from _patch_project import ALPHA, BASE, OLD_BASE, OVERLAY, add_new_module, make_project, manifest_text

from tools import rebase
from tools.check import check
from tools.patches import generate, generated_files, write
from tools.pristine import pristine
from torch_overlay._manifest import code_sha256


class TestRebase(expecttest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, self.sources = make_project(self.tmp)
        write(self.project, generate(self.project, pristine(self.project, self.sources)))
        self.assertEqual(check(self.project, self.sources), [])
        self.before = self.snapshot()

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def snapshot(self) -> dict[str, bytes]:
        """Every file the rebase may change: manifest, pyproject, overlay files, patches/."""
        p = self.project
        files = [p.manifest_path, p.pyproject, *generated_files(p.patches_dir)]
        files += [p.overlay_file(path) for path in BASE] + sorted(p.bases_dir.rglob("*.py"))
        return {str(f.relative_to(p.root)): f.read_bytes() for f in files if f.is_file()}

    def upstream(self, version: str, files: dict[str, str]) -> Path:
        directory = self.tmp / f"upstream-{version}"
        for path, text in files.items():
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            (directory / path).write_text(text)
        (directory / "torch").mkdir(exist_ok=True)
        (directory / "torch/version.py").write_text(f"__version__ = '{version}+cpu'\n")
        return directory

    def run_rebase(self, upstream: Path) -> str:
        args = ["--root", str(self.project.root), "--upstream", str(upstream)]
        args += [arg for source in self.sources for arg in ("--wheel", str(source))]
        with _Capture() as captured:
            code = rebase.main(args)
        return f"exit {code}\n" + captured.text.replace(str(self.tmp), "<tmp>")

    def test_newer_release_is_added_in_place(self) -> None:
        alpha = BASE["torch/fake/alpha.py"].replace("line 7\n", "line 7 upstream\n")
        upstream = self.upstream("10.0.0", {**BASE, "torch/fake/alpha.py": alpha})
        text = self.run_rebase(upstream)
        self.assertExpectedInline(
            text,
            """\
exit 0
torch/fake/alpha.py: clean
torch/fake/beta.py: clean
rebase: torch 10.0.0 added; the bases are now 9.8.0, 9.9.0, 10.0.0; patches/ regenerated; sync check passed
Next: `make install TORCH=10.0.0 && make test TORCH=10.0.0` (the stock stage tells which fixes upstream made), then the README's table of releases.
""",  # noqa: E501
        )
        manifest = self.project.manifest()
        self.assertEqual(manifest.versions, ("9.8.0", "9.9.0", "10.0.0"))
        merged = self.project.overlay_file("torch/fake/alpha.py").read_text()
        self.assertEqual(merged, OVERLAY["torch/fake/alpha.py"].replace("line 7\n", "line 7 upstream\n"))
        self.assertIsNone(self.project.declared_requirement(), "the package requires no torch")
        self.sources.append(upstream)
        self.assertEqual(check(self.project, self.sources), [])
        self.assertIn("series-9.8.0", [f.name for f in generated_files(self.project.patches_dir)])
        self.assertIn("exit 0\nrebase: torch 10.0.0 is already a base, with these files", self.run_rebase(upstream))

    def test_older_release_keeps_the_payload(self) -> None:
        upstream = self.upstream("9.7.0", OLD_BASE)
        text = self.run_rebase(upstream)
        self.assertIn("rebase: torch 9.7.0 added; the bases are now 9.7.0, 9.8.0, 9.9.0", text)
        after = self.snapshot()
        for path in ["torch_overlay/torch/fake/alpha.py", "torch_overlay/torch/fake/beta.py"]:
            self.assertEqual(after[path], self.before[path], path)
        self.assertEqual((self.project.patches_dir / "series-9.7.0").read_text().split()[-1], "0003-backport.patch")

    def test_conflict_changes_nothing(self) -> None:
        alpha = BASE["torch/fake/alpha.py"].replace("line 3\n", "line 3 upstream\n")
        text = self.run_rebase(self.upstream("10.0.0", {**BASE, "torch/fake/alpha.py": alpha}))
        self.assertExpectedInline(
            text,
            """\
exit 1
torch/fake/alpha.py: CONFLICT (1 conflicting hunks)
torch/fake/beta.py: clean
rebase: nothing changed. Fix the payload, not build/rebase-10.0.0 (the merges there are for reading only):
  torch_overlay/torch/fake/alpha.py: move our change off the lines torch 10.0.0 has otherwise
  (CONFLICT: lines it changed next to ours; does not apply: a patch's context lines), then
  `make patches`, `make check` and `make rebase` again (docs/patches.md, 'Add a torch release')
""",
        )
        self.assertEqual(self.snapshot(), self.before)
        review = self.project.root / "build/rebase-10.0.0/torch/fake/alpha.py"
        self.assertIn("<<<<<<< overlay/torch/fake/alpha.py", review.read_text())

    def test_older_release_whose_context_lines_changed_changes_nothing(self) -> None:
        """The merge is clean (upstream changed line 5, ours is line 3), but fix-alpha's hunk needs line 5 as
        its context: the sync check would refuse the series on it, so the per-file report says so first."""
        alpha = OLD_BASE["torch/fake/alpha.py"].replace("line 5\n", "line 5 old\n")
        text = self.run_rebase(self.upstream("9.7.0", {**OLD_BASE, "torch/fake/alpha.py": alpha}))
        self.assertExpectedInline(
            text,
            """\
exit 1
torch/fake/alpha.py: merges cleanly, but patches/0001-fix-alpha.patch does not apply (its hunk at line 1)
torch/fake/beta.py: clean
rebase: nothing changed. Fix the payload, not build/rebase-9.7.0 (the merges there are for reading only):
  torch_overlay/torch/fake/alpha.py: move our change off the lines torch 9.7.0 has otherwise
  (CONFLICT: lines it changed next to ours; does not apply: a patch's context lines), then
  `make patches`, `make check` and `make rebase` again (docs/patches.md, 'Add a torch release')
""",
        )
        self.assertEqual(self.snapshot(), self.before)

    def serve_alpha_at_run_time(self) -> None:
        """alpha.py served at run time too, 9.8.0's being 9.9.0's (beta.py is too short for a change upstream:
        a patch of a two-line file does not apply to a file with one more line)."""
        (self.sources[1] / "torch/fake/alpha.py").write_text(ALPHA)
        bases = {"9.8.0": {**OLD_BASE, "torch/fake/alpha.py": ALPHA}, "9.9.0": BASE}
        self.project.manifest_path.write_text(manifest_text(bases, runtime=tuple(BASE)))
        write(self.project, generate(self.project, pristine(self.project, self.sources)))
        self.assertEqual(check(self.project, self.sources), [])
        self.before = self.snapshot()

    def upstream_alpha(self, version: str, old: str, new: str) -> Path:
        """A release whose alpha.py has ``new`` for ``old``."""
        return self.upstream(version, {**BASE, "torch/fake/alpha.py": ALPHA.replace(old, new)})

    def test_runtime_file_changed_in_code_gives_the_other_bases_their_own_payload(self) -> None:
        self.serve_alpha_at_run_time()
        upstream = self.upstream_alpha("10.0.0", "line 7\n", "line 7 x\n")
        text = self.run_rebase(upstream)
        self.assertExpectedInline(
            text,
            """\
exit 0
torch/fake/alpha.py: clean
torch/fake/beta.py: clean
torch/fake/alpha.py: changed upstream in code; each base with another file of it than the newest base's gets its own payload (torch_overlay/bases/<version>/..., our change transplanted)
rebase: torch 10.0.0 added; the bases are now 9.8.0, 9.9.0, 10.0.0; patches/ regenerated; sync check passed
Next: `make install TORCH=10.0.0 && make test TORCH=10.0.0` (the stock stage tells which fixes upstream made), then the README's table of releases.
""",  # noqa: E501
        )
        # 9.8.0 and 9.9.0 ship one file: one payload, by the oldest; it is the payload made on 9.9.0, as it was.
        alpha = self.project.manifest().module("torch.fake.alpha")
        self.assertEqual(alpha.base_payloads, ("9.8.0",))
        own = self.project.base_payload_file("9.8.0", "torch/fake/alpha.py")
        self.assertEqual(own.read_bytes(), self.before["torch_overlay/torch/fake/alpha.py"])
        self.assertIn("line 7 x\n", self.project.overlay_file("torch/fake/alpha.py").read_text())
        self.sources.append(upstream)
        self.assertEqual(check(self.project, self.sources), [])

        # An older release with that file: the payload is named by it now, the one by 9.8.0 is gone.
        self.assertIn(
            "rebase: torch 9.7.0 added", self.run_rebase(self.upstream_alpha("9.7.0", "line 7\n", "line 7\n"))
        )
        self.assertEqual(self.project.manifest().module("torch.fake.alpha").base_payloads, ("9.7.0",))
        self.assertFalse(own.exists())
        self.assertEqual(
            self.project.base_payload_file("9.7.0", "torch/fake/alpha.py").read_bytes(),
            self.before["torch_overlay/torch/fake/alpha.py"],
        )

    def test_runtime_file_changed_in_comments_only_is_added(self) -> None:
        self.serve_alpha_at_run_time()
        upstream = self.upstream_alpha("10.0.0", "line 7\n", "line 7  # upstream\n")
        digest = code_sha256(ALPHA.encode())
        self.assertEqual(
            self.run_rebase(upstream),
            f"""\
exit 0
torch/fake/alpha.py: clean
torch/fake/beta.py: clean
torch/fake/alpha.py: changed upstream in comments only; the one payload serves it (code_sha256 {digest})
rebase: torch 10.0.0 added; the bases are now 9.8.0, 9.9.0, 10.0.0; patches/ regenerated; sync check passed
Next: `make install TORCH=10.0.0 && make test TORCH=10.0.0` (the stock stage tells which fixes upstream made), then the README's table of releases.
""",  # noqa: E501
        )
        self.assertEqual(self.project.manifest().module("torch.fake.alpha").code_sha256, digest)
        self.assertIn("line 7  # upstream\n", self.project.overlay_file("torch/fake/alpha.py").read_text())
        self.sources.append(upstream)
        self.assertEqual(check(self.project, self.sources), [])

        # An older release changed in comments only too: the module keeps its code_sha256, and re-adding a base
        # gives the manifest back byte for byte.
        older = self.upstream_alpha("9.7.0", "line 20\n", "line 20  # older\n")
        self.assertIn("rebase: torch 9.7.0 added", self.run_rebase(older))
        manifest = self.project.manifest_path.read_bytes()
        raw = json.loads(manifest)
        raw["bases"] = [b for b in raw["bases"] if b["version"] != "9.7.0"]
        self.project.manifest_path.write_text(json.dumps(raw, indent=2) + "\n")
        self.assertIn("rebase: torch 9.7.0 added", self.run_rebase(older))
        self.assertEqual(self.project.manifest_path.read_bytes(), manifest)

    def test_failed_sync_check_puts_every_file_back(self) -> None:
        """Upstream changed a context line of the backport: the series made on the new release no longer
        applies to 9.8.0's file, so the release cannot be added as it is."""
        alpha = BASE["torch/fake/alpha.py"].replace("line 10\n", "line 10 upstream\n")
        text = self.run_rebase(self.upstream("10.0.0", {**BASE, "torch/fake/alpha.py": alpha}))
        self.assertIn("torch/fake/alpha.py: clean", text)
        self.assertIn(
            "rebase: sync check failed: torch 9.8.0: patches/0003-backport.patch: does not apply in order onto the "
            "pristine files",
            text,
        )
        self.assertIn("rebase: torch 10.0.0 was not added; every file was put back as it was", text)
        self.assertEqual(self.snapshot(), self.before)
        self.assertEqual(self.project.manifest().versions, ("9.8.0", "9.9.0"))

    def test_release_shipping_a_new_module_is_refused(self) -> None:
        add_new_module(self.project)
        write(self.project, generate(self.project, pristine(self.project, self.sources)))
        before = self.snapshot()
        upstream = self.upstream("10.0.0", {**BASE, "torch/fake/gamma.py": "upstream = True\n"})
        self.assertExpectedInline(
            self.run_rebase(upstream),
            """\
exit 1
rebase: torch 10.0.0 ships torch/fake/gamma.py, which the overlay adds as a new module (no base has it): serving ours would shadow upstream's. Port our change onto upstream's module (make it a replaced module in manifest.json and series.toml) or drop ours; nothing changed
""",  # noqa: E501
        )
        self.assertEqual(self.snapshot(), before)
        (upstream / "torch/fake/gamma.py").unlink()  # without it, the release joins, the module recorded absent
        self.assertIn("rebase: torch 10.0.0 added", self.run_rebase(upstream))
        self.assertIsNone(self.project.manifest().base("10.0.0").sha256["torch/fake/gamma.py"])

    def test_listed_release_with_other_files_is_refused(self) -> None:
        edited = {**BASE, "torch/fake/beta.py": "edited\n"}
        text = self.run_rebase(self.upstream("9.9.0", edited))
        self.assertIn("exit 1\nrebase: torch 9.9.0 is already a base, but <tmp>/upstream-9.9.0's files differ", text)
        self.assertEqual(self.snapshot(), self.before)


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
