"""The --stock harness itself: a listed test counts only when it fails on stock with its listed error."""

import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from scratch_env import REPO_ROOT, clean_env, run

SYNTHETIC_TESTS = textwrap.dedent(
    """
    import unittest

    class T(unittest.TestCase):
        def test_red_as_listed(self):
            raise AssertionError("the stock defect")

        def test_red_for_another_reason(self):
            raise AssertionError("something else")

        def test_passes_on_stock(self):
            pass

        def test_skipped_on_stock(self):
            raise unittest.SkipTest("hidden")

        @unittest.skip("hidden at setup")
        def test_skipped_at_setup(self):
            pass

        def test_pattern_only_in_source(self):
            assert 1 == 2  # the stock defect

        def test_not_listed(self):
            raise AssertionError("never runs with --stock")
    """
)


FIXED_UPSTREAM_TESTS = textwrap.dedent(
    """
    import unittest

    class T(unittest.TestCase):
        def test_passes_where_upstream_fixed_it(self):
            pass

        def test_still_fails_where_upstream_fixed_it(self):
            raise AssertionError("the stock defect")
    """
)

# A backport whose bug every release from 0.0.1 on has fixed: on the installed base, its test must pass on stock.
SERIES = textwrap.dedent(
    """
    [[patch]]
    name = "backport"
    title = "t"
    summary = "s"
    test_plan = "p"
    fixed_upstream_in = "0.0.1"
    tests = ["test/test_fixed_upstream.py"]
    """
)

NODE = "test/test_synthetic.py::T::"
HARNESS = REPO_ROOT / "test" / "overlay" / "boot" / "_torch_harness.py"
FIXED = "test/test_fixed_upstream.py::T::"


def run_stock(red_list: str, *pytest_args: str) -> subprocess.CompletedProcess:
    """``pytest --stock`` over the synthetic tests in a scratch project with this conftest and ``red_list``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "test" / "overlay").mkdir(parents=True)
        shutil.copy(REPO_ROOT / "test" / "conftest.py", root / "test" / "conftest.py")
        (root / "test" / "overlay" / "boot").mkdir()  # the conftest's harness glue, without the start-up hook
        shutil.copy(HARNESS, root / "test" / "overlay" / "boot" / HARNESS.name)
        (root / "test" / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
        (root / "test" / "test_fixed_upstream.py").write_text(FIXED_UPSTREAM_TESTS)
        (root / "test" / "overlay" / "red_on_stock.txt").write_text(red_list)
        (root / "patches").mkdir()
        (root / "patches" / "series.toml").write_text(SERIES)
        (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = '-p no:cacheprovider'\n")
        env = clean_env(PYTHONPATH=str(REPO_ROOT))  # tools/, for the conftest
        return run([sys.executable, "-m", "pytest", "--stock", *pytest_args, "test"], env=env, cwd=root)


class RedGreenHarnessTest(unittest.TestCase):
    def test_stock_run_judges_each_listed_test(self):
        listed = [
            "test_red_as_listed",
            "test_red_for_another_reason",
            "test_passes_on_stock",
            "test_skipped_on_stock",
            "test_skipped_at_setup",
            "test_pattern_only_in_source",
        ]
        fixed = ["test_passes_where_upstream_fixed_it", "test_still_fails_where_upstream_fixed_it"]
        red_list = "# comment\n" + "".join(f"{NODE}{name} the stock defect\n" for name in listed)
        red_list += "".join(f"{FIXED}{name} the stock defect\n" for name in fixed)
        result = run_stock(red_list, "-rA")
        self.assertEqual(result.returncode, 1, result.stdout)
        outcomes = {
            name: outcome
            for outcome, name in re.findall(
                r"^(XFAIL|FAILED|PASSED|SKIPPED) test/test_\w+.py::T::(\w+)", result.stdout, re.M
            )
        }
        self.assertEqual(
            outcomes,
            {
                "test_red_as_listed": "XFAIL",
                "test_red_for_another_reason": "FAILED",
                "test_passes_on_stock": "FAILED",
                "test_skipped_on_stock": "FAILED",
                "test_skipped_at_setup": "FAILED",
                "test_pattern_only_in_source": "FAILED",
                "test_passes_where_upstream_fixed_it": "PASSED",
                "test_still_fails_where_upstream_fixed_it": "FAILED",
            },
            result.stdout,
        )
        self.assertIn(
            f"red-on-stock: {NODE}test_passes_on_stock was expected to fail on stock torch with /the stock defect/ "
            "but passed: it does not prove its fix",
            result.stdout,
        )
        self.assertIn(
            "red-on-stock: backport is fixed upstream in torch 0.0.1, so this test must pass on stock torch here",
            result.stdout,
        )
        self.assertIn("but not with /the stock defect/", result.stdout)
        self.assertRegex(result.stdout, r"1 deselected")

    def test_a_pattern_for_older_releases_applies_before_its_release_only(self):
        """``<node id>@torch<X.Y <pattern>``: stock's message on the releases before X.Y (every base is before
        99.0, none before 0.0.1), in place of the test's own pattern."""
        red_list = f"{NODE}test_red_for_another_reason the stock defect\n"
        red_list += f"{NODE}test_red_for_another_reason@torch<99.0 something else\n"
        red_list += f"{NODE}test_red_as_listed the stock defect\n"
        red_list += f"{NODE}test_red_as_listed@torch<0.0.1 something else\n"
        result = run_stock(red_list, "-rA")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertRegex(result.stdout, rf"XFAIL {NODE}test_red_for_another_reason - .*/something else/")
        self.assertRegex(result.stdout, rf"XFAIL {NODE}test_red_as_listed - .*/the stock defect/")

    def test_a_pattern_for_older_releases_needs_the_test_listed(self):
        result = run_stock(f"{NODE}test_red_as_listed@torch<99.0 the stock defect\n")
        self.assertEqual(result.returncode, 4, result.stdout + result.stderr)
        self.assertIn("has a pattern for older releases only; list its own first", result.stderr)

    def test_a_listed_file_that_is_gone_is_an_error(self):
        result = run_stock("test/test_renamed.py::T::test_red_as_listed the stock defect\n")
        self.assertEqual(result.returncode, 4, result.stdout + result.stderr)
        self.assertIn("no file test/test_renamed.py (renamed or removed?)", result.stderr)


if __name__ == "__main__":
    unittest.main()
