"""Command lines: ``python -m torch_overlay.activate [--revert|--status|--check]`` and ``torch-overlay``.

Thin: parse arguments, call the library, print what happened, return an exit code (0 done, 1 refused, check
failed or status found a problem; 141, quietly, when the reader of stdout went away, as for a Unix tool killed by
SIGPIPE).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from torch_overlay import __version__, _fork
from torch_overlay._guard import BaseMismatchError, require_base
from torch_overlay._persistent import install_hook, remove_hook
from torch_overlay._status import status


def _apply() -> int:
    refusal = _fork.refusal("install the persistent overlay")
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    warning = require_base("install the persistent overlay").warning
    if warning:
        print(warning, file=sys.stderr)
    path, changed = install_hook()
    if changed:
        print(f"torch-overlay: persistent overlay installed: {path}")
        print("Every new Python process of this environment now uses the overlay (TORCH_OVERLAY=0 opts out).")
    else:
        print(f"torch-overlay: persistent overlay already installed: {path} (nothing changed)")
    return 0


def _revert() -> int:
    path = remove_hook()
    if path is None:
        print("torch-overlay: no persistent overlay installed (nothing changed)")
    else:
        print(f"torch-overlay: persistent overlay removed: {path}")
    return 0


def _status() -> int:
    report = status()
    print(report.format())
    return 0 if report.ok else 1


def _check() -> int:
    report = status()
    if report.ok and report.fork is not None:  # the patched files are torch's own: nothing to activate
        fork = report.fork
        print(
            f"torch-overlay: check passed: fork mode serves torch {fork.base_version} ({len(fork.patches)} patches "
            f"applied in place, every file as fork mode wrote it)"
        )
        return 0
    if report.ok:
        print(f"torch-overlay: check passed: {report.base.summary()}")
        if report.base.warning:
            print(report.base.warning, file=sys.stderr)
        return 0
    for problem in report.problems():
        print(f"torch-overlay: check failed: {problem}", file=sys.stderr)
    if report.fix() is not None:
        print(f"torch-overlay: fix: {report.fix()}", file=sys.stderr)
    return 1


def _apply_patches(patches_dir: Path | None) -> int:
    state, changed = _fork.apply(patches_dir)
    files = ", ".join(f.path for f in state.files if f.before_sha256 != f.after_sha256)
    if changed:
        print(f"torch-overlay: fork mode applied: {len(state.patches)} patches to torch {state.base_version}: {files}")
        if state.torch_version and state.base_version != state.torch_version:
            print(f"(torch {state.torch_version} is not a listed base; its files are those of {state.base_version})")
        print("Revert with `torch-overlay revert-patches`.")
    else:
        print(f"torch-overlay: fork mode already applied ({len(state.patches)} patches; nothing changed)")
    return 0


def _revert_patches() -> int:
    state = _fork.revert()
    if state is None:
        print("torch-overlay: fork mode is not applied (nothing changed)")
    else:
        restored = sum(f.before_sha256 != f.after_sha256 for f in state.files)
        print(f"torch-overlay: fork mode reverted: {restored} files restored to torch {state.base_version}")
    return 0


ACTIONS = {"apply": _apply, "revert": _revert, "status": _status, "check": _check, "revert-patches": _revert_patches}


def run(action: str, patches_dir: Path | None = None) -> int:
    """Run ``action``; ``patches_dir`` (apply-patches only): None = the series this package carries."""
    try:
        code = _apply_patches(patches_dir) if action == "apply-patches" else ACTIONS[action]()
        sys.stdout.flush()  # a closed stdout shows here, not at exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (BaseMismatchError, _fork.ForkError) as e:
        print(e, file=sys.stderr)
        return 1
    except OSError as e:  # e.g. a read-only site-packages: say which file, and that nothing was changed
        print(
            f"torch-overlay: {action} failed on {e.filename}: {e.strerror}. Nothing was changed; "
            "run it as a user who can write this environment.",
            file=sys.stderr,
        )
        return 1


def _stdout_closed() -> int:
    """The reader of stdout went away (``--status | head -1``): end without a word, as a Unix tool does.

    NOTE: Python ignores SIGPIPE, so the write raised instead; it would complain once more when it flushes
    stdout at exit, so stdout goes to /dev/null first. What the command did is done (only printing stopped).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"torch-overlay {__version__}")


def activate_main(argv: list[str] | None = None) -> int:
    """``python -m torch_overlay.activate``: install the persistent overlay, or revert/status/check it."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_overlay.activate",
        description="Install the overlay into this environment for every new Python process.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--revert", action="store_const", dest="action", const="revert", help="remove it")
    group.add_argument("--status", action="store_const", dest="action", const="status", help="say what is active")
    group.add_argument(
        "--check",
        action="store_const",
        dest="action",
        const="check",
        help="verify the base and the hook without changing anything",
    )
    _add_version(parser)
    args = parser.parse_args(argv)
    return run(args.action or "apply")


def main(argv: list[str] | None = None) -> int:
    """``torch-overlay <command>``: the same actions as subcommands."""
    parser = argparse.ArgumentParser(
        prog="torch-overlay", description="Install, remove and inspect the torch-overlay overlay and fork mode."
    )
    _add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("apply-overlay", help="install the persistent overlay into this environment")
    sub.add_parser("revert-overlay", help="remove the persistent overlay")
    sub.add_parser("status", help="say what is active")
    sub.add_parser("check", help="verify the base and the hook without changing anything")
    command = sub.add_parser("apply-patches", help="fork mode: apply the patch series in place to the installed torch")
    command.add_argument(
        "--patches", type=Path, default=None, help="a patches/ directory (default: the series this package carries)"
    )
    sub.add_parser("revert-patches", help="restore the files fork mode replaced, byte for byte")
    args = parser.parse_args(argv)
    action = {"apply-overlay": "apply", "revert-overlay": "revert"}.get(args.command, args.command)
    return run(action, getattr(args, "patches", None))
