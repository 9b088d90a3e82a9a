"""The sync check (part of ``make check``): ``patches/`` and the overlay must never drift apart, on any base.

Fails, naming the file, when regenerating the series does not give ``patches/`` byte for byte, when the
package declares a torch requirement (installing torch-overlay must never install, upgrade or downgrade
torch: the guard checks the release at activation instead), or, for any base, when its series
(``patches/series`` or ``patches/series-<version>``) does not ``git apply`` in order onto that base's
pristine files, or gives anything but the overlay: the payload itself where the base's file is the payload's
base file, else our change transplanted onto the base's file (a clean 3-way merge), without the backports
the base does not need; and where a patch gives its version of a file as a snapshot, when its prefix of the
series does not give exactly that snapshot (on a base whose file differs, the snapshot merged onto it, as the
payload is).
A new module (no release ships it) must be created by the patch that claims it, as the overlay has it.
It also fails when a module's ``code_sha256`` (the manifest's claim that every base the payload serves has
the same code, comments aside) is not the code digest of each such base's pristine file, and when a per-base
payload (``torch_overlay/bases/...``) is missing, stale, or not exactly our change transplanted onto that
base's file (:mod:`tools.transplant`).

    python -m tools.check [--wheel TORCH_WHEEL_OR_DIR ...]
"""

from __future__ import annotations

import argparse
import sys
import tokenize
from pathlib import Path

from tools import transplant
from tools.patches import (
    PatchError,
    chain_problems,
    edits_by_file,
    generate,
    generated_files,
    new_side_problems,
    upstream_edits,
)
from tools.pristine import BaseSourceError, Pristine, pristine
from tools.project import Project, default_project
from tools.series import Patch, SeriesError, file_states, load_series, load_snapshots, series_for, snapshot_file
from torch_overlay import _git
from torch_overlay._manifest import Base, Manifest, code_sha256
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


def requirement_problems(project: Project) -> list[str]:
    found = project.declared_requirement()
    if found is None:
        return []
    return [
        f"pyproject.toml: the dependency {found!r} must go: pip would install, upgrade or downgrade the user's torch "
        "to meet it; the guard checks the release at activation (docs/activation.md, 'Install')"
    ]


def expected_files(project: Project, found: Pristine, base: Base, needed: list[Patch]) -> dict[str, bytes | None]:
    """What the series of ``base`` must turn its pristine files into (None: a new module it must not create yet);
    raises PatchError if not well defined."""
    manifest = project.manifest()
    payload_base = found.files(manifest.payload_base)
    patches = load_series(project.series_toml)
    snapshots = load_snapshots(project.series_toml, patches)
    states = file_states(patches, payload_base, project.overlay_files(), snapshots)
    state = states[len(needed) - 1] if needed else payload_base
    files = found.files(base)
    expected: dict[str, bytes | None] = {m.path: state.get(m.path) for m in manifest.new_modules}
    for path, content in files.items():
        if content == payload_base[path]:
            expected[path] = state[path]
            continue
        expected[path] = transplanted(state[path], payload_base[path], content, path, base, manifest)
    return expected


def transplanted(ours: bytes, payload_base: bytes, content: bytes, path: str, base: Base, manifest: Manifest) -> bytes:
    """``ours`` (a version of ``path`` over the payload base's file) merged onto ``base``'s own file."""
    labels = (f"overlay/{path}", f"torch-{manifest.payload_base.version}/{path}", f"torch-{base.version}/{path}")
    conflicts, merged = _git.merge_file(ours, payload_base, content, labels)
    if conflicts:
        raise PatchError(
            f"{path}: our change does not merge cleanly onto torch {base.version}'s file ({conflicts} "
            "conflicting hunks); the one payload cannot serve this base (docs/patches.md, 'Add a torch release')"
        )
    return merged


def base_problems(project: Project, found: Pristine, base: Base) -> list[str]:
    """Apply the base's series in order with ``git apply`` onto its pristine files; compare with the overlay."""
    where = f"torch {base.version}"
    try:
        files = found.files(base)
        patch_files = read_series(project.patches_dir, base.version)
        patches = load_series(project.series_toml)
        needed = series_for(patches, base.version)
        expected = expected_files(project, found, base, needed)
    except (BaseSourceError, SeriesMissingError, SeriesError, PatchError) as e:
        return [f"{where}: {e}"]
    edited = [path for p in patches for path in p.upstream_test_edits]
    # NOTE: upstream test files are not in the wheel; their edits are checked against test/ in check().
    try:
        tree = apply_series(files, patch_files, [f"--exclude={path}" for path in edited])
    except PatchApplyError as e:
        return [f"{where}: patches/{e.patch.name}: does not apply in order onto the pristine files: {e.stderr}"]
    problems = snapshot_problems(project, found, base, patch_files, needed, edited)
    for path, content in expected.items():
        if tree.get(path) != content:
            problems.append(f"{where}: {path}: the applied series differs from the overlay file torch_overlay/{path}")
    for path in [t for p in needed for t in p.tests]:
        if path not in tree:
            problems.append(f"{where}: {path}: not created by the applied series (patches/ is stale)")
        elif not project.repo_file(path).is_file():
            problems.append(f"{path}: in the applied series but missing in this repo; restore it or drop it")
        elif tree[path] != project.repo_file(path).read_bytes():
            problems.append(f"{where}: {path}: the applied series differs from the test file in this repo")
    return problems


