"""``make rebase UPSTREAM=<wheel|dir>``: add a torch release as a base of the overlay, in place.

For each manifest file, ``git merge-file`` merges ours (the overlay) with theirs (the release's file) over the
payload base's pristine file; for a release older than the payload's base, the series it would get is also applied
to its file with ``git apply``, as the sync check applies it. Each file is reported clean, conflicted, or not
applying (a patch's context lines changed upstream, though the merge is clean). Either way, the fix goes into
the payload (``torch_overlay/torch``: our change moved off the lines the release has otherwise), never into
``build/``. Then:

- the release ships a file that the overlay adds as a new module (a private helper no base has): it is
  refused, naming the file, and nothing changes (the overlay would shadow upstream's module with its own);
- a conflict, or a patch that does not apply: the merges, conflict markers included, are written to
  ``build/rebase-<version>/`` for reading (the tool never reads them back) and nothing in the project changes;
- otherwise the release joins ``manifest.json`` (its files' sha256), a newer release's files become the
  payload (the merge), and each
  runtime file (one the overlay serves at run time) gets what serves every base: where a base's file differs
  from the newest's in comments only, the code digest they share (``code_sha256``), and where it differs in
  code, a payload of its own (``base_payloads``, written by :mod:`tools.transplant`). ``patches/`` is
  regenerated and the sync check runs on every base. If the check fails, every file is put back as it was.

    python -m tools.rebase --upstream NEW_TORCH_WHEEL_OR_SITE_PACKAGES_DIR [--version X.Y.Z]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

from tools import transplant
from tools.check import check
from tools.patches import PatchError, generate, generated_files, write
from tools.pristine import BaseSourceError, pristine, read_paths
from tools.project import Project, default_project
from tools.series import load_series, series_for
from torch_overlay import _git
from torch_overlay._atomic import write_atomically
from torch_overlay._guard import read_torch_version
from torch_overlay._manifest import code_sha256, load_manifest, public_version, sha256_hex, version_key
from torch_overlay._patchset import PatchApplyError, apply_series


class RebaseError(RuntimeError):
    """The release cannot be added; nothing in the project was changed."""


@dataclass(frozen=True)
class MergeResult:
    path: str
    conflicts: int
    merged: bytes
    """The merge; with conflict markers when ``conflicts``."""
    not_applying: str = ""
    """Why the release's series does not ``git apply`` to its file (empty: it applies), as the sync check says."""

    def report(self) -> str:
        if self.conflicts:
            return f"CONFLICT ({self.conflicts} conflicting hunks)"
        if self.not_applying:
            return f"merges cleanly, but {self.not_applying}"
        return "clean"


def merge(base: dict[str, bytes], ours: dict[str, bytes], theirs: dict[str, bytes], version: str) -> list[MergeResult]:
    results = []
    for path in base:
        labels = (f"overlay/{path}", f"base/{path}", f"torch-{version}/{path}")
        conflicts, merged = _git.merge_file(ours[path], base[path], theirs[path], labels)
        results.append(MergeResult(path, conflicts, merged))
    return results


def apply_problems(project: Project, theirs: dict[str, bytes], version: str) -> dict[str, str]:
    """Path -> why the series a base of ``version`` would get (patches/, backports included where it needs them)
    does not ``git apply`` in order to the release's file, the first patch that fails named; as the sync check
    applies it. A clean 3-way merge does not imply it: a patch needs its context lines as they are."""
    patches = load_series(project.series_toml)
    files = {p.name: project.patches_dir / f"{k:04d}-{p.name}.patch" for k, p in enumerate(patches, 1)}
    needed = [files[p.name] for p in series_for(patches, version) if files[p.name].is_file()]
    problems = {}
    for path, content in theirs.items():
        try:
            apply_series({path: content}, needed, [f"--include={path}"])
        except PatchApplyError as e:
            at = re.search(rf"patch failed: {re.escape(path)}:(\d+)", e.stderr)
            problems[path] = f"patches/{e.patch.name} does not apply" + (f" (its hunk at line {at[1]})" if at else "")
    return problems


def _ships(source: Path, path: str) -> bool:
    """Whether a wheel or a site-packages-like directory holds ``path``."""
    try:
        read_paths(source, [path])
    except BaseSourceError:
        return False
    return True


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


def review_dir(project: Project, version: str) -> Path:
    """Where merges that cannot be added go for review (under the ignored ``build/``)."""
    return project.root / "build" / f"rebase-{version}"


