"""The series as a ghstack stack, end to end and offline, against ghstack's own fake GitHub.

As ghstack's own tests do (``ghstack.test_prelude``), a bare git repository stands in for pytorch/pytorch on
the fake GitHub and a clone of it for the contributor's checkout; the checkout gets the pristine base files,
``export_stack`` commits the series onto a branch with ``git am``, and ghstack submits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import tempfile
import unittest
import zipfile
from pathlib import Path
from unittest import mock

import expecttest
import ghstack.test_prelude as gh
from _patch_project import BASE, OLD_BASE, UPSTREAM_TEST_OLD, make_project, share_upstream_edit

from tools import ghstack_export
from tools.ghstack_export import ExportError, export_stack, offline_base, offline_stack, user_identity
from tools.patches import generate, write
from tools.pristine import pristine, wheel_dir
from tools.project import REPO_ROOT


async def _submit_stack(patches_dir: Path) -> tuple[list[str], list[dict]]:
    async with gh.scoped_test(direct=False):
        checkout = Path(gh.CTX.sh.cwd)
        for path, text in {**BASE, "test/fake/test_upstream.py": UPSTREAM_TEST_OLD}.items():
            (checkout / path).parent.mkdir(parents=True, exist_ok=True)
            await gh.write_file_and_add(path, text)
        await gh.git("commit", "-m", "Upstream base")
        await gh.git("push", "origin", "HEAD:main")
        await gh.git("config", "user.name", "A U Thor")
        await gh.git("config", "user.email", "author@example.com")
        # The checkout is at the newest base (9.9.0): its series is the upstream one, without the backport.
        commits = export_stack(checkout, patches_dir, "9.9.0", "overlay-stack")
        # The user's identity (the checkout's git config), never the From: of the patches (series.toml's author)
        identities = subprocess.run(
            ["git", "log", "--format=%an <%ae> / %cn <%ce>", "-2"], cwd=checkout, capture_output=True, text=True
        ).stdout
        assert identities == "A U Thor <author@example.com> / A U Thor <author@example.com>\n" * 2, identities
        await gh.gh_submit("Initial")
        result = await gh.CTX.github.graphql(
            """
            query {
              repository(name: "pytorch", owner: "pytorch") {
                pullRequests { nodes { number title body baseRefName headRefName } }
              }
            }
            """
        )
        return commits, result["data"]["repository"]["pullRequests"]["nodes"]


def _set_identity(checkout: Path) -> None:
    subprocess.run(["git", "-C", str(checkout), "config", "user.name", "A"], check=True)
    subprocess.run(["git", "-C", str(checkout), "config", "user.email", "a@b"], check=True)


class TestGhstackExport(expecttest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.project, self.sources = make_project(Path(self._tmp.name))
        write(self.project, generate(self.project, pristine(self.project, self.sources)))

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_one_pr_per_patch_in_order(self) -> None:
        commits, prs = asyncio.run(_submit_stack(self.project.patches_dir))
        self.assertEqual(len(commits), 2)
        prs.sort(key=lambda pr: pr["number"])
        self.assertExpectedInline(
            "\n".join(f"#{pr['number']} {pr['title']} ({pr['headRefName']} -> {pr['baseRefName']})" for pr in prs),
            """\
