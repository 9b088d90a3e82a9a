"""The patch tools on a synthetic project: generation, determinism, and every way the sync check fails."""

from __future__ import annotations

import os
import subprocess
import tempfile
import unittest
from pathlib import Path
from unittest import mock

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
        self.assertIn(
            "test/fake/test_upstream.py: git hash-object 0e6e563c51a19a754d40745c800f1c8e2b329b4c is not", problems[0]
        )

    def test_stray_edit_after_the_last_hunk_is_found(self) -> None:
        self.regenerate()
        local = self.project.root / "test/fake/test_upstream.py"
        local.write_text(local.read_text() + "# stray edit\n")
        self.assertEqual(
            check(self.project, self.base_dir),
            [
                "test/fake/test_upstream.py: git hash-object cbd08debe0da090d1545b74e1a7511c771c44437 is not the new "
                "blob eaf34ed of test/upstream_edits/test/fake/test_upstream.py.diff; make them equal"
            ],
        )

    def test_stale_patches_report_missing_test_file(self) -> None:
        self.regenerate()
        (self.project.root / "test/fake/test_three.py").write_text("def test_three():\n    pass\n")
        toml = self.project.series_toml
        toml.write_text(
            toml.read_text().replace(
                'tests = ["test/fake/test_two.py"]', 'tests = ["test/fake/test_two.py", "test/fake/test_three.py"]'
            )
        )
        problems = check(self.project, self.base_dir)
        self.assertIn(
            "patches/0002-extend.patch: differs from what the overlay and series.toml generate; run `make patches`",
            problems,
        )
        self.assertIn(
            "test/fake/test_three.py: not created by the applied series (patches/ is stale); run `make patches`",
            problems,
        )


class TestGitIsolation(unittest.TestCase):
    """The tools' git never acts on the caller's repository, nor reads the user's git config."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, self.base_dir = make_project(self.tmp)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_hook_environment_does_not_reach_the_callers_repo(self) -> None:
        user = self.tmp / "user"
        subprocess.run(["git", "init", "-q", str(user)], check=True)
        (user / "a").write_text("a\n")
        subprocess.run(["git", "-C", str(user), "add", "a"], check=True)
        ident = ["-c", "user.name=U", "-c", "user.email=u@x"]
        subprocess.run(["git", "-C", str(user), *ident, "commit", "-qm", "user commit"], check=True)

        def snapshot() -> tuple[str, bytes]:
            refs = subprocess.run(["git", "-C", str(user), "show-ref"], capture_output=True, text=True).stdout
            return refs, (user / ".git" / "index").read_bytes()

        before = snapshot()
        # What git exports to a pre-commit hook of the user's repository.
        hook_env = {
            "GIT_DIR": str(user / ".git"),
            "GIT_INDEX_FILE": str(user / ".git" / "index"),
            "GIT_WORK_TREE": str(user),
        }
        with mock.patch.dict(os.environ, hook_env):
            write(self.project, generate(self.project, pristine_base(self.project.manifest(), self.base_dir)))
            self.assertEqual(check(self.project, self.base_dir), [])
        self.assertEqual(snapshot(), before)

    def test_user_git_config_is_ignored(self) -> None:
        (self.tmp / "home").mkdir()
        (self.tmp / "home" / ".gitconfig").write_text("[apply]\n\twhitespace = fix\n")
        overlay = self.project.overlay_file("torch/fake/beta.py")
        overlay.write_text(overlay.read_text().replace("# extended", "# extended   "))
        with mock.patch.dict(os.environ, {"HOME": str(self.tmp / "home"), "XDG_CONFIG_HOME": str(self.tmp / "home")}):
            write(self.project, generate(self.project, pristine_base(self.project.manifest(), self.base_dir)))
            self.assertEqual(check(self.project, self.base_dir), [])


class TestRealRepo(unittest.TestCase):
    def test_real_repo_patches_in_sync(self) -> None:
        """`make check`'s sync check on this repo (after `make patches` whenever the overlay changes)."""
        self.assertEqual(check(default_project()), [])


if __name__ == "__main__":
    unittest.main()
