"""``make ghstack PYTORCH_DIR=...``: the series as a ghstack stack, one commit (and one PR) per patch.

A branch is created from the PyTorch checkout's HEAD, every patch of ``patches/series`` is committed onto it
with ``git am`` (so each commit carries the patch's title and message), then ``ghstack submit`` runs there
with the arguments given after ``--``.

    python -m tools.ghstack_export --pytorch-dir ~/pytorch [--branch torch-overlay] [-- GHSTACK_SUBMIT_ARGS]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tools.project import default_project

DEFAULT_BRANCH = "torch-overlay"


class ExportError(RuntimeError):
    """The stack cannot be built; the checkout is left as it was."""


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def series_patches(patches_dir: Path) -> list[Path]:
    index = patches_dir / "series"
    if not index.is_file():
        raise ExportError(f"{index}: missing; run `make patches`")
    return [patches_dir / name for name in index.read_text(encoding="utf-8").split()]


def export_stack(pytorch_dir: Path, patches_dir: Path, branch: str = DEFAULT_BRANCH) -> list[str]:
    """Commit every patch onto a new ``branch`` of ``pytorch_dir``; returns the commit hashes, oldest first."""
    patches = series_patches(patches_dir)
    if _git(pytorch_dir, "rev-parse", "--git-dir").returncode != 0:
        raise ExportError(f"{pytorch_dir}: not a git checkout of PyTorch (PYTORCH_DIR=...)")
    if _git(pytorch_dir, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise ExportError(f"{pytorch_dir}: has uncommitted changes; commit or stash them first")
    previous = _git(pytorch_dir, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip()
    made = _git(pytorch_dir, "checkout", "--quiet", "-b", branch)
    if made.returncode != 0:
        raise ExportError(f"{pytorch_dir}: cannot create branch {branch!r}: {made.stderr.strip()} (use --branch)")
    for patch in patches:
        # NOTE: --keep-non-patch: plain `git am` strips every [...] of the subject, our [FSDP] and [2D] tags too.
        applied = _git(pytorch_dir, "am", "--quiet", "--keep-cr", "--keep-non-patch", str(patch.resolve()))
        if applied.returncode != 0:
            _git(pytorch_dir, "am", "--abort")
            _git(pytorch_dir, "checkout", "--quiet", previous)
            _git(pytorch_dir, "branch", "-D", branch)
            raise ExportError(
                f"{patch.name} does not apply to {pytorch_dir} at {previous}: {applied.stderr.strip()}\n"
                "The checkout was left as it was. Check out the series' base (torch/version.py git_version of "
                "the base wheel) or rebase the overlay (README, 'Rebase onto a newer torch')."
            )
    log = _git(pytorch_dir, "rev-list", "--reverse", f"-{len(patches)}", "HEAD").stdout.split()
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ghstack_export", description=__doc__.splitlines()[0])
    parser.add_argument("--pytorch-dir", type=Path, required=True, help="a git checkout of pytorch/pytorch")
    parser.add_argument("--branch", default=DEFAULT_BRANCH, help=f"branch to create (default {DEFAULT_BRANCH})")
    parser.add_argument("--no-submit", action="store_true", help="build the branch only")
    parser.add_argument("ghstack_args", nargs="*", help="passed to `ghstack submit` (after --)")
    args = parser.parse_args(argv)
    try:
        commits = export_stack(args.pytorch_dir, default_project().patches_dir, args.branch)
    except ExportError as e:
        print(f"make ghstack: {e}", file=sys.stderr)
        return 1
    print(f"make ghstack: {len(commits)} commits on branch {args.branch} of {args.pytorch_dir}")
    if args.no_submit:
        return 0
    return subprocess.run(
        [sys.executable, "-m", "ghstack", "submit", *args.ghstack_args], cwd=args.pytorch_dir
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
