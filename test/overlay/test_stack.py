"""``make check-stack``: the stack rules on fixture patches, the changed-line counts, every prefix of a synthetic
series applied and served from a scratch copy, the stack table; one real prefix served in a fresh interpreter."""

from __future__ import annotations

import dataclasses
import difflib
import tempfile
import textwrap
import unittest
from pathlib import Path
from unittest import mock

import expecttest
from _patch_project import BASE, GAMMA, SHARED_MID, SHARED_NEW, add_new_module, make_project, share_upstream_edit

from tools.check_stack import (
    Prefix,
    PrefixResult,
    check_prefix,
    check_stack,
    failure_lines,
    prefix_red_list,
    prefix_tests,
    prefixes,
    rule_violations,
    scratch_project,
    serve,
    stack,
    stack_table,
    upstream_tests,
)
from tools.patches import commit_message, generate, write
from tools.pristine import pristine
from tools.project import default_project
from tools.series import Patch
from tools.stack_rules import Reversion, diff_stats, reversions, violations
from torch_overlay._guard import check_base

GOOD = Patch(
    name="good",
    title="[FSDP] Fix the offload warning",
    summary="The warning read 'theunsharded'. Add the space.",
    test_plan="python test/distributed/fsdp/test_fsdp_unshard_offload_warning.py",
    fixes=(93938,),
    claims=(),
    tests=(),
    upstream_test_edits=(),
)
GOOD_MESSAGE = "[FSDP] Fix the offload warning\n\nSummary:\n...\n\nTest Plan:\npython test/x.py\n\nFixes #93938\n"


def _diff(path: str, added: int, removed: int = 0, text: str = "x = 1") -> str:
    body = "".join(f"-{text}\n" for _ in range(removed)) + "".join(f"+{text}\n" for _ in range(added))
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,{removed} +1,{added} @@\n{body}"


