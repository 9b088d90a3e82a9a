"""``make check-stack``: the stack rules on fixture patches, the changed-line counts, every prefix of a synthetic
series applied and served from a scratch copy, the stack table; one real prefix served in a fresh interpreter."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path
from unittest import mock

import expecttest
from _patch_project import (
    BASE,
    GAMMA,
    SHARED_MID,
    SHARED_NEW,
    add_new_module,
    make_project,
    share_upstream_edit,
)

from tools.check_stack import (
    Prefix,
    PrefixResult,
    check_prefix,
    check_stack,
    failure_lines,
    own_test_files,
    own_test_ids,
    prefix_red_list,
    prefix_tests,
    prefixes,
    rule_violations,
    scratch_project,
    series_lint,
    serve,
    stack,
    stack_table,
    upstream_tests,
)
from tools.own_tests import REPORT_ENV, SELECT_ENV, changed_lines, changed_tests, matches
from tools.patches import commit_message, generate, write
from tools.pristine import pristine
from tools.project import default_project
from tools.series import Patch
from tools.stack_lint import LintFile, lint
from tools.stack_rules import Reversion, diff_stats, file_hunks, reversions, violations
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


OLD_TESTS = """\
import torch


def helper():
    return 1


def unused_helper():
    return 0


def test_plain():
    assert helper() == 1


def test_other():
    assert torch.full((1,), 2).sum() == 2


class TestThings(Base):
    world_size = 2

    def setUp(self):
        super().setUp()

    def _model(self):
        return 3

    def test_model(self):
        self.assertEqual(self._model(), 3)

    def test_alone(self):
        self.assertTrue(True)


if __name__ == "__main__":
    run_tests()
