"""Per-base payloads: our change transplanted onto each base's own upstream file, where one payload cannot serve.

A runtime module whose upstream file differs in code between bases lists, in manifest.json, the bases that get
their own payload (``base_payloads``; one per distinct upstream file). Each is a function of the payload and the
pristine files, never edited by hand: the 3-way merge (``git merge-file``) of the payload (ours, the newest
base's file plus our change) with that base's file (theirs) over the newest base's file, the same clean merge the
sync check expects fork mode to give on that base. ``make patches`` writes them (run it after editing a payload
file), ``make check`` fails when one is not exactly that merge, and ``make rebase`` writes them for a new base.

    python -m tools.transplant [--wheel TORCH_WHEEL_OR_DIR ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.pristine import BaseSourceError, Pristine, pristine
from tools.project import Project, default_project
from torch_overlay import _git
from torch_overlay._atomic import write_atomically

REGENERATE = "run `make patches` (python -m tools.transplant)"


class TransplantError(RuntimeError):
    """Our change does not merge cleanly onto a base's file; the message names the file."""


def transplants(project: Project, found: Pristine) -> dict[Path, bytes]:
    """Every per-base payload file of ``project`` -> what it must hold."""
    manifest = project.manifest()
    newest = manifest.payload_base
    out = {}
    for m in [m for m in manifest.runtime_modules if m.base_payloads]:
        ours = project.overlay_file(m.path).read_bytes()
        base = found.files(newest)[m.path]
        for version in m.base_payloads:
            theirs = found.files(manifest.base(version))[m.path]
            target = project.base_payload_file(version, m.path)
            labels = (f"overlay/{m.path}", f"torch-{newest.version}/{m.path}", f"torch-{version}/{m.path}")
            conflicts, merged = _git.merge_file(ours, base, theirs, labels)
            if conflicts:
                raise TransplantError(
                    f"{target.relative_to(project.root)}: our change in torch_overlay/{m.path} does not merge "
                    f"cleanly onto torch {version}'s file ({conflicts} conflicting hunks); keep it off the lines "
                    f"torch {version} has otherwise, or drop torch {version} (docs/patches.md, 'Add a torch release')"
                )
            out[target] = merged
    return out


def stale(project: Project, expected: dict[Path, bytes]) -> list[Path]:
    """Files under ``torch_overlay/bases/`` that are no payload of the manifest's ``base_payloads``."""
    present = sorted(p for p in project.bases_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return [p for p in present if p not in expected]


def problems(project: Project, found: Pristine) -> list[str]:
    """Where a per-base payload is missing, stale or not exactly the transplant: one line each, with the fix."""
    try:
        expected = transplants(project, found)
    except (TransplantError, BaseSourceError) as e:
        return [str(e)]
    lines = []
    for path, content in expected.items():
        where = path.relative_to(project.root)
        if not path.is_file():
            lines.append(f"{where}: missing; {REGENERATE}")
        elif path.read_bytes() != content:
            version = where.parts[2]
            lines.append(
                f"{where}: not our change in torch_overlay/{Path(*where.parts[3:]).as_posix()} transplanted onto "
                f"torch {version}'s file; {REGENERATE}"
            )
    lines += [
        f"{p.relative_to(project.root)}: no base payload in manifest.json; {REGENERATE}"
        for p in stale(project, expected)
    ]
    return lines


def write(project: Project, files: dict[Path, bytes]) -> list[Path]:
    """Write the per-base payloads and remove the stale ones; returns the files that changed."""
    changed = []
    for path in stale(project, files):
        path.unlink()
        changed.append(path)
    for path, content in files.items():
        if not path.is_file() or path.read_bytes() != content:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, content)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.transplant", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="a torch wheel or site-packages-like directory"
    )
    parser.add_argument("--root", type=Path, default=None, help="project root (default: this repo)")
    args = parser.parse_args(argv)
    project = Project(args.root) if args.root else default_project()
    try:
        files = transplants(project, pristine(project, args.wheel))
    except (BaseSourceError, TransplantError) as e:
        print(f"transplant: {e}", file=sys.stderr)
        return 1
    changed = write(project, files)
    for path in sorted(files):
        state = "written" if path in changed else "unchanged"
        print(f"{path.relative_to(project.root)}: {state}")
    for path in [p for p in changed if p not in files]:
        print(f"{path.relative_to(project.root)}: removed (no base payload in manifest.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