def _udiff(path: str, old: list[str], new: list[str]) -> str:
    """A git-style diff of ``path`` from lines ``old`` to lines ``new`` (3 lines of context)."""
    lines = difflib.unified_diff([f"{s}\n" for s in old], [f"{s}\n" for s in new], f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


class TestReversions(unittest.TestCase):
    def test_each_added_line_is_followed_through_the_later_diffs(self) -> None:
        v0 = [f"line {n}" for n in range(1, 21)]
        v1 = v0[:10] + ["one A", "one B"] + v0[10:14] + ["one C"] + v0[15:]
        v2 = ["two X", "two Y", "two Z"] + [line for line in v1 if line != "one B"]
        v2[v2.index("one C")] = "    one C"  # moved (re-indented): not a removal
        v3 = [line for line in v2 if line not in ("one A", "two X")]
        diffs = [_udiff("torch/a.py", a, b) for a, b in ((v0, v1), (v1, v2), (v2, v3))]
        self.assertEqual(
            reversions(diffs),
            [
                Reversion(1, 0, "torch/a.py", 12, "one B"),
                Reversion(2, 1, "torch/a.py", 1, "two X"),
                Reversion(2, 0, "torch/a.py", 14, "one A"),
            ],
        )
        self.assertEqual(reversions(diffs, skip={"torch/a.py"}), [])

    def test_a_new_file_and_base_lines(self) -> None:
        """Removing a base line is no reversion; removing a line of a file an earlier patch added whole is."""
        one = _udiff("torch/a.py", ["base"], ["base", "one"])
        new_file = "diff --git a/test/t.py b/test/t.py\nnew file mode 100644\n--- /dev/null\n+++ b/test/t.py\n"
        one += new_file + "@@ -0,0 +1,2 @@\n+def test():\n+    pass\n"
        two = _udiff("torch/a.py", ["base", "one"], ["one"]) + _udiff("test/t.py", ["def test():", "    pass"], [])
        self.assertEqual(
            reversions([one, two]),
            [Reversion(1, 0, "test/t.py", 1, "def test():"), Reversion(1, 0, "test/t.py", 2, "    pass")],
        )


class TestStackRules(expecttest.TestCase):
    def test_a_reviewable_patch_breaks_no_rule(self) -> None:
        stats = diff_stats(_diff("torch/a.py", 300, 100) + _diff("test/test_a.py", 300))
        self.assertEqual((stats.code, stats.total), (400, 700))
        self.assertEqual(violations(GOOD, GOOD_MESSAGE, stats), [])

    def test_every_rule_named(self) -> None:
        bad = Patch(
            name="bad",
            title="[2D] Make the overlay work",
            summary="\n".join(f"line {n}" for n in range(16)),
            test_plan="Run the tests.",
            fixes=(152712,),
            claims=(),
            tests=(),
            upstream_test_edits=(),
        )
        message = "[2D] Make it work\n\nSummary:\nSee series.toml; `make check` on every base.\nFixes #93938\n"
        stats = diff_stats(_diff("torch/a.py", 401) + _diff("test/test_a.py", 300, text="# torch-overlay only"))
        self.assertExpectedInline(
            "\n".join(violations(bad, message, stats)),
            """\
title must start with one of [DTensor] [FSDP] [DDP] [dynamo] [optim]: '[2D] Make the overlay work'
Summary has 16 lines, at most 15
Test Plan has no command (a line such as `python test/distributed/...py`)
the message says Fixes #93938, but series.toml's fixes are #152712
401 changed lines of code (outside test/), at most 400
701 changed lines with tests, at most 700
the message names this project's tooling: 'every base', 'make check', 'series.toml'
test/test_a.py (added lines) names this project's tooling: 'torch-overlay'""",
        )

    def test_a_closed_issue_is_related_not_fixed(self) -> None:
        """A closed issue is named ``Related: #N`` with a line of what the patch adds, and checked like Fixes."""
        patch = dataclasses.replace(GOOD, fixes=(), related=((93938, "Adds the missing space."),))
        message = commit_message(patch)
        self.assertTrue(message.endswith("\n\nRelated: #93938\nAdds the missing space.\n"), message)
        stats = diff_stats(_diff("torch/a.py", 1))
        self.assertEqual(violations(patch, message, stats), [])
        self.assertExpectedInline(
            "\n".join(violations(dataclasses.replace(patch, fixes=(93938,)), GOOD_MESSAGE, stats)),
            """\
the message says Related none, but series.toml's related are #93938
#93938: both fixed and related; pick one""",
        )

    def test_every_area_tag_is_accepted(self) -> None:
        stats = diff_stats(_diff("torch/a.py", 1))
        for tag in ("[DTensor]", "[FSDP]", "[DDP]", "[dynamo]", "[optim]"):
            patch = dataclasses.replace(GOOD, title=f"{tag} Fix it")
            self.assertEqual(violations(patch, GOOD_MESSAGE, stats), [], tag)

    def test_ordinary_words_are_not_tooling(self) -> None:
        message = GOOD_MESSAGE + "A frozen base weight; the base class; make the change; the manifold.\n"
        self.assertEqual(violations(GOOD, message, diff_stats(_diff("torch/a.py", 1))), [])

    def test_diff_stats_reads_hunks_by_their_counts(self) -> None:
        diff = textwrap.dedent(
            """\
            diff --git a/torch/a.py b/torch/a.py
            --- a/torch/a.py
            +++ b/torch/a.py
            @@ -1,3 +1,2 @@
             keep
            --- a removed line that looks like a header
            -x
            +++ an added line that looks like a header
            \\ No newline at end of file
            diff --git a/test/t.py b/test/t.py
            new file mode 100644
            --- /dev/null
            +++ b/test/t.py
            @@ -0,0 +1 @@
            +def test(): pass
            """
        )
        stats = diff_stats(diff)
        self.assertEqual(
            [(f.path, f.added, f.removed) for f in stats.files], [("torch/a.py", 1, 2), ("test/t.py", 1, 0)]
        )
        self.assertEqual((stats.code, stats.total, stats.test_files), (3, 4, ("test/t.py",)))


class TestFailureLines(expecttest.TestCase):
    def test_failed_tests_and_the_deepest_distinct_errors(self) -> None:
        output = textwrap.dedent(
            """\
            E       RuntimeError: Exception in worker process:
            E         File "x.py", line 3, in f
            E       NotImplementedError: writeback=True and rank0_only=True is not supported yet
            E       NotImplementedError: writeback=True and rank0_only=True is not supported yet
            ===== short test summary info =====
            FAILED test/a.py::T::test_one - RuntimeError: Exception in worker process:
            FAILED test/a.py::T::test_two - RuntimeError: Exception in worker process:
            """
        )
        self.assertExpectedInline(
            "\n".join(failure_lines(output)),
            """\
FAILED test/a.py::T::test_one
FAILED test/a.py::T::test_two
NotImplementedError: writeback=True and rank0_only=True is not supported yet""",
        )


class TestStackOnSyntheticProject(expecttest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.project, sources = make_project(self.tmp)
        self.found = pristine(self.project, sources)
        write(self.project, generate(self.project, self.found))

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_every_prefix_of_a_base_series(self) -> None:
        base = self.project.manifest().base("9.8.0")
        found = list(prefixes(self.project, base, self.found.files(base)))
        # The base's backport goes after every prefix of the upstream series, where it applies: after patch 1 its
        # context (patch 2's line 15) is not there yet.
        self.assertEqual(
            [(p.entry.file.name, [b.file.name for b in p.backports], [b.file.name for b in p.without]) for p in found],
            [
                ("0001-fix-alpha.patch", [], ["0003-backport.patch"]),
                ("0002-extend.patch", ["0003-backport.patch"], []),
                ("0003-backport.patch", [], []),
            ],
        )
        alpha = [p.files["torch/fake/alpha.py"].decode() for p in found]
        self.assertEqual([("3 fixed" in a, "15 extended" in a, "12 backported" in a) for a in alpha], [
            (True, False, False), (True, True, True), (True, True, True),
        ])  # fmt: skip
        self.assertIn("test/fake/test_two.py", found[1].files)
        self.assertNotIn("test/fake/test_upstream.py", found[1].files)  # not in the wheel: excluded
        newest = self.project.manifest().base("9.9.0")
        found = list(prefixes(self.project, newest, self.found.files(newest)))
        self.assertEqual([(p.entry.file.name, p.backports, p.error) for p in found], [
            ("0001-fix-alpha.patch", (), None), ("0002-extend.patch", (), None),
        ])  # fmt: skip

    def test_a_new_module_is_in_the_prefixes_from_the_patch_that_adds_it(self) -> None:
        add_new_module(self.project)
        write(self.project, generate(self.project, self.found))
        base = self.project.manifest().base("9.9.0")
        one, two = prefixes(self.project, base, self.found.files(base))
        self.assertNotIn("torch/fake/gamma.py", one.files)
        self.assertEqual(two.files["torch/fake/gamma.py"].decode(), GAMMA)
        self.assertEqual(stack(self.project)[1].stats.code, 4 + len(GAMMA.splitlines()))

    def test_rules_and_table_of_the_upstream_stack(self) -> None:
        self.assertEqual([e.file.name for e in stack(self.project)], ["0001-fix-alpha.patch", "0002-extend.patch"])
        self.assertExpectedInline(
            "\n".join(rule_violations(self.project)),
            "0002-extend.patch: title must start with one of [DTensor] [FSDP] [DDP] [dynamo] [optim]: "
            "'[2D] Extend alpha and beta'",
        )
        self.assertExpectedInline(
            stack_table(self.project),
            """\
| # | title | changed lines (code / with tests) | Fixes | tests |
|---|---|---|---|---|
| 1 | [FSDP] Fix line 3 | 2 / 4 | [#12345](https://github.com/pytorch/pytorch/issues/12345) | `test/fake/test_one.py` |
| 2 | [2D] Extend alpha and beta | 4 / 8 | - | `test/fake/test_two.py`, `test/fake/test_upstream.py` |""",
        )

    def test_a_patch_that_removes_an_earlier_patch_line_breaks_the_rules(self) -> None:
        """A patch file that sets an earlier patch's line back (made by hand, or by an older generator)."""
        patch = self.project.patches_dir / "0002-extend.patch"
        header, hunk = "+++ b/torch/fake/alpha.py\n", "@@ -2,3 +2,3 @@\n line 2\n-line 3 fixed\n+line 3\n line 4\n"
        patch.write_text(patch.read_text().replace(header, header + hunk, 1))
        self.assertExpectedInline(
            "\n".join(rule_violations(self.project)[1:]),
            """0002-extend.patch removes 1 line that 0001-fix-alpha.patch added (torch/fake/alpha.py:3: 'line 3 fixed'), and its message does not name 0001-fix-alpha.patch: move the change to the patch that owns it, or say in extend's Summary why it reworks fix-alpha (naming it by its name, its title or "patch 1")""",  # noqa: E501
        )

    def test_every_prefix_runs_the_tests_of_every_patch_it_applies(self) -> None:
        base = self.project.manifest().base("9.8.0")
        found = list(prefixes(self.project, base, self.found.files(base)))
        one, two, three = ("test/fake/test_one.py", "test/fake/test_two.py", "test/fake/test_three.py")
        self.assertEqual([prefix_tests(p) for p in found], [[one], [one, two, three], [one, two, three]])
        # An upstream test file the project holds rewritten runs from the first patch that edits it on.
        upstream = "test/fake/test_upstream.py"
        self.assertEqual([upstream in prefix_tests(p, self.project.root) for p in found], [False, True, True])

    def test_a_prefix_runs_an_upstream_test_file_as_it_leaves_it(self) -> None:
        """Both patches edit test_upstream.py: patch 1's prefix runs the file as patch 1's diff leaves it (the
        rewritten file with patch 2's diff reversed), not the whole series' version, nor none."""
        share_upstream_edit(self.project, self.tmp)
        write(self.project, generate(self.project, self.found))
        base = self.project.manifest().base("9.8.0")
        found = list(prefixes(self.project, base, self.found.files(base)))
        upstream = "test/fake/test_upstream.py"
        self.assertEqual([upstream in prefix_tests(p, self.project.root) for p in found], [True, True, True])
        versions = [upstream_tests(self.project, p) for p in found]
        self.assertEqual(versions, [{upstream: SHARED_MID.encode()}] + [{upstream: SHARED_NEW.encode()}] * 2)

    def test_a_prefix_red_list_leaves_out_the_tests_a_later_patch_adds(self) -> None:
        red = "# comment\ntest/a.py::T::test_one one\ntest/a.py::T::test_two two\ntest/b.py::test_three three\n"
        red += "test/a.py::Later::test_one one\n"  # a later patch's class, with a test of the same name
        rewritten = {"test/a.py": b"class T:\n    def test_one(self):\n        pass\n"}
        self.assertEqual(
            prefix_red_list(red, rewritten), "# comment\ntest/a.py::T::test_one one\ntest/b.py::test_three three\n"
        )

    def test_test_last_runs_the_tests_at_the_last_prefix_only(self) -> None:
        base = self.project.manifest().base("9.8.0")

        def check(*args: object, **kwargs: object) -> PrefixResult:  # (project, scratch, prefix, files, import_only)
            prefix, import_only = args[2], args[4]
            assert isinstance(prefix, Prefix)
            return PrefixResult(prefix, None, tests=None if import_only else "ran")

        with mock.patch("tools.check_stack.check_prefix", side_effect=check):
            for test_last, expected in ((False, ["ran", "ran", "ran"]), (True, [None, None, "ran"])):
                results = check_stack(self.project, base, self.found.files(base), False, lambda _: None, test_last)
                self.assertEqual([r.tests for r in results], expected)

    def test_one_line_per_prefix(self) -> None:
        one, two, backport = stack(self.project, "9.8.0")
        results = [
            PrefixResult(Prefix(one, (), {}, without=(backport,)), None, None, ("torch.fake.beta",), "1 passed, 2 s"),
            PrefixResult(
                Prefix(two, (backport,), {}),
                None,
                None,
                ("torch.fake.beta",),
                "1 failed, 3 s\nFAILED test/fake/test_two.py::test_two\nAssertionError: 1 != 2",
                tests_ok=False,
            ),
            PrefixResult(Prefix(backport, (), None), "0003-backport.patch: error: patch failed: torch/fake/alpha.py:9"),
            PrefixResult(Prefix(backport, (), {}), None, "ImportError: boom"),
        ]
        self.assertExpectedInline(
            "\n".join(r.line() for r in results),
            """\
0001-fix-alpha.patch: applied, imported 1 touched, tests passed (1 passed, 2 s)
    (checked without 0003-backport.patch: it does not apply this early)
0002-extend.patch + 0003-backport.patch: applied, imported 1 touched, tests FAILED (1 failed, 3 s)
    FAILED test/fake/test_two.py::test_two
    AssertionError: 1 != 2
0003-backport.patch: NOT applied: 0003-backport.patch: error: patch failed: torch/fake/alpha.py:9
0003-backport.patch: applied, NOT imported
    ImportError: boom""",
        )
        self.assertEqual([r.ok for r in results], [True, False, False, False])

    def test_scratch_copy_serves_the_prefix(self) -> None:
        scratch = scratch_project(self.project, self.tmp / "scratch")
        self.assertFalse((scratch / "torch_overlay" / "torch").exists())
        serve(scratch, {"torch/fake/beta.py": BASE["torch/fake/beta.py"].encode()}, self.project.manifest().bases[-1])
        self.assertEqual((scratch / "torch_overlay/torch/fake/beta.py").read_text(), BASE["torch/fake/beta.py"])
        self.assertTrue((scratch / "patches/series.toml").is_file())
        self.assertTrue((scratch / "test/fake/test_one.py").is_file())


class TestRealPrefix(unittest.TestCase):
    def test_a_prefix_is_imported_from_its_own_files(self) -> None:
        # The prefix's clip_grad.py raises when imported: the fresh interpreter must have imported that one.
        project = default_project()
        base = check_base().matched  # the scratch interpreter serves the installed base's files
        files = pristine(project).files(base)
        tree = dict(files)
        tree["torch/nn/utils/clip_grad.py"] += b"\nraise RuntimeError('served from the prefix')\n"
        entry = stack(project)[0]
        with tempfile.TemporaryDirectory() as tmp:
            scratch = scratch_project(project, Path(tmp) / "project")
            result = check_prefix(project, scratch, Prefix(entry, (), tree), files, import_only=True, base=base)
        self.assertEqual(result.modules, ("torch.nn.utils.clip_grad",))
        self.assertIn("RuntimeError: served from the prefix", result.imported or "")
        self.assertFalse(result.ok)


if __name__ == "__main__":
    unittest.main()
