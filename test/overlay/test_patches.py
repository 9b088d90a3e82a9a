"""The patch tools on a synthetic project: generation, determinism, per-base series, and every way the sync
check fails."""

from __future__ import annotations

import io
import os
import subprocess
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import expecttest
from _patch_project import (
    ALPHA,
    BASE,
    BETA,
    GAMMA,
    OLD_BASE,
    OVERLAY,
    SHARED_MID,
    SHARED_NEW,
    SHARED_OLD,
    add_new_module,
    git_diff,
    make_project,
    manifest_text,
    share_upstream_edit,
)
from _patch_project import write as write_files

from tools.check import check
from tools.patches import PatchError, _format_patch, generate, git, write
from tools.pristine import pristine
from tools.project import default_project
from tools.transplant import main as transplant_main
from torch_overlay._guard import find_torch_dir
from torch_overlay._manifest import code_sha256


class TestPatches(expecttest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, self.sources = make_project(self.tmp)
        self.found = pristine(self.project, self.sources)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def regenerate(self) -> dict[str, bytes]:
        files = generate(self.project, self.found)
        write(self.project, files)
        return files

    def check(self) -> list[str]:
        return check(self.project, self.sources)

    def test_series_and_header(self) -> None:
        files = self.regenerate()
        self.assertExpectedInline(
            files["series"].decode() + "--- series-9.8.0\n" + files["series-9.8.0"].decode(),
            """\
0001-fix-alpha.patch
0002-extend.patch
--- series-9.8.0
0001-fix-alpha.patch
0002-extend.patch
0003-backport.patch
""",
        )
        header = files["0001-fix-alpha.patch"].decode().split("diff --git")[0]
        self.assertExpectedInline(
            header,
            """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Pat Maintainer <pat@example.com>
Date: Thu, 1 Jan 2026 00:00:00 +0000
Subject: [PATCH 1/2] [FSDP] Fix line 3

Summary:
Line 3 was wrong.

Test Plan:
python test/fake/test_one.py

Fixes #12345

""",
        )
        backport = files["0003-backport.patch"].decode().split("diff --git")[0]
        self.assertExpectedInline(
            backport,
            """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Pat Maintainer <pat@example.com>
Date: Thu, 1 Jan 2026 00:00:00 +0000
Subject: [PATCH backport 1/1] [FSDP] Backport line 12

Summary:
Line 12, as upstream fixed it in 9.9.0.

Backport only: torch 9.9.0 fixed this upstream, so this patch is for the
releases before it and is not part of the upstream series
(patches/series).

Test Plan:
python test/fake/test_three.py

""",
        )
        self.assertEqual(generate(self.project, self.found), files, "regeneration must be byte-identical")
        self.assertEqual(self.check(), [])

    def test_upstream_edit_note_is_below_the_message(self) -> None:
        # git am and ghstack take the message up to "---": the note is for whoever applies the file, not the PR.
        text = self.regenerate()["0002-extend.patch"].decode()
        self.assertExpectedInline(
            text[text.index("Test Plan:") : text.index("diff --git")],
            """\
Test Plan:
python test/fake/test_two.py

---
Note: the changes to test/fake/test_upstream.py were made against
pytorch/pytorch@abc123, and the rest of this patch against torch 9.9.0's
files; each index line names its upstream blob, so `git am -3` applies
the patch on another commit.

""",
        )

    def test_author_is_required(self) -> None:
        toml = self.project.series_toml
        toml.write_text(toml.read_text().replace('author = "Pat Maintainer <pat@example.com>"', ""))
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
        self.assertExpectedInline(
            str(e.exception).replace(str(toml), "series.toml"),
            """\
series.toml: the top-level author = "Name <email>" (the From: of the generated patches) is missing or malformed (None).
Set it once, from `git config user.name` and `git config user.email`.""",
        )

    def apply(self, index: str, base: dict[str, str]) -> Path:
        """A git tree holding ``base`` after `git apply` of every patch ``patches/<index>`` lists."""
        tree = self.tmp / f"tree-{index}"
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        for path, text in base.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)
        for name in (self.project.patches_dir / index).read_text().split():
            patch = self.project.patches_dir / name
            subprocess.run(["git", "apply", "--exclude=test/fake/test_upstream.py", str(patch)], cwd=tree, check=True)
        return tree

    def test_each_base_series_applies_with_git_apply(self) -> None:
        self.regenerate()
        newest = self.apply("series", BASE)  # the upstream series: no backport
        alpha = "torch/fake/alpha.py"
        self.assertEqual((newest / alpha).read_text(), OVERLAY[alpha].replace("line 12 backported\n", "line 12\n"))
        self.assertEqual((newest / "torch/fake/beta.py").read_text(), OVERLAY["torch/fake/beta.py"])
        self.assertFalse((newest / "test/fake/test_three.py").exists())
        older = self.apply("series-9.8.0", OLD_BASE)  # with the backport, onto 9.8.0's own alpha.py
        self.assertEqual((older / alpha).read_text(), OVERLAY[alpha].replace("line 20\n", "line 20 old\n"))
        self.assertTrue((older / "test/fake/test_three.py").exists())

    def test_drift_names_the_file(self) -> None:
        self.regenerate()
        overlay = self.project.overlay_file("torch/fake/beta.py")
        overlay.write_text(overlay.read_text().replace("2  # extended", "3  # extended"))
        self.assertExpectedInline(
            "\n".join(self.check()),
            """\
patches/0002-extend.patch: differs from what the overlay and series.toml generate; run `make patches`
torch 9.8.0: torch/fake/beta.py: the applied series differs from the overlay file torch_overlay/torch/fake/beta.py
torch 9.9.0: torch/fake/beta.py: the applied series differs from the overlay file torch_overlay/torch/fake/beta.py""",
        )

    def test_new_module_is_a_new_file_of_its_patch(self) -> None:
        """A module no release ships is added whole by the patch that claims it, on every base."""
        add_new_module(self.project)
        files = self.regenerate()
        gamma = "diff --git a/torch/fake/gamma.py b/torch/fake/gamma.py\nnew file mode 100644\n"
        self.assertNotIn("gamma.py", files["0001-fix-alpha.patch"].decode())
        self.assertIn(gamma, files["0002-extend.patch"].decode())
        self.assertEqual(self.check(), [])
        self.assertEqual((self.apply("series-9.8.0", OLD_BASE) / "torch/fake/gamma.py").read_text(), GAMMA)
        overlay = self.project.overlay_file("torch/fake/gamma.py")
        overlay.write_text(GAMMA.replace("3  #", "4  #"))
        self.assertExpectedInline(
            "\n".join(self.check()),
            """\
patches/0002-extend.patch: differs from what the overlay and series.toml generate; run `make patches`
torch 9.8.0: torch/fake/gamma.py: the applied series differs from the overlay file torch_overlay/torch/fake/gamma.py
torch 9.9.0: torch/fake/gamma.py: the applied series differs from the overlay file torch_overlay/torch/fake/gamma.py""",
        )

    def test_patch_that_does_not_apply(self) -> None:
        self.regenerate()
        patch = self.project.patches_dir / "0001-fix-alpha.patch"
        patch.write_text(patch.read_text().replace(" line 4\n", " line four\n"))
        problems = self.check()
        self.assertIn("patches/0001-fix-alpha.patch: differs", problems[0])
        for problem, version in zip(problems[1:], ["9.8.0", "9.9.0"], strict=True):
            self.assertIn(f"torch {version}: patches/0001-fix-alpha.patch: does not apply in order onto the", problem)

    def test_stale_and_missing_patch_files(self) -> None:
        self.regenerate()
        (self.project.patches_dir / "0003-old.patch").write_text("stale")
        (self.project.patches_dir / "0002-extend.patch").unlink()
        (self.project.patches_dir / "series-9.9.0").write_text("stale")
        problems = self.check()
        self.assertIn("patches/0002-extend.patch: missing; run `make patches`", problems)
        self.assertIn("patches/0003-old.patch: not part of the series any more; run `make patches`", problems)
        self.assertIn("patches/series-9.9.0: not part of the series any more; run `make patches`", problems)

    def test_base_files_found_by_content(self) -> None:
        """A source whose file is not the recorded one is passed over; a base nobody holds is named."""
        self.regenerate()
        for source in self.sources:
            (source / "torch/fake/beta.py").write_text("edited\n")
        self.assertExpectedInline(
            self.check()[0].replace(str(self.tmp), "<tmp>").replace(str(find_torch_dir().parent), "<installed>"),
            """\
the pristine files of torch 9.9.0 are not on this machine: torch/fake/beta.py (with the sha256 manifest.json records) is in none of these sources:
    <tmp>/base
    <tmp>/base-9.8.0
    <installed>
Run `make sources` (downloads the missing bases' wheels), or `make install TORCH=9.9.0`, or pass the torch 9.9.0 wheel with --wheel (make: WHEEL=).""",  # noqa: E501
        )
        # 9.9.0's beta.py is 9.8.0's: the older base's directory serves both once its copy is pristine.
        (self.sources[1] / "torch/fake/beta.py").write_text(BASE["torch/fake/beta.py"])
        self.assertEqual(self.check(), [])
        (self.sources[0] / "torch/fake/beta.py").write_text(BASE["torch/fake/beta.py"])
        self.assertIn(
            "torch 9.8.0: the pristine files of torch 9.8.0 are not on this machine: torch/fake/alpha.py",
            check(self.project, self.sources[:1])[0],
        )

    def test_the_package_must_not_require_torch(self) -> None:
        self.regenerate()
        self.project.pyproject.write_text('[project]\nname = "fake"\ndependencies = ["torch>=9.8,<9.10"]\n')
        self.assertExpectedInline(
            "\n".join(self.check()),
            """pyproject.toml: the dependency 'torch>=9.8,<9.10' must go: pip would install, upgrade or downgrade the user's torch to meet it; the guard checks the release at activation (docs/activation.md, 'Install')""",  # noqa: E501
        )

    def test_backports_come_last(self) -> None:
        toml = self.project.series_toml
        text = toml.read_text()
        first, backport = text.split('[[patch]]\nname = "backport"')
        toml.write_text('[[patch]]\nname = "backport"' + backport + "\n" + first)
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
        self.assertIn("the backports (backport, fixed upstream) must come after every other patch", str(e.exception))

    def test_change_that_does_not_transplant_onto_an_older_base(self) -> None:
        self.regenerate()
        old = self.sources[1] / "torch/fake/alpha.py"
        old.write_text(OLD_BASE["torch/fake/alpha.py"].replace("line 15\n", "line 15 old\n"))
        manifest = self.project.manifest_path
        older = {**OLD_BASE, "torch/fake/alpha.py": old.read_text()}
        manifest.write_text(manifest_text({"9.8.0": older, "9.9.0": BASE}))
        self.assertExpectedInline(
            "\n".join(self.check()),
            """torch 9.8.0: torch/fake/alpha.py: our change does not merge cleanly onto torch 9.8.0's file (1 conflicting hunks); the one payload cannot serve this base (docs/patches.md, 'Add a torch release')""",  # noqa: E501
        )

    def runtime_alpha(self, old_alpha: str) -> None:
        """Serve alpha.py at run time too, 9.8.0's being ``old_alpha``, the manifest claiming 9.9.0's code for it.

        (beta.py is too short: a patch of a two-line file does not apply to a file with one more line.)
        """
        (self.sources[1] / "torch/fake/alpha.py").write_text(old_alpha)
        bases = {"9.8.0": {**OLD_BASE, "torch/fake/alpha.py": old_alpha}, "9.9.0": BASE}
        claim = {"torch/fake/alpha.py": code_sha256(BASE["torch/fake/alpha.py"].encode())}
        self.project.manifest_path.write_text(manifest_text(bases, claim, runtime=tuple(BASE)))
        self.found = pristine(self.project, self.sources)
        self.regenerate()

    def test_runtime_file_differing_in_comments_only(self) -> None:
        self.runtime_alpha(BASE["torch/fake/alpha.py"].replace("line 20\n", "line 20  # originally create\n"))
        self.assertEqual(self.check(), [])

    def test_code_sha256_that_a_base_does_not_have(self) -> None:
        self.runtime_alpha(OLD_BASE["torch/fake/alpha.py"])  # "line 20 old": a code change
        found, claimed = (code_sha256(files["torch/fake/alpha.py"].encode()) for files in (OLD_BASE, BASE))
        self.assertEqual(
            self.check(),
            [
                f"torch 9.8.0: torch/fake/alpha.py: code sha256 {found}, but manifest.json's code_sha256 for "
                f"torch.fake.alpha is {claimed}: every base's file must have that code (comments aside) for the one "
                "payload to serve it (docs/patches.md, 'Add a torch release')"
            ],
        )

    def test_base_payload_is_the_transplant(self) -> None:
        """alpha.py served at run time, 9.8.0's differing in code: 9.8.0 gets its own payload, written by
        tools.transplant (after every edit of the payload) and checked by the sync check."""
        bases = {"9.8.0": OLD_BASE, "9.9.0": BASE}
        own = {"torch/fake/alpha.py": ["9.8.0"]}
        self.project.manifest_path.write_text(manifest_text(bases, runtime=tuple(BASE), base_payloads=own))
        self.found = pristine(self.project, self.sources)
        self.regenerate()
        regenerate = "run `make patches` (python -m tools.transplant)"
        where = "torch_overlay/bases/9.8.0/torch/fake/alpha.py"
        self.assertEqual(self.check(), [f"{where}: missing; {regenerate}"])

        def transplant() -> str:
            args = ["--root", str(self.project.root)] + [a for s in self.sources for a in ("--wheel", str(s))]
            with mock.patch("sys.stdout", new_callable=io.StringIO) as out:
                self.assertEqual(transplant_main(args), 0)
            return out.getvalue()

        self.assertEqual(transplant(), f"{where}: written\n")
        payload = self.project.base_payload_file("9.8.0", "torch/fake/alpha.py")
        self.assertEqual(payload.read_text(), OVERLAY["torch/fake/alpha.py"].replace("line 20\n", "line 20 old\n"))
        self.assertEqual(self.check(), [])

        # The payload edited (within a claimed block): the base's payload must follow.
        overlay = self.project.overlay_file("torch/fake/alpha.py")
        overlay.write_text(overlay.read_text().replace("line 15 extended", "line 15 extended more"))
        self.regenerate()
        self.assertEqual(
            self.check(),
            [
                f"{where}: not our change in torch_overlay/torch/fake/alpha.py transplanted onto torch 9.8.0's file; "
                f"{regenerate}"
            ],
        )
        self.assertEqual(transplant(), f"{where}: written\n")
        self.assertIn("line 15 extended more\n", payload.read_text())
        self.assertEqual(self.check(), [])

        stale = self.project.base_payload_file("9.8.0", "torch/fake/beta.py")
        stale.write_text(BETA)
        self.assertEqual(
            self.check(),
            [f"torch_overlay/bases/9.8.0/torch/fake/beta.py: no base payload in manifest.json; {regenerate}"],
        )
        self.assertIn("beta.py: removed", transplant())
        self.assertFalse(stale.exists())

    def test_unclaimed_and_doubly_claimed_blocks(self) -> None:
        toml = self.project.series_toml
        text = toml.read_text()
        toml.write_text(text.replace('match = "fixed"', 'match = "fixed|extended"'))
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
        self.assertExpectedInline(
            str(e.exception),
            """\
series.toml does not split the overlay into its patches:
  - torch/fake/alpha.py:15: 'line 15 extended': changed block claimed by several patches: fix-alpha, extend""",
        )
        toml.write_text(text.replace('match = "fixed"', 'match = "nothing"'))
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
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
        problems = self.check()
        self.assertEqual(len(problems), 1)
        self.assertIn(
            "test/fake/test_upstream.py: git hash-object 0e6e563c51a19a754d40745c800f1c8e2b329b4c is not", problems[0]
        )

    def test_stray_edit_after_the_last_hunk_is_found(self) -> None:
        self.regenerate()
        local = self.project.root / "test/fake/test_upstream.py"
        local.write_text(local.read_text() + "# stray edit\n")
        self.assertEqual(
            self.check(),
            [
                "test/fake/test_upstream.py: git hash-object cbd08debe0da090d1545b74e1a7511c771c44437 is not the new "
                "blob eaf34ed of test/upstream_edits/test/fake/test_upstream.py.diff; make them equal"
            ],
        )

    def test_patch_of_upstream_test_edits_only_keeps_its_message(self) -> None:
        """Such a patch is an empty commit until its diffs are spliced in: format-patch must still write it, or
        the patch file has no From:/Subject: and `git am` refuses it."""
        repo = self.tmp / "repo"
        repo.mkdir()
        git(repo, "init", "--quiet")
        git(repo, "commit", "--quiet", "--allow-empty", "-m", "base")
        git(repo, "commit", "--quiet", "--allow-empty", "-m", "[DDP] Tests only\n\nSummary:\nIts tests.")
        (patch,) = _format_patch(repo, self.tmp / "out", "HEAD~1..HEAD", "PATCH")
        self.assertIn("Subject: [PATCH 1/1] [DDP] Tests only", patch.read_text())

    def test_several_patches_edit_one_upstream_test(self) -> None:
        share_upstream_edit(self.project, self.tmp)
        files = self.regenerate()
        edits = self.project.root / "test/upstream_edits/test/fake/test_upstream.py"
        for name, patch in (("fix-alpha", "0001-fix-alpha.patch"), ("extend", "0002-extend.patch")):
            diff = Path(f"{edits}.{name}.diff").read_text().split("\n", 1)[1]
            self.assertIn(diff, files[patch].decode(), f"{patch} embeds its own diff")
        self.assertEqual(self.check(), [])
        tree = self.tmp / "tree"
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        for path, text in {**BASE, "test/fake/test_upstream.py": SHARED_OLD}.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)
        for name in (self.project.patches_dir / "series").read_text().split():
            subprocess.run(["git", "apply", str(self.project.patches_dir / name)], cwd=tree, check=True)
            if name == "0001-fix-alpha.patch":
                self.assertEqual((tree / "test/fake/test_upstream.py").read_text(), SHARED_MID)
        self.assertEqual((tree / "test/fake/test_upstream.py").read_text(), SHARED_NEW)

    def snapshot(self, patch: str, path: str, text: str | None) -> Path:
        """Give ``patch``'s version of ``path`` as a snapshot holding ``text`` (None: no file)."""
        toml, entry = self.project.series_toml, f'name = "{patch}"\n'
        toml.write_text(toml.read_text().replace(entry, f'{entry}snapshots = ["{path}"]\n', 1))
        if text is not None:
            write_files(self.project.patches_dir / "snapshots" / patch, {path: text})
        return self.project.patches_dir / "snapshots" / patch / path

    def name_in_summary(self, patch: str, text: str) -> None:
        """Add ``text`` to the Summary of ``patch``."""
        toml = self.project.series_toml
        head, entry = toml.read_text().split(f'name = "{patch}"\n', 1)
        toml.write_text(head + f'name = "{patch}"\n' + entry.replace('summary = """\n', f'summary = """\n{text}\n', 1))

    def test_snapshot_is_the_patch_version_of_a_file(self) -> None:
        """fix-alpha gives beta.py a first step that extend's blocks cannot give (the same line)."""
        first_step = BASE["torch/fake/beta.py"].replace("return 1", "return 2")
        snapshot = self.snapshot("fix-alpha", "torch/fake/beta.py", first_step)
        # extend changes the line fix-alpha added: refused until its message names fix-alpha and says why
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
        self.assertExpectedInline(
            str(e.exception),
            """\
a patch undoes another's change:
  - 0002-extend.patch removes 1 line that 0001-fix-alpha.patch added (torch/fake/beta.py:2: 'return 2'), and its message does not name 0001-fix-alpha.patch: move the change to the patch that owns it, or say in extend's Summary why it reworks fix-alpha (naming it by its name, its title or "patch 1")""",  # noqa: E501
        )
        self.name_in_summary("extend", "It extends the value that the previous PR, 'Fix line 3', returns.")
        files = self.regenerate()
        self.assertIn("-    return 1\n+    return 2\n", files["0001-fix-alpha.patch"].decode())
        self.assertIn("-    return 2\n+    return 2  # extended\n", files["0002-extend.patch"].decode())
        self.assertEqual(self.check(), [])
        tree = self.tmp / "tree"
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        write_files(tree, BASE)
        for name, beta in (("0001-fix-alpha.patch", first_step), ("0002-extend.patch", OVERLAY["torch/fake/beta.py"])):
            exclude = "--exclude=test/fake/test_upstream.py"
            subprocess.run(["git", "apply", exclude, str(self.project.patches_dir / name)], cwd=tree, check=True)
            self.assertEqual((tree / "torch/fake/beta.py").read_text(), beta)
        # The snapshot is the patch's version by definition: patches/ must carry it
        snapshot.write_text(first_step.replace("return 2", "return 3"))
        problems = self.check()
        self.assertIn(
            "patches/0001-fix-alpha.patch: differs from what the overlay and series.toml generate", problems[0]
        )
        self.assertIn(
            "torch 9.9.0: 0001-fix-alpha.patch does not give its snapshot "
            "patches/snapshots/fix-alpha/torch/fake/beta.py",
            problems,
        )

    def test_a_patch_leaves_the_files_it_does_not_own(self) -> None:
        """After fix-alpha's snapshot of beta.py, extend (which owns no block of it) leaves it as the snapshot;
        the third patch, which owns beta.py's block, takes it on. (Before, extend set it back to the base.)"""
        toml = self.project.series_toml
        text = toml.read_text().replace('fixed_upstream_in = "9.9.0"\n', "")  # three upstream patches
        beta = '  { file = "torch/fake/beta.py", match = "extended" },\n'
        text = text.replace(beta, "").replace('match = "backported" }', f'match = "backported" }},\n{beta}', 1)
        toml.write_text(text)
        first_step = BASE["torch/fake/beta.py"].replace("return 1", "return 2")
        self.snapshot("fix-alpha", "torch/fake/beta.py", first_step)
        self.name_in_summary("backport", "It extends the value that patch 1 returns.")
        files = self.regenerate()
        self.assertNotIn("beta.py", files["0002-extend.patch"].decode())
        self.assertIn("-    return 2\n+    return 2  # extended\n", files["0003-backport.patch"].decode())
        self.assertEqual(self.check(), [])

    def test_a_patch_that_removes_an_earlier_patch_line_is_refused(self) -> None:
        """extend's diff of the shared upstream test sets fix-alpha's line back, as a carried hunk would."""
        share_upstream_edit(self.project, self.tmp)
        path = "test/fake/test_upstream.py"
        reverted = SHARED_NEW.replace("def test_a():\n    assert 2", "def test_a():\n    assert 1")
        diff = git_diff(SHARED_MID, reverted, path, self.tmp / "revert")
        write_files(self.project.root, {
            f"test/upstream_edits/{path}.extend.diff": "Upstream-Base: pytorch/pytorch@abc123\n" + diff, path: reverted,
        })  # fmt: skip
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
        self.assertExpectedInline(
            str(e.exception),
            """\
a patch undoes another's change:
  - 0002-extend.patch removes 1 line that 0001-fix-alpha.patch added (test/fake/test_upstream.py:5: 'assert 2'), and its message does not name 0001-fix-alpha.patch: move the change to the patch that owns it, or say in extend's Summary why it reworks fix-alpha (naming it by its name, its title or "patch 1")""",  # noqa: E501
        )
        self.name_in_summary("extend", "It sets test_a back, as 'Fix line 3' made the line assert too much.")
        self.regenerate()
        self.assertEqual(self.check(), [])

    def test_snapshot_errors(self) -> None:
        toml = self.project.series_toml.read_text()
        self.snapshot("fix-alpha", "torch/fake/alpha.py", ALPHA)
        with self.assertRaisesRegex(PatchError, "gives torch/fake/alpha.py as a snapshot and also claims blocks of it"):
            generate(self.project, self.found)
        self.project.series_toml.write_text(toml)
        self.snapshot("fix-alpha", "torch/fake/beta.py", None)
        with self.assertRaisesRegex(PatchError, "patch 'fix-alpha' lists torch/fake/beta.py in snapshots, but it cann"):
            generate(self.project, self.found)

    def test_snapshot_of_a_file_that_differs_between_bases(self) -> None:
        """alpha.py differs between 9.8.0 and 9.9.0: fix-alpha's snapshot (a line that extend then changes) is
        9.9.0's file; on 9.8.0 the prefix must give it merged onto 9.8.0's own file, as the payload is."""
        toml = self.project.series_toml
        text = toml.read_text().replace('claims = [{ file = "torch/fake/alpha.py", match = "fixed" }]\n', "", 1)
        toml.write_text(
            text.replace(
                'match = "extended" },\n  { file = "torch/fake/beta',
                'match = "fixed|extended" },\n  { file = "torch/fake/beta',
                1,
            )
        )
        first_step = ALPHA.replace("line 3\n", "line 3 first\n")
        snapshot = self.snapshot("fix-alpha", "torch/fake/alpha.py", first_step)
        self.name_in_summary("extend", "It finishes the line that patch 1 started.")
        files = self.regenerate()
        self.assertIn("-line 3 first\n+line 3 fixed\n", files["0002-extend.patch"].decode())
        self.assertEqual(self.check(), [])
        tree = self.tmp / "tree"
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        write_files(tree, OLD_BASE)
        subprocess.run(["git", "apply", str(self.project.patches_dir / "0001-fix-alpha.patch")], cwd=tree, check=True)
        old_first_step = first_step.replace("line 20\n", "line 20 old\n")
        self.assertEqual((tree / "torch/fake/alpha.py").read_text(), old_first_step)
        # A snapshot that does not merge onto the older base's file is named
        snapshot.write_text(first_step.replace("line 20\n", "line 20 new\n"))
        self.assertIn(
            "torch 9.8.0: fix-alpha's snapshot: torch/fake/alpha.py: our change does not merge cleanly onto torch "
            "9.8.0's file (1 conflicting hunks)",
            "\n".join(self.check()),
        )

    def test_missing_diff_of_a_listed_upstream_edit(self) -> None:
        share_upstream_edit(self.project, self.tmp)
        (self.project.root / "test/upstream_edits/test/fake/test_upstream.py.extend.diff").unlink()
        with self.assertRaises(PatchError) as e:
            generate(self.project, self.found)
        edits = "test/upstream_edits/test/fake/test_upstream.py"
        self.assertEqual(
            str(e.exception).replace(str(self.project.root), "ROOT").split("\n"),
            [
                f"ROOT/{edits}.extend.diff: patch 'extend' lists test/fake/test_upstream.py in upstream_test_edits, "
                "but this diff cannot be read (No such file or directory).",
                f"several patches edit test/fake/test_upstream.py, so each has its own {edits}.<patch>.diff: add it, "
                "or drop the path (docs/patches.md, 'Upstream test edits')",
            ],
        )

    def test_diffs_of_one_upstream_test_follow_each_other(self) -> None:
        share_upstream_edit(self.project, self.tmp)
        path = "test/fake/test_upstream.py"
        diff = git_diff(SHARED_OLD, SHARED_NEW, path, self.tmp / "wrong")  # not from the first diff's new side
        (self.project.root / f"test/upstream_edits/{path}.extend.diff").write_text(
            "Upstream-Base: pytorch/pytorch@def456\n" + diff
        )
        self.regenerate()
        first, second = f"test/upstream_edits/{path}.fix-alpha.diff", f"test/upstream_edits/{path}.extend.diff"
        self.assertEqual(
            self.check(),
            [
                f"{second}: Upstream-Base pytorch/pytorch@def456, but {first} has pytorch/pytorch@abc123; make them "
                "equal",
                f"{second}: its old side (blob 560efe4) is not the new side (blob c4c6a31) of {first}; make it with "
                "`git diff` from the file as the earlier diff leaves it (docs/patches.md, 'Upstream test edits')",
            ],
        )

    def test_stale_patches_report_missing_test_file(self) -> None:
        self.regenerate()
        (self.project.root / "test/fake/test_four.py").write_text("def test_four():\n    pass\n")
        toml = self.project.series_toml
        toml.write_text(
            toml.read_text().replace(
                'tests = ["test/fake/test_two.py"]', 'tests = ["test/fake/test_two.py", "test/fake/test_four.py"]'
            )
        )
        problems = self.check()
        self.assertIn(
            "patches/0002-extend.patch: differs from what the overlay and series.toml generate; run `make patches`",
            problems,
        )
        self.assertIn(
            "torch 9.9.0: test/fake/test_four.py: not created by the applied series (patches/ is stale)", problems
        )


class TestGitIsolation(unittest.TestCase):
    """The tools' git never acts on the caller's repository, nor reads the user's git config."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, self.sources = make_project(self.tmp)

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
            write(self.project, generate(self.project, pristine(self.project, self.sources)))
            self.assertEqual(check(self.project, self.sources), [])
        self.assertEqual(snapshot(), before)

    def test_user_git_config_is_ignored(self) -> None:
        (self.tmp / "home").mkdir()
        (self.tmp / "home" / ".gitconfig").write_text("[apply]\n\twhitespace = fix\n")
        overlay = self.project.overlay_file("torch/fake/beta.py")
        overlay.write_text(overlay.read_text().replace("# extended", "# extended   "))
        with mock.patch.dict(os.environ, {"HOME": str(self.tmp / "home"), "XDG_CONFIG_HOME": str(self.tmp / "home")}):
            write(self.project, generate(self.project, pristine(self.project, self.sources)))
            self.assertEqual(check(self.project, self.sources), [])


class TestRealRepo(unittest.TestCase):
    def test_real_repo_patches_in_sync(self) -> None:
        """`make check`'s sync check on this repo, every base (`make sources` makes their files available)."""
        self.assertEqual(check(default_project()), [])


if __name__ == "__main__":
    unittest.main()