def write_for_review(project: Project, version: str, results: list[MergeResult]) -> Path:
    out = review_dir(project, version)
    for r in results:
        (out / r.path).parent.mkdir(parents=True, exist_ok=True)
        (out / r.path).write_bytes(r.merged)
    return out


@dataclass(frozen=True)
class Payloads:
    """How a runtime module's payloads serve every base (see ``OverlayModule`` in ``torch_overlay._manifest``)."""

    code_sha256: str | None
    """The newest base's code digest, where another base's file differs from its file in comments only."""
    base_payloads: tuple[str, ...]
    """The bases whose file differs in code: one per distinct file, by the oldest base that ships it."""


def plan_payloads(files: dict[str, dict[str, bytes]], path: str) -> Payloads:
    """What serves runtime file ``path`` on every base, given each base's files (version -> path -> content)."""
    versions = sorted(files, key=version_key)
    newest = files[versions[-1]][path]
    comments_only, own = False, {}
    for version in versions[:-1]:
        content = files[version][path]
        if content == newest:
            continue
        digest = _code_digest(content)
        if digest is not None and digest == _code_digest(newest):
            comments_only = True
        else:
            own.setdefault(sha256_hex(content), version)
    return Payloads(_code_digest(newest) if comments_only else None, tuple(own.values()))


def _code_digest(content: bytes) -> str | None:
    """:func:`code_sha256`, or None for a file that does not tokenize (taken as a code change)."""
    try:
        return code_sha256(content)
    except (SyntaxError, tokenize.TokenError):
        return None


def new_manifest_text(project: Project, version: str, theirs: dict[str, bytes], plans: dict[str, Payloads]) -> bytes:
    """manifest.json with the release added, laid out as ever (re-adding a base gives it back byte for byte).

    Each runtime module gets its ``code_sha256`` and ``base_payloads`` from ``plans`` (path -> payloads): kept in
    place where it has them, added as its last fields where it gains them, dropped where it needs them no more.
    """
    raw = json.loads(project.manifest_path.read_text(encoding="utf-8"))
    sha256 = {m.path: sha256_hex(theirs[m.path]) if m.path in theirs else None for m in project.manifest().modules}
    raw["bases"].append({"version": version, "sha256": sha256})
    raw["bases"].sort(key=lambda b: version_key(b["version"]))
    for module in raw["modules"]:
        plan = plans.get(module["path"])
        if plan is None:
            continue
        for key, value in (("code_sha256", plan.code_sha256), ("base_payloads", list(plan.base_payloads))):
            if value:
                module[key] = value
            else:
                module.pop(key, None)
    return (json.dumps(raw, indent=2) + "\n").encode("utf-8")


def add_base(
    project: Project, upstream: Path, version: str, results: list[MergeResult], sources: list[Path]
) -> list[str]:
    """Write the new base into the project; on any failure (the sync check included) put every file back.

    Returns the sync check's problems (empty: added).
    """
    manifest = project.manifest()
    theirs = read_paths(upstream, [m.path for m in manifest.modules if not m.new])
    becomes_newest = version_key(version) > version_key(manifest.payload_base.version)
    touched = [project.manifest_path, *generated_files(project.patches_dir)]
    touched += [project.overlay_file(m.path) for m in manifest.modules if not m.new]
    touched += [p for p in project.bases_dir.rglob("*") if p.is_file()]
    saved = {path: path.read_bytes() for path in touched if path.is_file()}
    try:
        found = pristine(project, [upstream, *sources])
        files = {b.version: found.files(b) for b in manifest.bases} | {version: theirs}
        plans = {m.path: plan_payloads(files, m.path) for m in manifest.runtime_modules if not m.new}
        write_atomically(project.manifest_path, new_manifest_text(project, version, theirs, plans))
        if becomes_newest:  # the payload is the newest base's files plus our change
            for r in results:
                write_atomically(project.overlay_file(r.path), r.merged)
        found = pristine(project, [upstream, *sources])
        transplant.write(project, transplant.transplants(project, found))
        write(project, generate(project, found))
        problems = check(project, [upstream, *sources])
    except (PatchError, BaseSourceError, transplant.TransplantError, OSError) as e:
        problems = [str(e)]
    except BaseException:
        _restore(project, saved)
        raise
    if problems:
        _restore(project, saved)
    return problems


def _restore(project: Project, saved: dict[Path, bytes]) -> None:
    for stale in [*generated_files(project.patches_dir), *project.bases_dir.rglob("*")]:
        if stale.is_file() and stale not in saved:
            stale.unlink()
    for path, content in saved.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, content)