#500 [FSDP] Fix line 3 (gh/ezyang/1/head -> gh/ezyang/1/base)
#501 [2D] Extend alpha and beta (gh/ezyang/2/head -> gh/ezyang/2/base)""",
        )
        self.assertExpectedInline(
            prs[0]["body"].replace("\r", ""),
            """\
Stack:
* #501
* __->__ #500

Summary:
Line 3 was wrong.

Test Plan:
python test/fake/test_one.py

Fixes #12345""",
        )
        self.assertIn("Summary:\nExtends two things.", prs[1]["body"].replace("\r", ""))
        self.assertIn("Test Plan:\npython test/fake/test_two.py", prs[1]["body"].replace("\r", ""))

    def test_patch_that_does_not_apply_leaves_checkout_alone(self) -> None:
        checkout = Path(self._tmp.name) / "checkout"
        subprocess.run(["git", "init", "-q", "-b", "main", str(checkout)], check=True)
        _set_identity(checkout)
        (checkout / "README").write_text("not pytorch\n")
        subprocess.run(["git", "add", "."], cwd=checkout, check=True)
        env = ["-c", "user.name=A", "-c", "user.email=a@b"]
        subprocess.run(["git", *env, "commit", "-q", "-m", "x"], cwd=checkout, check=True)
        with self.assertRaises(ExportError) as e:
            export_stack(checkout, self.project.patches_dir, "9.9.0")
        self.assertIn("0001-fix-alpha.patch does not apply to", str(e.exception))
        head = subprocess.run(["git", "branch", "--show-current"], cwd=checkout, capture_output=True, text=True)
        self.assertEqual(head.stdout.strip(), "main")
        branches = subprocess.run(["git", "branch"], cwd=checkout, capture_output=True, text=True).stdout
        self.assertNotIn("torch-overlay", branches)

    def test_failed_export_restores_a_detached_head(self) -> None:
        checkout = Path(self._tmp.name) / "checkout"
        subprocess.run(["git", "init", "-q", "-b", "main", str(checkout)], check=True)
        _set_identity(checkout)
        env = ["-c", "user.name=A", "-c", "user.email=a@b"]
        for text in ["one\n", "two\n"]:
            (checkout / "README").write_text(text)
            subprocess.run(["git", "add", "."], cwd=checkout, check=True)
            subprocess.run(["git", *env, "commit", "-q", "-m", text], cwd=checkout, check=True)
        subprocess.run(["git", "checkout", "-q", "--detach", "HEAD~1"], cwd=checkout, check=True)
        base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout
        with self.assertRaises(ExportError) as e:
            export_stack(checkout, self.project.patches_dir, "9.9.0")
        self.assertIn(f"The checkout was left as it was (detached HEAD at {base[:12]})", str(e.exception))
        git = ["git", "-C", str(checkout)]
        self.assertEqual(subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout, base)
        self.assertEqual(subprocess.run([*git, "branch", "--show-current"], capture_output=True, text=True).stdout, "")
        self.assertNotIn("torch-overlay", subprocess.run([*git, "branch"], capture_output=True, text=True).stdout)

    def test_no_identity_is_an_error_before_any_change(self) -> None:
        checkout = Path(self._tmp.name) / "checkout"
        subprocess.run(["git", "init", "-q", "-b", "main", str(checkout)], check=True)
        env = ["-c", "user.name=A", "-c", "user.email=a@b"]
        subprocess.run(["git", *env, "commit", "-q", "--allow-empty", "-m", "x"], cwd=checkout, check=True)
        # No global or system config: HOME and XDG_CONFIG_HOME point at an empty directory.
        home = {"HOME": self._tmp.name, "XDG_CONFIG_HOME": self._tmp.name, "GIT_CONFIG_NOSYSTEM": "1"}
        with mock.patch.dict(os.environ, home), mock.patch("torch_overlay._git.git_env", _no_system_config):
            with self.assertRaises(ExportError) as e:
                export_stack(checkout, self.project.patches_dir, "9.9.0")
        self.assertExpectedInline(
            str(e.exception).replace(str(checkout), "CHECKOUT"),
            """\
no git identity to author the stack's commits: user.name and user.email not set for CHECKOUT.
Set it: git config --global user.name "Your Name" && git config --global user.email you@example.com""",
        )
        branches = subprocess.run(["git", "branch"], cwd=checkout, capture_output=True, text=True).stdout
        self.assertEqual(branches, "* main\n")
        subprocess.run(["git", "config", "user.email", "me@example.com"], cwd=checkout, check=True)
        with mock.patch.dict(os.environ, home), mock.patch("torch_overlay._git.git_env", _no_system_config):
            self.assertRaisesRegex(ExportError, "user.name not set", user_identity, checkout)

    def test_offline_shows_the_stack_it_would_push(self) -> None:
        base = self.project.manifest().base("9.9.0")
        found = pristine(self.project, self.sources)
        self.assertExpectedInline(
            offline_stack(self.project, base, found, ("Pat Contributor", "pat@example.com")),
            """\
the upstream series on torch 9.9.0, as ghstack would push it (2 PRs, by Pat Contributor <pat@example.com>):
#500 [FSDP] Fix line 3
#501 [2D] Extend alpha and beta""",
        )

    def test_an_older_base_exports_the_upstream_series_only(self) -> None:
        """The stack goes upstream: never the backport that 9.8.0's own series (fork mode's) adds."""
        base = self.project.manifest().base("9.8.0")
        found = pristine(self.project, self.sources)
        stack = offline_stack(self.project, base, found, ("Pat Contributor", "pat@example.com"))
        self.assertIn("the upstream series on torch 9.8.0, as ghstack would push it (2 PRs", stack)
        self.assertNotIn("Backport", stack)

    def make_ghstack(self, *args: str) -> tuple[int, str]:
        """`make ghstack GHSTACK_OFFLINE=1 ...` on the synthetic project, by Pat."""
        out = io.StringIO()
        identity = mock.patch.object(ghstack_export, "user_identity", return_value=("Pat", "pat@example.com"))
        with identity, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = ghstack_export.main(["--offline", *args], project=self.project)
        return code, out.getvalue()

    def test_offline_on_a_machine_without_the_base_fetches_it(self) -> None:
        """Only the default venv here: the base's pristine files come as `make sources` gets them, its wheel."""

        def fetch(project, bases):
            self.assertEqual([b.version for b in bases], ["9.8.0"])
            wheel_dir(project).mkdir(parents=True)
            with zipfile.ZipFile(wheel_dir(project) / "torch-9.8.0-py3-none-any.whl", "w") as wheel:
                for path, text in OLD_BASE.items():
                    wheel.writestr(path, text)
            return []

        with mock.patch.object(ghstack_export, "fetch", side_effect=fetch) as fetched:
            code, out = self.make_ghstack("--base", "9.8.0")
        self.assertEqual(code, 0, out)
        self.assertEqual(fetched.call_count, 1)
        self.assertIn("torch 9.8.0's pristine files are not on this machine: downloading its wheel", out)
        self.assertIn("the upstream series on torch 9.8.0, as ghstack would push it (2 PRs, by Pat", out)

    def test_offline_takes_the_wheel_its_hint_names(self) -> None:
        """The hint of a missing base (`--wheel (make: WHEEL=)`) is taken by the tool and by `make ghstack`."""
        with mock.patch.object(ghstack_export, "fetch", side_effect=AssertionError("no download")):
            code, out = self.make_ghstack("--base", "9.8.0", "--wheel", str(self.sources[1]))
        self.assertEqual(code, 0, out)
        self.assertIn("(2 PRs", out)
        make = ["make", "-n", "-o", ".venv/2.13.0/.installed", "ghstack", "TORCH=2.13.0", "GHSTACK_OFFLINE=1"]
        dry = subprocess.run([*make, "BASE=2.15.0", "WHEEL=/w.whl"], cwd=REPO_ROOT, capture_output=True, text=True)
        self.assertIn("--base 2.15.0 --wheel /w.whl", " ".join(dry.stdout.replace("\\\n", " ").split()), dry.stderr)

    def test_offline_stand_in_for_an_upstream_test_two_patches_edit(self) -> None:
        # The second diff's hunk (test_z) is far from the first's (test_a): its lines come from the second diff,
        # placed where the first diff's old side has them.
        share_upstream_edit(self.project, Path(self._tmp.name))
        write(self.project, generate(self.project, pristine(self.project, self.sources)))
        base = self.project.manifest().base("9.9.0")
        found = pristine(self.project, self.sources)
        stand_in = offline_base(self.project, base, found)["test/fake/test_upstream.py"].decode()
        filler = "# (upstream lines not shown)\n"
        test_a, test_z = "\n\ndef test_a():\n    assert 1\n\n\ndef test_b():\n", "\n\ndef test_z():\n    assert 1\n"
        self.assertEqual(stand_in, filler + test_a + filler * 17 + test_z)
        self.assertIn("(2 PRs", offline_stack(self.project, base, found, ("Pat Contributor", "pat@example.com")))


def _no_system_config(user_config: bool = False, identity: tuple[str, str] = ("x", "y")) -> dict[str, str]:
    """The user's environment without the system git config (a test machine may set an identity there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return {**env, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}


if __name__ == "__main__":
    unittest.main()
