"""Command lines: ``python -m torch_overlay.activate [--revert|--status|--check]`` and ``torch-overlay``.

Thin: parse arguments, call the library, print what happened, return an exit code (0 done, 1 refused or
check failed).
"""

from __future__ import annotations

import argparse
import sys

from torch_overlay._guard import BaseMismatchError
from torch_overlay._persistent import install_hook, remove_hook
from torch_overlay._status import status


def _apply() -> int:
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
    print(status().format())
    return 0


def _check() -> int:
    report = status()
    if report.ok:
        print("torch-overlay: check passed: the installed torch is the overlay's base")
        return 0
    for problem in report.problems():
        print(f"torch-overlay: check failed: {problem}", file=sys.stderr)
    return 1


ACTIONS = {"apply": _apply, "revert": _revert, "status": _status, "check": _check}


def run(action: str) -> int:
    try:
        return ACTIONS[action]()
    except BaseMismatchError as e:
        print(e, file=sys.stderr)
        return 1


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
    args = parser.parse_args(argv)
    return run(args.action or "apply")


def main(argv: list[str] | None = None) -> int:
    """``torch-overlay <command>``: the same actions as subcommands."""
    parser = argparse.ArgumentParser(prog="torch-overlay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("apply-overlay", help="install the persistent overlay into this environment")
    sub.add_parser("revert-overlay", help="remove the persistent overlay")
    sub.add_parser("status", help="say what is active")
    sub.add_parser("check", help="verify the base and the hook without changing anything")
    args = parser.parse_args(argv)
    action = {"apply-overlay": "apply", "revert-overlay": "revert"}.get(args.command, args.command)
    return run(action)