def rebase(project: Project, upstream: Path, version: str | None = None, sources: list[Path] = ()) -> int:
    """Add the release at ``upstream``; prints what happened, returns an exit code (0 added or already there).

    ``sources``: extra places holding the pristine files of the project's bases (:mod:`tools.pristine`).
    """
    manifest = project.manifest()
    version = version or upstream_version(upstream)
    if version is None:
        raise RebaseError(f"{upstream} has no torch/version.py; pass --version")
    shipped = [m.path for m in manifest.new_modules if _ships(upstream, m.path)]
    if shipped:
        raise RebaseError(
            f"torch {version} ships {', '.join(shipped)}, which the overlay adds as a new module (no base has it): "
            "serving ours would shadow upstream's. Port our change onto upstream's module (make it a replaced "
            "module in manifest.json and series.toml) or drop ours; nothing changed"
        )
    theirs = read_paths(upstream, [m.path for m in manifest.modules if not m.new])
    listed = manifest.base(version)
    if listed is not None:
        if all(sha256_hex(theirs[p]) == h for p, h in listed.upstream.items()):
            print(f"rebase: torch {version} is already a base, with these files; nothing changed")
            return 0
        raise RebaseError(
            f"torch {version} is already a base, but {upstream}'s files differ from the ones manifest.json records "
            "for it (edited, or another build); nothing changed"
        )
    found = pristine(project, [upstream, *sources])
    base = found.files(manifest.payload_base)
    results = merge(base, project.overlay_files(), theirs, version)
    # An older release gets the series as it is (a newer one, the series regenerated on its files: the sync
    # check then applies that to every other base).
    older = version_key(version) < version_key(manifest.payload_base.version)
    not_applying = apply_problems(project, theirs, version) if older else {}
    results = [MergeResult(r.path, r.conflicts, r.merged, not_applying.get(r.path, "")) for r in results]
    for r in results:
        print(f"{r.path}: {r.report()}")
    failed = [r.path for r in results if r.conflicts or r.not_applying]
    if failed:
        out = write_for_review(project, version, results).relative_to(project.root)
        print(
            f"rebase: nothing changed. Fix the payload, not {out} (the merges there are for reading only):",
            file=sys.stderr,
        )
        for path in failed:
            print(
                f"  torch_overlay/{path}: move our change off the lines torch {version} has otherwise", file=sys.stderr
            )
        print(
            "  (CONFLICT: lines it changed next to ours; does not apply: a patch's context lines), then\n"
            "  `make patches`, `make check` and `make rebase` again (docs/patches.md, 'Add a torch release')",
            file=sys.stderr,
        )
        return 1
    for m in manifest.runtime_modules:
        if m.new or theirs[m.path] == base[m.path]:
            continue
        digest = _code_digest(theirs[m.path])
        if digest is not None and digest == _code_digest(base[m.path]):
            print(f"{m.path}: changed upstream in comments only; the one payload serves it (code_sha256 {digest})")
        else:
            print(
                f"{m.path}: changed upstream in code; each base with another file of it than the newest base's gets "
                "its own payload (torch_overlay/bases/<version>/..., our change transplanted)"
            )
    problems = add_base(project, upstream, version, results, list(sources))
    for problem in problems:
        print(f"rebase: sync check failed: {problem}", file=sys.stderr)
    if problems:
        print(f"rebase: torch {version} was not added; every file was put back as it was", file=sys.stderr)
        return 1
    versions = ", ".join(load_manifest(project.manifest_path).versions)
    print(f"rebase: torch {version} added; the bases are now {versions}; patches/ regenerated; sync check passed")
    print(
        f"Next: `make install TORCH={version} && make test TORCH={version}` (the stock stage tells which fixes "
        "upstream made), then the README's table of releases."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.rebase", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="the release's wheel, or a dir holding torch/")
    parser.add_argument("--version", help="its version (default: its torch/version.py)")
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="a source of the bases' pristine files (repeatable)"
    )
    parser.add_argument("--root", type=Path, default=None, help="project root (default: this repo)")
    args = parser.parse_args(argv)
    project = Project(args.root) if args.root else default_project()
    try:
        if not args.upstream.exists():
            raise RebaseError(f"{args.upstream}: no such wheel or directory (UPSTREAM=)")
        return rebase(project, args.upstream, args.version, args.wheel)
    except (RebaseError, BaseSourceError) as e:
        print(f"rebase: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
