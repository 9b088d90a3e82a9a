"""The patch tools on a synthetic project: generation, determinism, and every way the sync check fails."""

from __future__ import annotations

import subprocess
import tempfile
import unittest
from pathlib import Path

import expecttest
from _patch_project import make_project

from tools.check import check
from tools.patches import PatchError, generate, write
from tools.pristine import BaseSourceError, pristine_base
from tools.project import default_project


class TestPatches(expecttest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, self.base_dir = make_project(self.tmp)
        self.base = pristine_base(self.project.manifest(), self.base_dir)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def regenerate(self) -> dict[str, bytes]:
        files = generate(self.project, self.base)
        write(self.project, files)
        return files

    def test_series_and_header(self) -> None:
        files = self.regenerate()
        self.assertExpectedInline(
            files["series"].decode(),
            """\
0001-fix-alpha.patch
0002-extend.patch
""",
        )
        header = files["0001-fix-alpha.patch"].decode().split("diff --git")[0]
        self.assertExpectedInline(
            header,
            """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: torch-overlay <torch-overlay@users.noreply.github.com>
Date: Thu, 1 Jan 2026 00:00:00 +0000
Subject: [PATCH 1/2] [FSDP] Fix line 3

Summary:
Line 3 was wrong.

Test Plan:
python test/fake/test_one.py

Fixes #12345

""",
        )
        self.assertEqual(generate(self.project, self.base), files, "regeneration must be byte-identical")
        self.assertEqual(check(self.project, self.base_dir), [])

    def test_series_applies_with_git_apply(self) -> None:
        self.regenerate()
        tree = self.tmp / "tree"
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        for path, content in self.base.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(content)
        for name in (self.project.patches_dir / "series").read_text().split():
            patch = self.project.patches_dir / name
            subprocess.run(["git", "apply", "--exclude=test/fake/test_upstream.py", str(patch)], cwd=tree, check=True)
        for path, content in self.project.overlay_files().items():
            self.assertEqual((tree / path).read_bytes(), content, path)

    def test_drift_names_the_file(self) -> None:
        self.regenerate()
        overlay = self.project.overlay_file("torch/fake/beta.py")
        overlay.write_text(overlay.read_text().replace("2  # extended", "3  # extended"))
        self.assertExpectedInline(
            "\n".join(check(self.project, self.base_dir)),
            """\
patches/0002-extend.patch: differs from what the overlay and series.toml generate; run `make patches`
torch/fake/beta.py: the applied series differs from the overlay file torch_overlay/torch/fake/beta.py""",
        )

    def test_patch_that_does_not_apply(self) -> None:
        self.regenerate()
        patch = self.project.patches_dir / "0001-fix-alpha.patch"
        patch.write_text(patch.read_text().replace(" line 4\n", " line four\n"))
        problems = check(self.project, self.base_dir)
        self.assertIn("patches/0001-fix-alpha.patch: differs", problems[0])
        self.assertIn("patches/0001-fix-alpha.patch: does not apply in order onto the pristine base", problems[1])

    def test_stale_and_missing_patch_files(self) -> None:
        self.regenerate()
        (self.project.patches_dir / "0003-old.patch").write_text("stale")
        (self.project.patches_dir / "0002-extend.patch").unlink()
        problems = check(self.project, self.base_dir)
        self.assertIn("patches/0002-extend.patch: missing; run `make patches`", problems)
        self.assertIn("patches/0003-old.patch: not part of the series any more; run `make patches`", problems)

    def test_base_mismatch(self) -> None:
        (self.base_dir / "torch/fake/beta.py").write_text("edited\n")
        with self.assertRaises(BaseSourceError) as e:
            pristine_base(self.project.manifest(), self.base_dir)
        self.assertIn("torch/fake/beta.py: sha256 ", str(e.exception))
        self.assertIn("is not the pristine base torch 9.9.0", check(self.project, self.base_dir)[0])

    def test_unclaimed_and_doubly_claimed_blocks(self) -> None:
        toml = self.project.series_toml
        text = toml.read_text()
        toml.write_text(text.replace('match = "fixed"', 'match = "fixed|extended"'))
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.base)
        self.assertExpectedInline(
            str(e.exception),
            """\
series.toml does not split the overlay into its patches:
  - torch/fake/alpha.py:15: 'line 15 extended': changed block claimed by several patches: fix-alpha, extend""",
        )
        toml.write_text(text.replace('match = "fixed"', 'match = "nothing"'))
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.base)
        self.assertExpectedInline(
            str(e.exception),
            """\
series.toml does not split the overlay into its patches:
  - torch/fake/alpha.py:3: 'line 3 fixed': changed block claimed by no patch
  - patch 'fix-alpha': claim 'nothing' matches no changed block of torch/fake/alpha.py""",
        )

    def test_upstream_edit_must_match_rewritten_test(self) -> None:
        self.regenerate()
        (self.project.root / "test/fake/test_upstream.py").write_text("import torch\n\n\ndef test_a():\n    assert 3\n")
        problems = check(self.project, self.base_dir)
        self.assertEqual(len(problems), 1)
        self.assertIn("test/fake/test_upstream.py: differs from the new side of the hunk at line 2", problems[0])


class TestRealRepo(unittest.TestCase):
    def test_real_repo_patches_in_sync(self) -> None:
        """`make check`'s sync check on this repo (after `make patches` whenever the overlay changes)."""
        self.assertEqual(check(default_project()), [])


if __name__ == "__main__":
    unittest.main()
