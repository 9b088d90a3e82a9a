"""``patches/series.toml``: the upstream series, and how the overlay's changes split into its patches.

Each overlay file is diffed against its pristine base with zero context (difflib opcodes); every changed
block must be claimed by exactly one patch. Patch k's version of a file it owns blocks of is the base plus the
blocks of patches 1..k, so applying the series in order rebuilds the overlay exactly; a patch that owns no
block of a file leaves it as the patches before it left it.

A patch may instead give its version of a file explicitly (``snapshots``, kept at
``patches/snapshots/<patch>/<path>``): for a change that a later patch extends inside the same lines, so that
no block split can cut it (e.g. parameters first, then gradients in the same functions). That patch claims no
blocks of the file; the file stays the snapshot until a patch that owns blocks of it (or gives another
snapshot) changes it, and that patch's diff goes from the snapshot to its own version.

A patch whose bug upstream fixed in a later release (``fixed_upstream_in = "X.Y.Z"``) is a backport: it is in
the series of the bases older than X.Y.Z only, not in the upstream series. Backports come after every other
patch, so that each base's series is a prefix of the whole and applies without them.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from torch_overlay._manifest import version_key

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_AUTHOR_RE = re.compile(r"^([^<>]*[^<>\s])\s+<([^<>\s]+@[^<>\s]+)>$")


class SeriesError(ValueError):
    """series.toml is malformed, or its claims do not split the overlay's changes into its patches."""


@dataclass(frozen=True)
class Claim:
    file: str
    match: re.Pattern[str]


@dataclass(frozen=True)
class Patch:
    name: str
    title: str
    summary: str
    test_plan: str
    fixes: tuple[int, ...]
    claims: tuple[Claim, ...]
    tests: tuple[str, ...]
    """New test files the patch adds whole (PyTorch checkout paths)."""
    upstream_test_edits: tuple[str, ...]
    """Upstream test files the patch edits; each diff lives at ``test/upstream_edits/<path>.diff``, or at
    ``<path>.<name>.diff`` where several patches edit the file (:func:`edit_owner`)."""
    fixed_upstream_in: str | None = None
    """The torch release that fixed the bug upstream: from it on the patch is not needed (a backport)."""
    snapshots: tuple[str, ...] = ()
    """Manifest files whose version after this patch is given whole, by :func:`snapshot_file`."""
    related: tuple[tuple[int, str], ...] = ()
    """Closed upstream issues the patch answers, each with one line saying what the patch adds (``Related: #N``,
    since ``Fixes #N`` would claim an issue that is already closed)."""

    def needed_on(self, version: str) -> bool:
        """Whether a base of this version needs the patch (it still has the bug)."""
        return self.fixed_upstream_in is None or version_key(version) < version_key(self.fixed_upstream_in)

    @property
    def test_files(self) -> tuple[str, ...]:
        """Every test file the patch carries, new or edited."""
        return self.tests + self.upstream_test_edits


@dataclass(frozen=True)
class Block:
    """One changed block of an overlay file against its base (a difflib opcode that is not 'equal')."""

    file: str
    base_start: int
    base_end: int
    new_lines: tuple[str, ...]
    old_lines: tuple[str, ...]

    @property
    def text(self) -> str:
        """The lines a claim is matched against: the new side, or the old side of a pure deletion."""
        return "".join(self.new_lines or self.old_lines)

    def where(self) -> str:
        first = (self.new_lines or self.old_lines or ("",))[0].strip()
        return f"{self.file}:{self.base_start + 1}: {first!r}"


