"""``make ghstack PYTORCH_DIR=...``: the series as a ghstack stack, one commit (and one PR) per patch.

A branch is created from the PyTorch checkout's HEAD, every patch of the upstream series (``patches/series``:
never the backports that older bases' series add, which upstream has already) is committed onto it with ``git
am`` (so each commit carries the patch's title and message), authored and committed by the user (``git config
user.name``/``user.email`` there; without them it stops before changing anything), then ``ghstack submit`` runs
there with the arguments given after ``--``. ``--base`` names the release the checkout is at (default: the
installed torch's base), for the message when a patch does not apply.

``--offline`` needs no checkout: the same export runs in a scratch clone holding the base's pristine files (and
the old side of the upstream test edits), ghstack submits it to its own in-process fake GitHub
(``ghstack.github_fake``), and the stack it would push is printed, one line per PR. The pristine files come from
the sources ``tools.pristine`` knows, ``--wheel`` first; where none holds them, the base's wheel is downloaded as
``make sources`` does (pip, pinned, no dependencies), so only that step needs the network.

    python -m tools.ghstack_export --pytorch-dir ~/pytorch [--base X.Y.Z] [--branch torch-overlay] [-- ARGS]
    python -m tools.ghstack_export --offline [--base X.Y.Z] [--wheel WHEEL_OR_DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

from tools.patches import PatchError, edits_by_file, upstream_edits
from tools.pristine import BaseSourceError, Pristine, fetch, pristine
from tools.project import Project, default_project
from tools.series import SeriesError, load_series
from torch_overlay._git import git_env
from torch_overlay._git import run as _git_run
from torch_overlay._guard import BaseMismatchError, check_base
from torch_overlay._manifest import Base, load_manifest
from torch_overlay._patchset import SeriesMissingError, read_series

DEFAULT_BRANCH = "torch-overlay"


class ExportError(RuntimeError):
    """The stack cannot be built; the checkout is left as it was."""


def user_identity(repo: Path) -> tuple[str, str]:
    """The (name, email) git commits with in ``repo`` (its config, the user's global and system config).

    Raises, naming what is missing and the commands that set it, when either is not configured: the stack's
    commits must be the user's, never a placeholder's.
    """
    values = [_git(repo, "config", "--get", key).stdout.strip() for key in ("user.name", "user.email")]
    missing = [key for key, value in zip(("user.name", "user.email"), values, strict=True) if not value]
    if missing:
        raise ExportError(
            f"no git identity to author the stack's commits: {' and '.join(missing)} not set for {repo}.\n"
            'Set it: git config --global user.name "Your Name" && git config --global user.email you@example.com'
        )
    return values[0], values[1]


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """git in the user's PyTorch checkout: their config (identity) applies, inherited GIT_* variables do not."""
    proc = _git_run(cwd, *args, user_config=True)
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    )


def installed_base() -> str:
    """The base of the installed torch, or the newest base (the upstream series) when it matches none."""
    try:
        matched = check_base().matched
    except BaseMismatchError:
        matched = None
    return (matched or load_manifest().payload_base).version


def series_patches(patches_dir: Path) -> list[Path]:
    """The upstream series: what goes to PyTorch (an older base's own series adds backports upstream has)."""
    try:
        return read_series(patches_dir)
    except SeriesMissingError as e:
        raise ExportError(str(e)) from e


