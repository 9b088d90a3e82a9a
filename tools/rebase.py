"""Rebase the overlay onto another torch: a 3-way merge of our changes onto its versions of the files.

For each manifest file, ``git merge-file`` merges ours (the overlay) with theirs (the new upstream file) over
the pristine base. Each file is reported clean or conflicted. Only when every file is clean, a new project is
written to ``--out`` (never in place, so nothing is half-rebased): every file git tracks in this project,
with the merged overlay files, a manifest for the new base (version and sha256) and a regenerated
``patches/`` when the series' claims still split the merged changes. Review it, run its ``make check`` and
``make test``, then copy it over this repo.

``--out`` must not be the project, contain it, or lie inside it other than in a git-ignored directory (such
as ``build/``); an existing ``--out`` is replaced only when it is empty or a previous rebase's output (it
holds the marker file ``.torch-overlay-rebase``). The project is written to a temporary sibling first and
renamed into place.

    python -m tools.rebase --upstream NEW_TORCH_WHEEL_OR_SITE_PACKAGES_DIR --out build/rebase [--version X.Y.Z]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools.patches import PatchError, generate, write
from tools.pristine import BaseSourceError, pristine_base, read_files, read_paths
from tools.project import Project, default_project
from torch_overlay import _git
from torch_overlay._guard import public_version, read_torch_version
from torch_overlay._manifest import sha256_hex

MARKER = ".torch-overlay-rebase"
"""Written at the top of every rebase output: only such a directory (or an empty one) is ever replaced."""


class RebaseError(RuntimeError):
    """The rebased project cannot be written where asked; nothing was written or removed."""


@dataclass(frozen=True)
class MergeResult:
    path: str
    conflicts: int
    merged: bytes
    """The merge; with conflict markers when ``conflicts``."""


def merge(base: dict[str, bytes], ours: dict[str, bytes], theirs: dict[str, bytes]) -> list[MergeResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="torch-overlay-rebase-") as tmp:
        for path in base:
            files = []
            for label, content in [("ours", ours), ("base", base), ("theirs", theirs)]:
                f = Path(tmp) / label
                f.write_bytes(content[path])
                files.append(str(f))
            labels = ["-L", f"overlay/{path}", "-L", f"base/{path}", "-L", f"upstream/{path}"]
            proc = _git.run(Path(tmp), "merge-file", "-p", *labels, *files)
            if proc.returncode < 0 or proc.returncode > 127:
                raise RuntimeError(f"git merge-file failed on {path}: {proc.stderr.decode()}")
            results.append(MergeResult(path, proc.returncode, proc.stdout))
    return results


def upstream_version(source: Path) -> str | None:
    """The public version in ``torch/version.py`` of a wheel or a site-packages-like directory, or None."""
    if source.is_dir():
        version = read_torch_version(source / "torch")
    else:
        try:
            text = read_paths(source, ["torch/version.py"])["torch/version.py"]
        except BaseSourceError:
            return None
        with tempfile.TemporaryDirectory(prefix="torch-overlay-version-") as tmp:
            (Path(tmp) / "version.py").write_bytes(text)
            version = read_torch_version(Path(tmp))
    return public_version(version) if version else None


def check_out(project: Project, out: Path) -> None:
    """Refuse an ``out`` whose replacement could destroy anything but a previous rebase output."""
    root, target = project.root.resolve(), out.resolve()
    if target == root or target in root.parents:
        raise RebaseError(f"--out {out} is the project {root} or contains it; pass a directory outside it")
    if root in target.parents and _git.run(root, "check-ignore", "--quiet", str(target)).returncode != 0:
        raise RebaseError(
            f"--out {out} is inside the project {root} and not git-ignored; pass a directory outside it or under "
            "an ignored one such as build/"
        )
    if target.exists() and not (target.is_dir() and (not any(target.iterdir()) or (target / MARKER).is_file())):
        raise RebaseError(
            f"--out {out} exists and is not a previous rebase output (no {MARKER} in it); nothing was written. "
            "Remove it yourself or pass another --out."
        )


def tracked_files(project: Project) -> list[str]:
    """The project's files as git tracks them (their working-tree content is what gets copied)."""
    try:
        listing = _git.git(project.root, "ls-files", "-z")
    except _git.GitError as e:
        raise RebaseError(f"{project.root}: cannot list the tracked files (is it a git checkout?): {e}") from e
    return [p for p in listing.split("\0") if p and (project.root / p).is_file()]


def write_rebased(
    project: Project, out: Path, results: list[MergeResult], theirs: dict[str, bytes], version: str
) -> str:
    """Write the rebased project to ``out``; returns what happened to patches/. Raises RebaseError, writing nothing."""
    check_out(project, out)
    files = tracked_files(project)
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.rebase-", dir=out.resolve().parent))
    try:
        for path in files:
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project.root / path, tmp / path, follow_symlinks=False)
        (tmp / MARKER).write_text(f"written by python -m tools.rebase from {project.root}\n", encoding="utf-8")
        rebased = Project(tmp)
        manifest = json.loads(project.manifest_path.read_text(encoding="utf-8"))
        manifest["base"]["version"] = version
        for module in manifest["modules"]:
            module["base_sha256"] = sha256_hex(theirs[module["path"]])
        rebased.manifest_path.parent.mkdir(parents=True, exist_ok=True)
        rebased.manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        for r in results:
            rebased.overlay_file(r.path).parent.mkdir(parents=True, exist_ok=True)
            rebased.overlay_file(r.path).write_bytes(r.merged)
        try:
            names = write(rebased, generate(rebased, theirs))
            outcome = f"patches/ regenerated: {', '.join(names)}"
        except PatchError as e:
            outcome = f"patches/ NOT regenerated, fix series.toml claims first:\n{e}"
        _swap_into_place(tmp, out.resolve())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return outcome


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; a previous output there (checked by :func:`check_out`) goes away after."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.rebase", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="new torch wheel, or directory holding torch/")
    parser.add_argument("--out", type=Path, default=Path("build/rebase"), help="where the rebased project goes")
    parser.add_argument("--version", help="version of the new upstream (default: its torch/version.py)")
    parser.add_argument("--wheel", type=Path, help="the pristine base (default: installed torch)")
    parser.add_argument("--root", type=Path, default=None, help="project root (default: this repo)")
    args = parser.parse_args(argv)
    project = Project(args.root) if args.root else default_project()
    manifest = project.manifest()
    try:
        base = pristine_base(manifest, args.wheel)
        theirs = read_files(manifest, args.upstream)
    except BaseSourceError as e:
        print(f"rebase: {e}", file=sys.stderr)
        return 1
    version = args.version or upstream_version(args.upstream)
    if version is None:
        print(f"rebase: {args.upstream} has no torch/version.py; pass --version", file=sys.stderr)
        return 1
    results = merge(base, project.overlay_files(), theirs)
    for r in results:
        print(f"{r.path}: {'clean' if not r.conflicts else f'CONFLICT ({r.conflicts} conflicting hunks)'}")
    if any(r.conflicts for r in results):
        print(f"rebase: conflicts; nothing written. Resolve them by hand on torch {version}.", file=sys.stderr)
        return 1
    try:
        outcome = write_rebased(project, args.out, results, theirs, version)
    except RebaseError as e:
        print(f"rebase: {e}", file=sys.stderr)
        return 1
    print(f"rebase: torch {manifest.version} -> {version}, all files clean; written to {args.out}")
    print(outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