def load_series(path: Path) -> list[Patch]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SeriesError(f"{path}: cannot read the series ({e})") from e
    patches = []
    for number, entry in enumerate(raw.get("patch", []), 1):
        where = f"{path}: [[patch]] #{number}"
        try:
            name = entry["name"]
            if not _NAME_RE.match(name):
                raise SeriesError(f"{where}: name {name!r} must be lowercase letters, digits and dashes")
            claims = tuple(Claim(c["file"], re.compile(c["match"])) for c in entry.get("claims", []))
            patches.append(
                Patch(
                    name=name,
                    title=entry["title"].strip(),
                    summary=entry["summary"].strip(),
                    test_plan=entry["test_plan"].strip(),
                    fixes=tuple(int(n) for n in entry.get("fixes", [])),
                    claims=claims,
                    tests=tuple(entry.get("tests", [])),
                    upstream_test_edits=tuple(entry.get("upstream_test_edits", [])),
                    fixed_upstream_in=entry.get("fixed_upstream_in"),
                    snapshots=tuple(entry.get("snapshots", [])),
                    related=tuple(_related(where, r) for r in entry.get("related", [])),
                )
            )
            claimed = {c.file for c in claims} & set(patches[-1].snapshots)
            if claimed:
                raise SeriesError(
                    f"{where}: {name} gives {', '.join(sorted(claimed))} as a snapshot and also claims blocks of "
                    "it; a snapshot is the patch's whole version of the file: drop those claims"
                )
        except KeyError as e:
            raise SeriesError(f"{where}: missing key {e}") from e
        except re.error as e:
            raise SeriesError(f"{where}: bad claim regex: {e}") from e
    if not patches:
        raise SeriesError(f"{path}: no [[patch]] entries")
    names = [p.name for p in patches]
    if len(set(names)) != len(names):
        raise SeriesError(f"{path}: duplicate patch names in {names}")
    backports = [k for k, p in enumerate(patches) if p.fixed_upstream_in is not None]
    if backports and backports != list(range(len(patches) - len(backports), len(patches))):
        raise SeriesError(
            f"{path}: the backports ({', '.join(patches[k].name for k in backports)}, fixed upstream) must come "
            "after every other patch, so that the upstream series applies without them; move them to the end"
        )
    return patches


def _related(where: str, entry: object) -> tuple[int, str]:
    """One ``related = [{ issue = N, adds = "..." }]`` entry: a closed issue and one line of what the patch adds."""
    issue = entry.get("issue") if isinstance(entry, dict) else None
    adds = entry.get("adds") if isinstance(entry, dict) else None
    if not isinstance(issue, int) or not isinstance(adds, str) or not adds.strip() or "\n" in adds.strip():
        raise SeriesError(f'{where}: related entries are {{ issue = N, adds = "one line: what the patch adds" }}')
    return issue, adds.strip()


def load_author(path: Path) -> tuple[str, str]:
    """The (name, email) of series.toml's top-level ``author``: the ``From:`` of every generated patch.

    Fixed so that regenerating the series is byte-identical; this repository's git identity, which names the
    project, not a person (it signs no CLA). ``make ghstack`` commits with the identity of the user who runs
    it, whose CLA covers the PRs.
    """
    try:
        author = tomllib.loads(path.read_text(encoding="utf-8")).get("author")
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SeriesError(f"{path}: cannot read the series ({e})") from e
    match = _AUTHOR_RE.match(author.strip()) if isinstance(author, str) else None
    if match is None:
        raise SeriesError(
            f'{path}: the top-level author = "Name <email>" (the From: of the generated patches) is missing or '
            f"malformed ({author!r}).\nSet it once, from `git config user.name` and `git config user.email`."
        )
    return match.group(1), match.group(2)


def snapshot_file(series_toml: Path, patch: Patch, path: str) -> Path:
    """Where ``patch``'s version of manifest file ``path`` is kept: ``patches/snapshots/<patch>/<path>``."""
    return series_toml.parent / "snapshots" / patch.name / path


def load_snapshots(series_toml: Path, patches: list[Patch]) -> dict[tuple[str, str], bytes]:
    """Every snapshot of the series, by (patch name, manifest path)."""
    out = {}
    for patch in patches:
        for path in patch.snapshots:
            file = snapshot_file(series_toml, patch, path)
            try:
                out[patch.name, path] = file.read_bytes()
            except OSError as e:
                raise SeriesError(
                    f"{file}: patch {patch.name!r} lists {path} in snapshots, but it cannot be read ({e.strerror}); "
                    "add the file as that patch leaves it, or drop it from snapshots (docs/patches.md, 'Snapshots')"
                ) from e
    return out


def edit_owner(patches: list[Patch], patch: Patch, path: str) -> str | None:
    """The ``<patch>`` of ``patch``'s diff of upstream test file ``path`` (``<path>.<patch>.diff``), or None
    where no other patch edits the file (``<path>.diff``).

    NOTE: several patches may edit one upstream test file, each with its own diff, applied in series order: a
    later patch's diff is made against the file as the earlier ones leave it (its old side is their new side).
    """
    return patch.name if sum(path in p.upstream_test_edits for p in patches) > 1 else None