def export_stack(pytorch_dir: Path, patches_dir: Path, base_version: str, branch: str = DEFAULT_BRANCH) -> list[str]:
    """Commit the upstream series onto a new ``branch`` of ``pytorch_dir``, a checkout of torch ``base_version``
    (named when a patch does not apply); returns the commits, oldest first."""
    patches = series_patches(patches_dir)
    if _git(pytorch_dir, "rev-parse", "--git-dir").returncode != 0:
        raise ExportError(f"{pytorch_dir}: not a git checkout of PyTorch (PYTORCH_DIR=...)")
    user_identity(pytorch_dir)
    if _git(pytorch_dir, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise ExportError(f"{pytorch_dir}: has uncommitted changes; commit or stash them first")
    # NOTE: a detached HEAD (the series' base commit) has no branch to go back to: restore the commit.
    head = _git(pytorch_dir, "rev-parse", "HEAD").stdout.strip()
    symbolic = _git(pytorch_dir, "symbolic-ref", "--quiet", "--short", "HEAD").stdout.strip()
    made = _git(pytorch_dir, "checkout", "--quiet", "-b", branch)
    if made.returncode != 0:
        raise ExportError(f"{pytorch_dir}: cannot create branch {branch!r}: {made.stderr.strip()} (use --branch)")
    for patch in patches:
        # NOTE: --keep-non-patch: plain `git am` strips every [...] of the subject, our [FSDP] and [2D] tags too.
        applied = _git(pytorch_dir, "am", "--quiet", "--keep-cr", "--keep-non-patch", str(patch.resolve()))
        if applied.returncode == 0:
            # NOTE: `git am` keeps the patch's From: (series.toml's fixed author); the PR is the user's.
            applied = _git(pytorch_dir, "commit", "--quiet", "--amend", "--no-edit", "--no-verify", "--reset-author")
        if applied.returncode != 0:
            _git(pytorch_dir, "am", "--abort")
            back = ["checkout", "--quiet", symbolic] if symbolic else ["checkout", "--quiet", "--detach", head]
            restored = _git(pytorch_dir, *back)
            deleted = _git(pytorch_dir, "branch", "-D", branch) if restored.returncode == 0 else restored
            where = f"{symbolic or 'detached HEAD'} at {head[:12]}"
            if restored.returncode != 0 or deleted.returncode != 0:
                left = (
                    f"Could not restore the checkout ({(restored.stderr or deleted.stderr).strip()}): run "
                    f"`git checkout {symbolic or '--detach ' + head} && git branch -D {branch}` there."
                )
            else:
                left = f"The checkout was left as it was ({where})."
            raise ExportError(
                f"{patch.name} does not apply to {pytorch_dir} at {where}: {applied.stderr.strip()}\n{left} "
                f"Check out torch {base_version}'s commit (torch/version.py git_version of its wheel), or pick "
                "another base with --base."
            )
    log = _git(pytorch_dir, "rev-list", "--reverse", f"-{len(patches)}", "HEAD").stdout.split()
    return log


_HUNK_RE = re.compile(r"@@ -(\d+)(?:,(\d+))? ")


def _hunks(diff: str) -> list[tuple[int, list[str]]]:
    """A one-file diff's hunks: (0-based old line where it starts, its ' '/'-'/'+' lines)."""
    hunks: list[tuple[int, list[str]]] = []
    for line in diff.splitlines(keepends=True):
        match = _HUNK_RE.match(line)
        if match is not None:
            hunks.append((int(match.group(1)) - (1 if match.group(2) != "0" else 0), []))
        elif hunks and line[:1] in (" ", "-", "+"):
            hunks[-1][1].append(line)
    return hunks


def stand_in(diffs: list[str]) -> bytes:
    """A stand-in for the file that one-file diffs edit in turn: its lines as the first diff's old side has them
    where any diff needs them, filler between.

    Upstream test files are not in the wheel, so the scratch clone cannot hold them; this is enough for the
    diffs to apply in order exactly as they would to the real file. A later diff's context may be lines that no
    earlier diff shows: they are found through the earlier diffs, back in the first one's old side.
    """
    known: list[str | None] = []  # the file's lines, by line number; None where no diff shows it
    current: list[int | str] = []  # the file as the diffs so far leave it: a line of `known`, or one they added
    for diff in diffs:
        after: list[int | str] = []
        done = 0
        for start, lines in _hunks(diff):
            needed = start + sum(line[0] != "+" for line in lines)
            while len(current) < needed:  # unchanged lines past the end of what is known so far
                current.append(len(known))
                known.append(None)
            after += current[done:start]
            done = start
            for line in lines:
                if line[0] == "+":
                    after.append(line[1:])
                    continue
                if isinstance(current[done], int) and known[current[done]] is None:
                    known[current[done]] = line[1:]
                if line[0] == " ":
                    after.append(current[done])
                done += 1
        current = after + current[done:]
    return "".join("# (upstream lines not shown)\n" if line is None else line for line in known).encode("utf-8")


def offline_base(project: Project, base: Base, found: Pristine) -> dict[str, bytes]:
    """The files a PyTorch checkout at ``base`` has where the series touches it, for a scratch clone.

    The base's pristine files, and a stand-in (:func:`stand_in`) for each upstream test file the series edits.
    """
    files = found.files(base)
    for path, chain in edits_by_file(upstream_edits(project, load_series(project.series_toml))).items():
        files[path] = stand_in([edit.diff for edit in chain])
    return files


async def _submit_offline(files: dict[str, bytes], patches_dir: Path, base_version: str, identity: tuple[str, str]):
    import ghstack.test_prelude as gh  # ghstack's own offline harness: a bare upstream, a clone, a fake GitHub

    async with gh.scoped_test(direct=False):
        checkout = Path(gh.CTX.sh.cwd)
        for path, content in files.items():
            (checkout / path).parent.mkdir(parents=True, exist_ok=True)
            (checkout / path).write_bytes(content)
        await gh.git("add", "--all")
        await gh.git("commit", "--quiet", "-m", f"torch {base_version}")
        await gh.git("push", "--quiet", "origin", "HEAD:main")
        for key, value in zip(("user.name", "user.email"), identity, strict=True):
            await gh.git("config", key, value)
        commits = export_stack(checkout, patches_dir, base_version)
        authors = _git(checkout, "log", "--format=%an <%ae>", f"-{len(commits)}").stdout.split("\n")
        await gh.gh_submit("Initial")
        result = await gh.CTX.github.graphql(
            'query { repository(name: "pytorch", owner: "pytorch") { pullRequests { nodes { number title } } } }'
        )
    prs = sorted(result["data"]["repository"]["pullRequests"]["nodes"], key=lambda pr: pr["number"])
    return sorted({a for a in authors if a}), [(pr["number"], pr["title"]) for pr in prs]


def offline_sources(project: Project, base: Base, wheels: list[Path]) -> Pristine:
    """The pristine files for an offline export: ``wheels`` and every source on this machine, else the base's
    wheel downloaded as ``make sources`` does (only this base's: one machine may hold only its own venv)."""
    found = pristine(project, wheels)
    if found.missing(base):
        print(f"make ghstack: torch {base.version}'s pristine files are not on this machine: downloading its wheel")
        fetch(project, [base])
        found = pristine(project, wheels)
    return found


def offline_stack(project: Project, base: Base, found: Pristine, identity: tuple[str, str]) -> str:
    """What ``ghstack submit`` would push, the upstream series on the base's files, from ghstack's fake GitHub."""
    files = offline_base(project, base, found)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            authors, prs = asyncio.run(_submit_offline(files, project.patches_dir, base.version, identity))
    except Exception as e:
        raise ExportError(f"the offline submission failed: {e}\n{log.getvalue()[-3000:]}") from e
    lines = [f"the upstream series on torch {base.version}, as ghstack would push it ({len(prs)} PRs, by "
             f"{', '.join(authors)}):"]  # fmt: skip
    return "\n".join(lines + [f"#{number} {title}" for number, title in prs])


def main(argv: list[str] | None = None, project: Project | None = None) -> int:
    project = project or default_project()
    parser = argparse.ArgumentParser(prog="python -m tools.ghstack_export", description=__doc__.splitlines()[0])
    parser.add_argument("--pytorch-dir", default="", help="a git checkout of pytorch/pytorch")
    parser.add_argument("--offline", action="store_true", help="show the stack against ghstack's fake GitHub")
    parser.add_argument("--branch", default=DEFAULT_BRANCH, help=f"branch to create (default {DEFAULT_BRANCH})")
    parser.add_argument("--base", default=None, help="the release the checkout is at (default: the installed base)")
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="--offline: a source of the base's files (make: WHEEL=)"
    )
    parser.add_argument("--no-submit", action="store_true", help="build the branch only")
    parser.add_argument("ghstack_args", nargs="*", help="passed to `ghstack submit` (after --)")
    args = parser.parse_args(argv)
    manifest = project.manifest()
    try:
        base = args.base or installed_base()
        if manifest.base(base) is None:
            raise ExportError(f"--base {base} is not a base ({', '.join(manifest.versions)})")
        if args.offline:
            identity = user_identity(project.root)
            found = offline_sources(project, manifest.base(base), args.wheel)
            print(offline_stack(project, manifest.base(base), found, identity))
            return 0
        if not args.pytorch_dir:  # NOTE: never "" (Path("") is this repository)
            raise ExportError("no PyTorch checkout: PYTORCH_DIR=~/pytorch (or GHSTACK_OFFLINE=1 to try it offline)")
        commits = export_stack(Path(args.pytorch_dir), project.patches_dir, base, args.branch)
    except (ExportError, BaseSourceError, SeriesError, PatchError) as e:
        print(f"make ghstack: {e}", file=sys.stderr)
        return 1
    print(f"make ghstack: {len(commits)} commits (the upstream series) on branch {args.branch} of {args.pytorch_dir}")
    if args.no_submit:
        return 0
    return subprocess.run(
        [sys.executable, "-m", "ghstack", "submit", *args.ghstack_args],
        cwd=args.pytorch_dir,
        env=git_env(user_config=True),
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