"""


def _changed(new: str, old: str = OLD_TESTS) -> list[str]:
    """The node ids :func:`changed_tests` selects in ``new`` for the diff from ``old``."""
    hunks = file_hunks(_udiff("test/t.py", old.splitlines(), new.splitlines()))["test/t.py"]
    return changed_tests("test/t.py", new, *changed_lines(hunks))


class TestOwnTests(unittest.TestCase):
    def test_the_tests_a_diff_adds_or_changes(self) -> None:
        """A test's own lines select it; a class's header or set-up, the class; a helper, the tests that name it
        (bare names and ``self.x``, not other attributes: ``torch.full`` is not the helper ``full``)."""
        cases = {
            "assert helper() == 1": ("assert helper() == 1  # changed", ["test/t.py::test_plain"]),
            "return 1": ("return 2", ["test/t.py::test_plain"]),
            "return 3": ("return 4", ["test/t.py::TestThings::test_model"]),
            "world_size = 2": ("world_size = 4", ["test/t.py::TestThings"]),
            "super().setUp()": ("super().setUp()\n        self.x = 1", ["test/t.py::TestThings"]),
            "class TestThings(Base):": ("class TestThings(Other):", ["test/t.py::TestThings"]),
            "import torch": ("import torch\nimport os", []),
            "return 0": ("return -1", []),  # a helper no test uses
            "        self.assertTrue(True)\n": ("        self.assertTrue(True)\n\n    def test_new(self):\n"
                                               "        pass\n", ["test/t.py::TestThings::test_new"]),
        }  # fmt: skip
        for old, (new, expected) in cases.items():
            self.assertEqual(_changed(OLD_TESTS.replace(old, new, 1)), expected, new)
        full = OLD_TESTS.replace("def unused_helper", "def full").replace("return 0", "return -1")
        self.assertEqual(_changed(full, OLD_TESTS.replace("def unused_helper", "def full")), [])
        # A removal inside a test selects it; a test removed whole selects nothing left.
        self.assertEqual(
            _changed(OLD_TESTS.replace("        super().setUp()\n", "        pass\n")), ["test/t.py::TestThings"]
        )
        removed = OLD_TESTS.replace("    def test_alone(self):\n        self.assertTrue(True)\n\n", "")
        self.assertEqual(_changed(removed), [])

    def test_matches_by_qualname_class_and_file(self) -> None:
        class Base:
            def test_a(self) -> None: ...

        class Sub(Base):
            pass

        def item(nodeid: str, cls: type | None, obj: object) -> object:
            return mock.Mock(nodeid=nodeid, cls=cls, obj=obj)

        inherited = item("test/t.py::Sub::test_a", Sub, Base.test_a)
        param = item("test/t.py::test_f[1]", None, mock.Mock(__qualname__="test_f"))
        local_qualname = Base.test_a.__qualname__  # "<locals>" in it: match the one a real file's test has
        self.assertTrue(matches(inherited, "test/t.py::Base"))
        self.assertTrue(matches(inherited, "test/t.py::Sub"))
        self.assertTrue(matches(inherited, "test/t.py::" + local_qualname.replace(".", "::")))
        self.assertTrue(matches(param, "test/t.py::test_f"))
        self.assertTrue(matches(param, "test/t.py"))
        self.assertFalse(matches(param, "test/u.py"))
        self.assertFalse(matches(param, "test/t.py::test_g"))
        self.assertFalse(matches(inherited, "test/t.py::Other"))

    def test_the_plugin_runs_the_selected_tests_only(self) -> None:
        """pytest with the plugin, on a file of parametrized and inherited tests: the selected ones run, the
        ids that match nothing are reported."""
        source = textwrap.dedent(
            """\
            import pytest

            @pytest.mark.parametrize("x", [1, 2])
            def test_param(x):
                pass

            def test_other():
                pass

            class TestBase:
                def test_inherited(self):
                    pass

            class TestSub(TestBase):
                def test_own(self):
                    pass
            """
        )
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "test_file.py").write_text(source)
            Path(tmp, "pytest.ini").write_text("[pytest]\n")
            ids = ["test_file.py::test_param", "test_file.py::TestBase::test_inherited", "test_file.py::test_gone"]
            Path(tmp, "select.json").write_text(json.dumps(ids))
            env = dict(os.environ, PYTHONPATH=str(default_project().root), **{SELECT_ENV: f"{tmp}/select.json"})
            env[REPORT_ENV] = tmp
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tools._own_tests_plugin",
                 "-rA", "test_file.py"],
                cwd=tmp, env=env, capture_output=True, text=True,
            )  # fmt: skip
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            (report,) = [json.loads(f.read_text()) for f in Path(tmp).glob("[0-9]*.json")]
        self.assertEqual(
            report["kept"],
            [
                "test_file.py::test_param[1]",
                "test_file.py::test_param[2]",
                "test_file.py::TestBase::test_inherited",
                "test_file.py::TestSub::test_inherited",
            ],
        )
        self.assertEqual(report["unmatched"], ["test_file.py::test_gone"])


class TestLint(unittest.TestCase):
    def test_only_the_added_lines_count(self) -> None:
        """flake8 at the file's columns: a pre-existing finding does not count, one on an added line does; the
        blank-line checks count where the patch added the blank run before the line; F401 of a multi-line
        import counts where the patch added the name's line; an undefined name at the prefix counts."""
        torch_file = textwrap.dedent(
            """\
            import os
            import sys
            from collections import (
                OrderedDict,
                defaultdict,
            )


            def f():
                return Later + 1
            x = 1  # {}
            """
        ).format("y" * 115)
        test_file = textwrap.dedent(
            """\
            def test_a():
                assert "{}"

            if __name__ == "__main__":
                test_a()
            """
        ).format("z" * 80)
        files = [
            # The patch adds `import sys`, `defaultdict,`, and the last two lines.
            LintFile("0001-a.patch", "torch/a.py", torch_file.encode(), frozenset({2, 5, 10, 11})),
            # The patch adds the test (and the one blank line after it); same file, kept upstream's formatting.
            LintFile("0002-b.patch", "test/t.py", test_file.encode(), frozenset({1, 2, 3})),
            LintFile("0002-b.patch", "test/u.py", test_file.encode(), frozenset({1, 2, 3})),
        ]
        found = [f"{f.patch} {f.path}:{f.line} {f.code}" for f in lint(files, {"test/u.py"})]
        self.assertEqual(
            found,
            [
                "0001-a.patch torch/a.py:2 F401",
                "0001-a.patch torch/a.py:3 F401",  # defaultdict, on the added line 5
                "0001-a.patch torch/a.py:10 F821",
                "0001-a.patch torch/a.py:11 E305",
                "0001-a.patch torch/a.py:11 E501",
                "0002-b.patch test/t.py:2 E501",  # 88 columns
                "0002-b.patch test/t.py:4 E305",
                "0002-b.patch test/u.py:4 E305",  # 120 columns: no E501
            ],
        )
        # `import os` (line 1) and `OrderedDict` (line 4) are unused too, but not on added lines.
        self.assertNotIn("0001-a.patch torch/a.py:1 F401", found)


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

    def test_own_tests_of_each_prefix(self) -> None:
        """--own-tests: a prefix runs its last patch's tests only: the files it adds whole, and in an upstream
        test file it edits, the tests its diff changes, at the prefix's version of the file."""
        base = self.project.manifest().base("9.8.0")

        def own(found: list[Prefix]) -> list[list[str]]:
            return [own_test_ids(p.entry, {**p.files, **upstream_tests(self.project, p)}) for p in found]

        found = list(prefixes(self.project, base, self.found.files(base)))
        upstream = "test/fake/test_upstream.py"
        self.assertEqual(sorted(own_test_files(found[1].entry)), ["test/fake/test_two.py", upstream])
        self.assertEqual(own_test_ids(found[1].entry, {}), [])  # files the prefix lacks are left out
        self.assertEqual(
            own(found),
            [["test/fake/test_one.py"], ["test/fake/test_two.py", f"{upstream}::test_a"], ["test/fake/test_three.py"]],
        )
        share_upstream_edit(self.project, self.tmp)  # both patches edit it: test_a, then test_z
        write(self.project, generate(self.project, self.found))
        found = list(prefixes(self.project, base, self.found.files(base)))
        self.assertEqual(
            own(found)[:2],
            [["test/fake/test_one.py", f"{upstream}::test_a"], ["test/fake/test_two.py", f"{upstream}::test_z"]],
        )

    def test_own_tests_mode_reaches_every_prefix(self) -> None:
        base = self.project.manifest().base("9.8.0")
        with mock.patch("tools.check_stack.check_prefix", return_value=mock.Mock()) as check:
            check_stack(self.project, base, self.found.files(base), False, lambda _: None, own_tests=True)
        self.assertEqual([(c.args[4], c.kwargs["own"]) for c in check.call_args_list], [(False, True)] * 3)

    def test_the_lint_reads_each_patch_at_its_prefix(self) -> None:
        """Each patch of the upstream series is linted on the newest base's files with patches 1..k applied (an
        upstream test file as the prefix leaves it), on the lines its diff adds."""
        share_upstream_edit(self.project, self.tmp)
        write(self.project, generate(self.project, self.found))
        with mock.patch("tools.check_stack.lint", return_value=[]) as lint_:
            self.assertEqual(series_lint(self.project, self.found.files(self.project.manifest().bases[-1])), [])
        files = {(f.patch[:4], f.path): f for f in lint_.call_args.args[0]}
        upstream = "test/fake/test_upstream.py"
        self.assertEqual(sorted(files), [
            ("0001", "test/fake/test_one.py"), ("0001", upstream), ("0001", "torch/fake/alpha.py"),
            ("0002", "test/fake/test_two.py"), ("0002", upstream), ("0002", "torch/fake/alpha.py"),
            ("0002", "torch/fake/beta.py"),
        ])  # fmt: skip
        alpha = files["0001", "torch/fake/alpha.py"]
        self.assertEqual((b"line 3 fixed" in alpha.content, b"15 extended" in alpha.content), (True, False))
        self.assertEqual(alpha.added, {3})
        self.assertEqual(files["0001", upstream].content, SHARED_MID.encode())
        self.assertEqual(files["0002", upstream].content, SHARED_NEW.encode())
        self.assertEqual(files["0002", upstream].added, {SHARED_NEW.splitlines().index("    assert 3") + 1})
        self.assertEqual(files["0001", "test/fake/test_one.py"].added, {1, 2})

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