def series_for(patches: list[Patch], version: str) -> list[Patch]:
    """The patches a base of this version needs, in order (a prefix of the whole series)."""
    return [p for p in patches if p.needed_on(version)]


def changed_blocks(path: str, base: bytes, overlay: bytes) -> list[Block]:
    a = base.decode("utf-8").splitlines(keepends=True)
    b = overlay.decode("utf-8").splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [
        Block(path, i1, i2, tuple(b[j1:j2]), tuple(a[i1:i2]))
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    ]


def assign_blocks(patches: list[Patch], base: dict[str, bytes], overlay: dict[str, bytes]) -> dict[Block, int]:
    """Which patch (index into ``patches``) owns each changed block; raises naming every problem.

    ``base`` lacks the new modules (no release ships them): each of their files is one block, added whole.
    """
    owner: dict[Block, int] = {}
    problems = []
    used: set[tuple[int, int]] = set()
    known = set(overlay)
    for patch in patches:
        for claim in patch.claims:
            if claim.file not in known:
                problems.append(f"patch {patch.name!r} claims {claim.file}, which is not in the manifest")
    for path in overlay:
        for block in changed_blocks(path, base.get(path, b""), overlay[path]):
            hits = [
                (k, c)
                for k, patch in enumerate(patches)
                for c, claim in enumerate(patch.claims)
                if claim.file == path and claim.match.search(block.text)
            ]
            owners = sorted({k for k, _ in hits})
            if not owners:
                problems.append(f"{block.where()}: changed block claimed by no patch")
            elif len(owners) > 1:
                names = ", ".join(patches[k].name for k in owners)
                problems.append(f"{block.where()}: changed block claimed by several patches: {names}")
            else:
                owner[block] = owners[0]
            used.update(hits)
    for k, patch in enumerate(patches):
        for c, claim in enumerate(patch.claims):
            if (k, c) not in used and claim.file in known:
                problems.append(
                    f"patch {patch.name!r}: claim {claim.match.pattern!r} matches no changed block of {claim.file}"
                )
    if problems:
        raise SeriesError("series.toml does not split the overlay into its patches:\n  - " + "\n  - ".join(problems))
    return owner


def file_states(
    patches: list[Patch],
    base: dict[str, bytes],
    overlay: dict[str, bytes],
    snapshots: dict[tuple[str, str], bytes] | None = None,
) -> list[dict[str, bytes]]:
    """Each manifest file after patches 1..k, for k = 1..n (the last equals the overlay): the patch's snapshot
    of the file (from :func:`load_snapshots`) where it has one, else, where patch k owns blocks of the file,
    the base plus the blocks of 1..k, else the file as patch k-1 left it (a patch changes only the files it
    owns blocks or snapshots of). A new module (in ``overlay``, not in ``base``) is in a state from the patch
    that adds it on."""
    owner = assign_blocks(patches, base, overlay)
    snapshots = snapshots or {}
    unknown = [f"{p.name}: {path}" for p in patches for path in p.snapshots if path not in base]
    missing = [f"{p.name}: {path}" for p in patches for path in p.snapshots if (p.name, path) not in snapshots]
    if unknown or missing:
        raise SeriesError(
            "series.toml: snapshots of files not in the manifest, of new modules (one patch adds each whole) or "
            "not loaded: " + "; ".join(unknown + missing)
        )
    states: list[dict[str, bytes]] = []
    for k, patch in enumerate(patches):
        state = {}
        for path in overlay:
            if path in patch.snapshots:
                state[path] = snapshots[patch.name, path]
                continue
            content = base.get(path)
            blocks = changed_blocks(path, content or b"", overlay[path])
            if not any(owner[b] == k for b in blocks):
                # NOTE: a patch that neither owns a block of the file nor gives it as a snapshot leaves it as the
                # patches before it left it: after an earlier patch's snapshot, base + blocks would undo it.
                if states and path in states[-1]:
                    state[path] = states[-1][path]
                elif content is not None:
                    state[path] = content
                continue  # else a new module that no patch up to k adds
            lines = (content or b"").decode("utf-8").splitlines(keepends=True)
            for block in reversed(blocks):
                if owner[block] <= k:
                    lines[block.base_start : block.base_end] = block.new_lines
            state[path] = "".join(lines).encode("utf-8")
        states.append(state)
    return states
