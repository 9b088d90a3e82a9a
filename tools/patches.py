"""``make patches``: write ``patches/`` (a git format-patch series and its ``series`` file) from the overlay.

Inputs: the pristine files of the newest base (see :mod:`tools.pristine`), the overlay files,
``patches/series.toml`` and the tests it names. Each patch's state is committed in a scratch git repository
at a fixed date, by the author series.toml records once (its top-level ``author``), and ``git format-patch``
writes the series, so regenerating from the same inputs is byte-identical. ``patches/series`` lists the
upstream series (what the newest base needs); a base that also needs backports gets ``patches/series-<version>``.

    python -m tools.patches [--wheel TORCH_WHEEL_OR_DIR ...]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import re
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tools.pristine import BaseSourceError, Pristine, pristine
from tools.project import Project, default_project
from tools.series import Patch, SeriesError, edit_owner, file_states, load_author, load_series, load_snapshots
from tools.stack_rules import reversion_problems, split_patch
from torch_overlay import _git
from torch_overlay._patchset import SERIES_FILE

_UPSTREAM_BASE_RE = re.compile(r"^Upstream-Base: (\S+)\n")
_INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: [0-7]+)?$", re.MULTILINE)


class PatchError(RuntimeError):
    """The series cannot be generated, or does not reproduce the overlay; the message names the file."""


@dataclass(frozen=True)
class UpstreamEdit:
    """A patch's diff of an upstream test file, made against ``base`` (``pytorch/pytorch@<commit>``) as the
    series' earlier diffs of that file leave it."""

    path: str
    base: str
    diff: str
    file: Path
    """Where the diff is kept (:meth:`Project.upstream_edit_file`)."""

    def blobs(self) -> tuple[str, str] | None:
        """The (old, new) abbreviated blob ids of the diff's ``index`` line, or None without one."""
        match = _INDEX_RE.search(self.diff)
        return (match.group(1), match.group(2)) if match else None


def git(repo: Path, *args: str, input: str | None = None, identity: tuple[str, str] = _git.AUTHOR) -> str:
    """git in the scratch repository, isolated from the caller's environment and config (:mod:`_git`)."""
    try:
        return _git.git(repo, *args, input=input, identity=identity)
    except _git.GitError as e:
        raise PatchError(str(e)) from e


def read_upstream_edit(project: Project, patches: list[Patch], patch: Patch, path: str) -> UpstreamEdit:
    """``patch``'s diff of upstream test file ``path`` (one of its ``upstream_test_edits``)."""
    owner = edit_owner(patches, patch, path)
    file = project.upstream_edit_file(path, owner)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        scheme = (
            f"several patches edit {path}, so each has its own test/upstream_edits/{path}.<patch>.diff"
            if owner
            else f"one patch edits {path}, so its diff is test/upstream_edits/{path}.diff"
        )
        raise PatchError(
            f"{file}: patch {patch.name!r} lists {path} in upstream_test_edits, but this diff cannot be read "
            f"({e.strerror}).\n{scheme}: add it, or drop the path (docs/patches.md, 'Upstream test edits')"
        ) from e
    match = _UPSTREAM_BASE_RE.match(text)
    diff = text[match.end() :] if match else ""
    if not match or not diff.startswith(f"diff --git a/{path} b/{path}\n"):
        raise PatchError(
            f"{file}: expected a first line 'Upstream-Base: pytorch/pytorch@<commit>' and then "
            f"'diff --git a/{path} b/{path}' (see docs/patches.md, 'Upstream test edits')"
        )
    return UpstreamEdit(path, match.group(1), diff, file)


def upstream_edits(project: Project, patches: list[Patch]) -> list[list[UpstreamEdit]]:
    """Each patch's diffs of upstream test files, in series order."""
    return [[read_upstream_edit(project, patches, p, path) for path in p.upstream_test_edits] for p in patches]


def edits_by_file(edits: list[list[UpstreamEdit]]) -> dict[str, list[UpstreamEdit]]:
    """Each edited upstream test file -> its diffs, in series order."""
    out: dict[str, list[UpstreamEdit]] = {}
    for edit in [e for patch_edits in edits for e in patch_edits]:
        out.setdefault(edit.path, []).append(edit)
    return out


def chain_problems(project: Project, chain: list[UpstreamEdit]) -> list[str]:
    """Where the diffs of one upstream test file do not follow each other: each must be made against the same
    upstream commit and, after the first, against the previous one's new side (empty when they do)."""
    problems = []
    for before, after in itertools.pairwise(chain):
        where = after.file.relative_to(project.root)
        earlier = before.file.relative_to(project.root)
        if after.base != before.base:
            problems.append(f"{where}: Upstream-Base {after.base}, but {earlier} has {before.base}; make them equal")
        old, new = (after.blobs() or ("?", ""))[0], (before.blobs() or ("", "?"))[1]
        if not (old.startswith(new) or new.startswith(old)):
            problems.append(
                f"{where}: its old side (blob {old}) is not the new side (blob {new}) of {earlier}; make it with "
                "`git diff` from the file as the earlier diff leaves it (docs/patches.md, 'Upstream test edits')"
            )
    return problems