def snapshot_problems(
    project: Project,
    found: Pristine,
    base: Base,
    patch_files: list[Path],
    needed: list[Patch],
    edited: list[str],
) -> list[str]:
    """Where patches 1..k, applied in order, do not give patch k's snapshot of a file exactly (empty if they do):
    on a base whose file differs from the payload base's, the snapshot merged onto it, as the payload is.

    A snapshot is patch k's version by definition; this checks that ``patches/`` carries it.
    """
    where, manifest = f"torch {base.version}", project.manifest()
    files, payload_base = found.files(base), found.files(manifest.payload_base)
    problems = []
    for k, patch in enumerate(needed):
        if not patch.snapshots:
            continue
        try:
            tree = apply_series(files, patch_files[: k + 1], [f"--exclude={path}" for path in edited])
        except PatchApplyError as e:
            return [f"{where}: patches/{e.patch.name}: does not apply in order onto the pristine files: {e.stderr}"]
        for path in patch.snapshots:
            expected = snapshot_file(project.series_toml, patch, path).read_bytes()
            if files[path] != payload_base[path]:
                try:
                    expected = transplanted(expected, payload_base[path], files[path], path, base, manifest)
                except PatchError as e:
                    problems.append(f"{where}: {patch.name}'s snapshot: {e}")
                    continue
            if tree.get(path) != expected:
                snapshot = snapshot_file(project.series_toml, patch, path).relative_to(project.root)
                problems.append(f"{where}: {patch_files[k].name} does not give its snapshot {snapshot}")
    return problems


def code_problems(project: Project, found: Pristine, base: Base) -> list[str]:
    """The modules with a ``code_sha256`` whose pristine file of ``base`` has other code (not only comments)."""
    try:
        files = found.files(base)
    except BaseSourceError:
        return []  # base_problems says so
    problems = []
    manifest = project.manifest()
    for m in [m for m in manifest.modules if m.code_sha256 is not None and manifest.payload_version(m, base) is None]:
        try:
            digest = code_sha256(files[m.path])
        except (SyntaxError, tokenize.TokenError) as e:
            digest = f"none ({e!r})"
        if digest != m.code_sha256:
            problems.append(
                f"torch {base.version}: {m.path}: code sha256 {digest}, but manifest.json's code_sha256 for "
                f"{m.name} is {m.code_sha256}: every base's file must have that code (comments aside) for the one "
                "payload to serve it (docs/patches.md, 'Add a torch release')"
            )
    return problems


def check(project: Project, sources: list[Path] = ()) -> list[str]:
    """Every sync problem, one line each, naming the base and the file; empty when everything agrees."""
    try:
        found = pristine(project, list(sources))
        expected = generate(project, found)
    except (BaseSourceError, PatchError, SeriesError) as e:
        return [str(e)]
    problems = drift(project, expected) + requirement_problems(project) + transplant.problems(project, found)
    for base in project.manifest().bases:
        problems += base_problems(project, found, base) + code_problems(project, found, base)
    # NOTE: several patches may edit one upstream test file: their diffs must follow each other, and the last
    # one's new side is the rewritten file (where this repo keeps it).
    for path, chain in edits_by_file(upstream_edits(project, load_series(project.series_toml))).items():
        problems += chain_problems(project, chain)
        if project.repo_file(path).is_file():
            problems += new_side_problems(project, chain[-1], project.repo_file(path))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="a torch wheel or site-packages-like directory"
    )
    parser.add_argument("--root", type=Path, default=None, help="project root (default: this repo)")
    args = parser.parse_args(argv)
    project = Project(args.root) if args.root else default_project()
    problems = check(project, args.wheel)
    for problem in problems:
        print(f"sync check failed: {problem}", file=sys.stderr)
    if not problems:
        versions = ", ".join(project.manifest().versions)
        print(f"sync check passed: patches/ reproduces the overlay and its tests on every base ({versions})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
