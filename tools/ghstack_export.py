"""``make ghstack PYTORCH_DIR=...``: the series as a ghstack stack, one commit (and one PR) per patch.

A branch is created from the PyTorch checkout's HEAD, every patch of the base's series is committed onto it
with ``git am`` (so each commit carries the patch's title and message), then ``ghstack submit`` runs there
with the arguments given after ``--``. The base is the installed torch's (``--base`` overrides it): the newest
base's series is the upstream one; an older base's also carries the backports it needs.

    python -m tools.ghstack_export --pytorch-dir ~/pytorch [--base X.Y.Z] [--branch torch-overlay] [-- ARGS]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tools.project import default_project
from torch_overlay._git import git_env
from torch_overlay._git import run as _git_run
from torch_overlay._guard import BaseMismatchError, check_base
from torch_overlay._manifest import load_manifest
from torch_overlay._patchset import SeriesMissingError, read_series

DEFAULT_BRANCH = "torch-overlay"


class ExportError(RuntimeError):
    """The stack cannot be built; the checkout is left as it was."""


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


def series_patches(patches_dir: Path, base_version: str) -> list[Path]:
    try:
        return read_series(patches_dir, base_version)
    except SeriesMissingError as e:
        raise ExportError(str(e)) from e


def export_stack(pytorch_dir: Path, patches_dir: Path, base_version: str, branch: str = DEFAULT_BRANCH) -> list[str]:
    """Commit the base's patches onto a new ``branch`` of ``pytorch_dir``; returns the commits, oldest first."""
    patches = series_patches(patches_dir, base_version)
    if _git(pytorch_dir, "rev-parse", "--git-dir").returncode != 0:
        raise ExportError(f"{pytorch_dir}: not a git checkout of PyTorch (PYTORCH_DIR=...)")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ghstack_export", description=__doc__.splitlines()[0])
    parser.add_argument("--pytorch-dir", type=Path, required=True, help="a git checkout of pytorch/pytorch")
    parser.add_argument("--branch", default=DEFAULT_BRANCH, help=f"branch to create (default {DEFAULT_BRANCH})")
    parser.add_argument("--base", default=None, help="whose series (default: the installed torch's base)")
    parser.add_argument("--no-submit", action="store_true", help="build the branch only")
    parser.add_argument("ghstack_args", nargs="*", help="passed to `ghstack submit` (after --)")
    args = parser.parse_args(argv)
    try:
        base = args.base or installed_base()
        if load_manifest().base(base) is None:
            raise ExportError(f"--base {base} is not a base ({', '.join(load_manifest().versions)})")
        commits = export_stack(args.pytorch_dir, default_project().patches_dir, base, args.branch)
    except ExportError as e:
        print(f"make ghstack: {e}", file=sys.stderr)
        return 1
    print(f"make ghstack: {len(commits)} commits (torch {base}'s series) on branch {args.branch} of {args.pytorch_dir}")
    if args.no_submit:
        return 0
    return subprocess.run(
        [sys.executable, "-m", "ghstack", "submit", *args.ghstack_args],
        cwd=args.pytorch_dir,
        env=git_env(user_config=True),
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
