"""Rebase the overlay onto another torch: a 3-way merge of our changes onto its versions of the files.

For each manifest file, ``git merge-file`` merges ours (the overlay) with theirs (the new upstream file) over
the pristine base. Each file is reported clean or conflicted. Only when every file is clean, a new project is
written to ``--out`` (never in place, so nothing is half-rebased): the merged overlay files, a manifest for
the new base (version and sha256), series.toml and the tests, and a regenerated ``patches/`` when the
series' claims still split the merged changes. Review it, then copy it over this repo.

    python -m tools.rebase --upstream NEW_TORCH_WHEEL_OR_SITE_PACKAGES_DIR --out build/rebase [--version X.Y.Z]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tools.patches import PatchError, generate, write
from tools.pristine import BaseSourceError, pristine_base, read_files
from tools.project import Project, default_project
from tools.series import load_series
from torch_overlay._guard import _VERSION_RE, public_version


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
            proc = subprocess.run(["git", "merge-file", "-p", *labels, *files], capture_output=True)
            if proc.returncode < 0 or proc.returncode > 127:
                raise RuntimeError(f"git merge-file failed on {path}: {proc.stderr.decode()}")
            results.append(MergeResult(path, proc.returncode, proc.stdout))
    return results


def upstream_version(source: Path) -> str | None:
    try:
        if source.is_file():
            with zipfile.ZipFile(source) as wheel:
                text = wheel.read("torch/version.py").decode("utf-8")
        else:
            text = (source / "torch" / "version.py").read_text(encoding="utf-8")
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    match = _VERSION_RE.search(text)
    return public_version(match.group(1)) if match else None


def write_rebased(
    project: Project, out: Path, results: list[MergeResult], theirs: dict[str, bytes], version: str
) -> str:
    """Write the rebased project to ``out``; returns what happened to patches/."""
    if out.exists():
        shutil.rmtree(out)
    rebased = Project(out)
    manifest = json.loads(project.manifest_path.read_text(encoding="utf-8"))
    manifest["base"]["version"] = version
    for module in manifest["modules"]:
        module["base_sha256"] = hashlib.sha256(theirs[module["path"]]).hexdigest()
    rebased.manifest_path.parent.mkdir(parents=True)
    rebased.manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    for r in results:
        rebased.overlay_file(r.path).parent.mkdir(parents=True, exist_ok=True)
        rebased.overlay_file(r.path).write_bytes(r.merged)
    rebased.patches_dir.mkdir()
    shutil.copy2(project.series_toml, rebased.series_toml)
    for patch in load_series(project.series_toml):
        for path in [
            *patch.tests,
            *(str(project.upstream_edit_file(p).relative_to(project.root)) for p in patch.upstream_test_edits),
        ]:
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project.root / path, out / path)
    try:
        names = write(rebased, generate(rebased, theirs))
    except PatchError as e:
        return f"patches/ NOT regenerated, fix series.toml claims first:\n{e}"
    return f"patches/ regenerated: {', '.join(names)}"


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
    print(f"rebase: torch {manifest.version} -> {version}, all files clean; written to {args.out}")
    print(write_rebased(project, args.out, results, theirs, version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