def blob_id(content: bytes) -> str:
    """What ``git hash-object`` prints for a file holding ``content`` (a SHA-1 repository)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def new_side_problems(project: Project, edit: UpstreamEdit, local: Path) -> list[str]:
    """Where the diff's new side is not the rewritten file kept at ``local``, exactly (empty when it is).

    The diff's ``index a..b`` line names the new side's blob; ``local`` must hash to it.
    """
    where = edit.file.relative_to(project.root)
    blobs = edit.blobs()
    if blobs is None:
        return [
            f"{where}: no 'index <old>..<new>' line; regenerate it with `git diff` "
            "(docs/patches.md, 'Upstream test edits')"
        ]
    found, new = blob_id(local.read_bytes()), blobs[1]
    if found.startswith(new):
        return []
    local_path = local.relative_to(project.root)
    return [f"{local_path}: git hash-object {found} is not the new blob {new} of {where}; make them equal"]


def commit_message(patch: Patch) -> str:
    """The commit message: title, Summary, Test Plan, ``Fixes`` lines and ``Related`` issues (each with its line
    of what the patch adds), as PyTorch PRs have them."""
    parts = [patch.title, "Summary:\n" + patch.summary]
    if patch.fixed_upstream_in is not None:
        parts.append(
            textwrap.fill(
                f"Backport only: torch {patch.fixed_upstream_in} fixed this upstream, so this patch is for the "
                f"releases before it and is not part of the upstream series (patches/series).",
                width=72,
            )
        )
    parts.append("Test Plan:\n" + patch.test_plan)
    if patch.fixes:
        parts.append("\n".join(f"Fixes #{n}" for n in patch.fixes))
    parts += [f"Related: #{n}\n{adds}" for n, adds in patch.related]
    return "\n\n".join(parts) + "\n"


def edit_notes(edits: list[UpstreamEdit], version: str) -> str:
    """Where the upstream test edits come from, for whoever applies the patch file.

    NOTE: written below the ``---`` line, where ``git am`` and ``git apply`` ignore text: it is not part of
    the commit message, so it never reaches the PR that ``ghstack`` makes of the commit.
    """
    if not edits:
        return ""
    first, *others = edits
    clauses = [f"the changes to {first.path} were made against {first.base}"]
    clauses += [f"those to {edit.path} against {edit.base}" for edit in others]
    clauses.append(f"and the rest of this patch against torch {version}'s files")
    note = (
        f"Note: {', '.join(clauses)}; each index line names its upstream blob, so `git am -3` applies the patch "
        "on another commit."
    )
    return "---\n" + textwrap.fill(note, width=72, break_on_hyphens=False, break_long_words=False) + "\n\n"


def _splice(patch_text: str, edits: list[UpstreamEdit], version: str) -> str:
    """Add the upstream test edits to a format-patch text, keeping the file sections sorted by path, and their
    notes (:func:`edit_notes`) between the message and the diff."""
    if not edits:
        return patch_text
    head, sep, diff = patch_text.partition("\ndiff --git ")
    head = head + "\n" + edit_notes(edits, version).rstrip("\n") + "\n"
    sections = [("diff --git " + s) for s in diff.split("\ndiff --git ")] if sep else []
    sections = [s if s.endswith("\n") else s + "\n" for s in sections]
    sections += [e.diff if e.diff.endswith("\n") else e.diff + "\n" for e in edits]
    sections.sort(key=lambda s: s.split("\n", 1)[0].split(" b/", 1)[1])
    return head + "\n" + "".join(sections)


def series_indexes(manifest_versions: tuple[str, ...], patches: list[Patch], names: list[str]) -> dict[str, bytes]:
    """``series`` (the newest base's: the upstream series) and ``series-<version>`` where a base needs more."""

    def index(version: str) -> bytes:
        return "".join(n + "\n" for n, p in zip(names, patches, strict=True) if p.needed_on(version)).encode()

    newest = index(manifest_versions[-1])
    out = {SERIES_FILE: newest}
    for version in manifest_versions[:-1]:
        if index(version) != newest:
            out[f"{SERIES_FILE}-{version}"] = index(version)
    return out


def generate(project: Project, found: Pristine) -> dict[str, bytes]:
    """The contents of ``patches/`` (except series.toml), by file name."""
    manifest = project.manifest()
    base = found.files(manifest.payload_base)
    try:
        patches = load_series(project.series_toml)
        author = load_author(project.series_toml)
        unneeded = [p.name for p in patches if not p.needed_on(manifest.bases[0].version)]
        if unneeded:
            raise SeriesError(
                f"{project.series_toml}: {', '.join(unneeded)}: fixed upstream at or before the oldest base, "
                f"torch {manifest.bases[0].version}; no base needs it, drop it from the series"
            )
        snapshots = load_snapshots(project.series_toml, patches)
        states = file_states(patches, base, project.overlay_files(), snapshots)
    except SeriesError as e:
        raise PatchError(str(e)) from e
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="torch-overlay-patches-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        git(repo, "init", "--quiet", "-b", "base")
        _write(repo, base)
        git(repo, "add", "--all")
        git(repo, "commit", "--quiet", "-m", f"{manifest.package} {manifest.payload_base.version}")
        git(repo, "tag", "pristine")
        all_edits = upstream_edits(project, patches)
        upstream = "HEAD"  # the last commit of the upstream series; the backports come after it
        for patch, state in zip(patches, states, strict=True):
            if patch.fixed_upstream_in is not None and upstream == "HEAD":
                git(repo, "tag", "upstream")
                upstream = "upstream"
            tests = {}
            for test in patch.tests:
                try:
                    tests[test] = project.repo_file(test).read_bytes()
                except OSError as e:
                    raise PatchError(f"{project.series_toml}: patch {patch.name!r}: test {test}: {e.strerror}") from e
            _write(repo, state | tests)
            git(repo, "add", "--all")
            message = commit_message(patch)
            commit = ["commit", "--quiet", "--allow-empty", "--cleanup=verbatim", "-F", "-"]
            git(repo, *commit, input=message, identity=author)
        names = [f"{k:04d}-{p.name}.patch" for k, p in enumerate(patches, 1)]
        # NOTE: subjects count the upstream series ([PATCH k/n], n its length, as reviewers see the stack); the
        # backports, which are not part of it, are numbered apart: [PATCH backport k/m].
        written = _format_patch(repo, Path(tmp) / "formatted", f"pristine..{upstream}", "PATCH")
        if upstream != "HEAD":
            written += _format_patch(repo, Path(tmp) / "backports", "upstream..HEAD", "PATCH backport")
        assert len(written) == len(names), f"git format-patch wrote {len(written)} patches for {len(names)}"
        for name, file, edits in zip(names, written, all_edits, strict=True):
            out[name] = _splice(file.read_text(encoding="utf-8"), edits, manifest.payload_base.version).encode("utf-8")
        # NOTE: where the diffs of an upstream test file do not follow each other, their line numbers say nothing
        # of each other's lines: the sync check reports that file (chain_problems) instead.
        unchained = {path for path, chain in edits_by_file(all_edits).items() if chain_problems(project, chain)}
        messages, diffs = [commit_message(p) for p in patches], [split_patch(out[n].decode())[1] for n in names]
        problems = reversion_problems(names, patches, messages, diffs, unchained)
        if problems:
            raise PatchError("a patch undoes another's change:\n  - " + "\n  - ".join(problems))
        out.update(series_indexes(manifest.versions, patches, names))
    return out


def _format_patch(repo: Path, dest: Path, commits: str, prefix: str) -> list[Path]:
    """``git format-patch`` of ``commits`` into ``dest``, numbered among themselves: the files in order."""
    git(
        repo, "format-patch", "--quiet", "--numbered", "--zero-commit", "--no-signature", "--full-index",
        "--no-stat", "--always", f"--subject-prefix={prefix}", "-o", str(dest), commits,
    )  # fmt: skip
    return sorted(dest.iterdir())


def _write(repo: Path, files: dict[str, bytes]) -> None:
    for path, content in files.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


def generated_files(patches_dir: Path) -> list[Path]:
    indexes = sorted(patches_dir.glob(f"{SERIES_FILE}-*"))
    return sorted(patches_dir.glob("[0-9][0-9][0-9][0-9]-*.patch")) + [patches_dir / SERIES_FILE] + indexes


def write(project: Project, files: dict[str, bytes]) -> list[str]:
    """Replace the generated files of ``patches/``; returns the names written."""
    for stale in generated_files(project.patches_dir):
        if stale.name not in files:
            stale.unlink(missing_ok=True)
    for name, content in files.items():
        (project.patches_dir / name).write_bytes(content)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.patches", description="Write patches/ from the overlay.")
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="a torch wheel or site-packages-like directory"
    )
    parser.add_argument("--root", type=Path, default=None, help="project root (default: this repo)")
    args = parser.parse_args(argv)
    project = Project(args.root) if args.root else default_project()
    try:
        files = generate(project, pristine(project, args.wheel))
    except (BaseSourceError, PatchError, SeriesError) as e:
        print(f"make patches: {e}", file=sys.stderr)
        return 1
    for name in write(project, files):
        print(f"patches/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
