"""The sync check (part of ``make check``): ``patches/`` and the overlay must never drift apart.

Fails, naming the file, when the manifest's base does not match the pristine base, when regenerating the
series does not give ``patches/`` byte for byte, when a patch does not ``git apply`` in order onto the
pristine base, or when the applied series differs from the overlay files or the tests.

    python -m tools.check [--wheel TORCH_WHEEL_OR_DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.patches import (
    PatchError,
    generate,
    generated_files,
    new_side_problems,
    read_upstream_edit,
)
from tools.pristine import BaseSourceError, pristine_base
from tools.project import Project, default_project
from tools.series import SeriesError, load_series
from torch_overlay._patchset import PatchApplyError, SeriesMissingError, apply_series, read_series


def drift(project: Project, expected: dict[str, bytes]) -> list[str]:
    """Files of ``patches/`` that differ from a fresh generation, each named with what to do."""
    problems = []
    present = {p.name: p for p in generated_files(project.patches_dir) if p.exists()}
    for name, content in expected.items():
        path = project.patches_dir / name
        if name not in present:
            problems.append(f"patches/{name}: missing; run `make patches`")
        elif path.read_bytes() != content:
            problems.append(
                f"patches/{name}: differs from what the overlay and series.toml generate; run `make patches`"
            )
    for name in sorted(set(present) - set(expected)):
        problems.append(f"patches/{name}: not part of the series any more; run `make patches`")
    return problems


def apply_problems(project: Project, base: dict[str, bytes]) -> list[str]:
    """Apply ``patches/series`` in order with ``git apply`` onto the base; compare with the overlay and tests."""
    try:
        patch_files = read_series(project.patches_dir)
    except SeriesMissingError as e:
        return [str(e)]
    patches = load_series(project.series_toml)
    edited = [path for p in patches for path in p.upstream_test_edits]
    # NOTE: upstream test files are not in the wheel; their edits are checked against test/ below.
    try:
        tree = apply_series(base, patch_files, [f"--exclude={path}" for path in edited])
    except PatchApplyError as e:
        return [f"patches/{e.patch.name}: does not apply in order onto the pristine base: {e.stderr}"]
    problems = []
    for path, content in project.overlay_files().items():
        if tree.get(path) != content:
            problems.append(f"{path}: the applied series differs from the overlay file torch_overlay/{path}")
    for path in [t for p in patches for t in p.tests]:
        if path not in tree:
            problems.append(f"{path}: not created by the applied series (patches/ is stale); run `make patches`")
        elif not project.repo_file(path).is_file():
            problems.append(f"{path}: in the applied series but missing in this repo; restore it or drop it")
        elif tree[path] != project.repo_file(path).read_bytes():
            problems.append(f"{path}: the applied series differs from the test file in this repo")
    for path in edited:
        if project.repo_file(path).is_file():
            problems += new_side_problems(project, read_upstream_edit(project, path), project.repo_file(path))
    return problems


def check(project: Project, source: Path | None = None) -> list[str]:
    """Every sync problem, one line each, naming the file; empty when the three faces agree."""
    try:
        base = pristine_base(project.manifest(), source)
        expected = generate(project, base)
    except (BaseSourceError, PatchError, SeriesError) as e:
        return [str(e)]
    return drift(project, expected) + apply_problems(project, base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.check", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="torch wheel or site-packages-like directory holding the base")
    parser.add_argument("--root", type=Path, default=None, help="project root (default: this repo)")
    args = parser.parse_args(argv)
    project = Project(args.root) if args.root else default_project()
    problems = check(project, args.wheel)
    for problem in problems:
        print(f"sync check failed: {problem}", file=sys.stderr)
    if not problems:
        print("sync check passed: patches/ reproduces the overlay and its tests from the pristine base")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
