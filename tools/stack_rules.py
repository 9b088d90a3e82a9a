"""The rules a patch of the upstream stack must meet to be reviewable by PyTorch maintainers, one by one.

The upstream series (``patches/series``; backports, with ``fixed_upstream_in``, stay out of it) is submitted as
a ghstack stack, one PR per patch. Each PR must read like any other PyTorch PR: an area tag in the title, a
short Summary, a Test Plan with the command, ``Fixes #N`` for the open issues it fixes (``Related: #N`` for
closed ones), a size a reviewer takes in one sitting, and nothing about how this project produces it.
:func:`violations` says which rules a generated patch breaks; :func:`diff_stats` counts its changed lines.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tools.series import Patch

TAGS = ("[DTensor]", "[FSDP]", "[DDP]", "[dynamo]", "[optim]")
MAX_SUMMARY_LINES = 15
MAX_CODE_LINES = 400
"""Changed lines (added + removed) in files outside ``test/``."""
MAX_TOTAL_LINES = 700
"""Changed lines, tests included."""

# NOTE: words that only make sense inside this project. "base" alone is an ordinary word upstream ("base
# class", "base weight"), so only the phrases in which it names one of our supported releases are matched.
_TOOLING_WORDS = re.compile(
    r"torch[-_]overlay|\boverlay|\bmanifest\b|series\.toml|red_on_stock|\bpatches/|\bfork mode\b|\bthis tool\b"
    r"|\bmake (?:check|test|patches|ghstack|lint|install|sources|status|rebase|apply-|revert-|bench-)"
    r"|\bbases\b|\b(?:every|each|older|oldest|newest|payload|other|supported) base\b",
    re.IGNORECASE,
)
_COMMAND = re.compile(r"^\s*(?:\$\s*)?(?:python3?|pytest|torchrun)\s+\S", re.MULTILINE)
_FIXES = re.compile(r"^\s*(?:Fixes|Closes|Resolves)\s+#(\d+)", re.IGNORECASE | re.MULTILINE)
_RELATED = re.compile(r"^\s*Related:?\s+#(\d+)", re.IGNORECASE | re.MULTILINE)
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_HUNK_AT = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class FileStat:
    path: str
    added: int
    removed: int

    @property
    def changed(self) -> int:
        return self.added + self.removed

    @property
    def is_test(self) -> bool:
        return self.path.startswith("test/")


@dataclass(frozen=True)
class DiffStats:
    """The changed lines of one patch, per file."""

    files: tuple[FileStat, ...]
    added: tuple[tuple[str, str], ...]
    """(file, line without its ``+``) for every added line: what a reviewer reads as new text."""

    @property
    def code(self) -> int:
        return sum(f.changed for f in self.files if not f.is_test)

    @property
    def total(self) -> int:
        return sum(f.changed for f in self.files)

    @property
    def test_files(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files if f.is_test)


def split_patch(text: str) -> tuple[str, str]:
    """A ``git format-patch`` text as (its header and message, its diff)."""
    head, sep, diff = text.partition("\ndiff --git ")
    return head, ("diff --git " + diff) if sep else ""


def diff_stats(diff: str) -> DiffStats:
    """Added and removed lines per file of a git diff, reading each hunk by its line counts.

    Counting by the hunk headers, not by a line's first character, so that a removed line reading ``-- x``
    is not taken for a file header.
    """
    files: list[FileStat] = []
    added_lines: list[tuple[str, str]] = []
    path, added, removed = None, 0, 0
    old_left = new_left = 0
    for line in diff.splitlines():
        if old_left or new_left:
            if line.startswith("+"):
                added, new_left = added + 1, new_left - 1
                added_lines.append((path or "", line[1:]))
            elif line.startswith("-"):
                removed, old_left = removed + 1, old_left - 1
            elif not line.startswith("\\"):  # context ("\ No newline at end of file" counts for neither)
                old_left, new_left = old_left - 1, new_left - 1
            continue
        if line.startswith("diff --git "):
            if path is not None:
                files.append(FileStat(path, added, removed))
            path, added, removed = line.split(" b/", 1)[1], 0, 0
        elif (hunk := _HUNK.match(line)) is not None:
            old_left = int(hunk.group(1) if hunk.group(1) is not None else 1)
            new_left = int(hunk.group(2) if hunk.group(2) is not None else 1)
    if path is not None:
        files.append(FileStat(path, added, removed))
    return DiffStats(tuple(files), tuple(added_lines))


def violations(patch: Patch, message: str, stats: DiffStats) -> list[str]:
    """The stack rules that one upstream patch breaks, one line each (empty: it is ready for review).

    ``message`` is the patch's commit message as generated (title, Summary, Test Plan, Fixes and Related lines);
    ``stats`` its diff's changed lines.
    """
    problems = []
    if not patch.title.startswith(TAGS):
        problems.append(f"title must start with one of {' '.join(TAGS)}: {patch.title!r}")
    summary_lines = len(patch.summary.splitlines())
    if summary_lines > MAX_SUMMARY_LINES:
        problems.append(f"Summary has {summary_lines} lines, at most {MAX_SUMMARY_LINES}")
    if not _COMMAND.search(patch.test_plan):
        problems.append("Test Plan has no command (a line such as `python test/distributed/...py`)")
    said = sorted({int(n) for n in _FIXES.findall(message)})
    if said != sorted(set(patch.fixes)):
        problems.append(f"the message says Fixes {_issues(said)}, but series.toml's fixes are {_issues(patch.fixes)}")
    related = sorted({n for n, _ in patch.related})
    said = sorted({int(n) for n in _RELATED.findall(message)})
    if said != related:
        problems.append(f"the message says Related {_issues(said)}, but series.toml's related are {_issues(related)}")
    if set(patch.fixes) & set(related):
        problems.append(f"{_issues(sorted(set(patch.fixes) & set(related)))}: both fixed and related; pick one")
    problems += size_problems(stats)
    texts = [("the message", message)] + [
        (f"{path} (added lines)", "\n".join(line for p, line in stats.added if p == path))
        for path in dict.fromkeys(p for p, _ in stats.added)
    ]
    for where, text in texts:
        words = sorted({m.group(0).lower() for m in _TOOLING_WORDS.finditer(text)})
        if words:
            problems.append(f"{where} names this project's tooling: {', '.join(repr(w) for w in words)}")
    return problems


def size_problems(stats: DiffStats) -> list[str]:
    """Where a patch is over the size one reviewer reads in one sitting."""
    problems = []
    if stats.code > MAX_CODE_LINES:
        problems.append(f"{stats.code} changed lines of code (outside test/), at most {MAX_CODE_LINES}")
    if stats.total > MAX_TOTAL_LINES:
        problems.append(f"{stats.total} changed lines with tests, at most {MAX_TOTAL_LINES}")
    return problems


def _issues(numbers: tuple[int, ...] | list[int]) -> str:
    return ", ".join(f"#{n}" for n in numbers) if numbers else "none"


@dataclass
class Hunk:
    """One hunk of a diff: where it starts on each side, its line counts, and its lines (tag, text)."""

    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lines: list[tuple[str, str]] = field(default_factory=list)

    @property
    def old_first(self) -> int:
        """The first old line the hunk covers (for an insertion, ``old_count == 0``, the line after it)."""
        return self.old_start if self.old_count else self.old_start + 1

    @property
    def new_first(self) -> int:
        return self.new_start if self.new_count else self.new_start + 1


def file_hunks(diff: str) -> dict[str, list[Hunk]]:
    """Each file of a git diff (by its ``b/`` path) and its hunks, read by their line counts as :func:`diff_stats`."""
    out: dict[str, list[Hunk]] = {}
    hunks: list[Hunk] = []
    old_left = new_left = 0
    for line in diff.splitlines():
        if old_left or new_left:
            if line.startswith("\\"):  # "\ No newline at end of file" counts for neither side
                continue
            tag = line[:1] if line.startswith(("+", "-")) else " "
            hunks[-1].lines.append((tag, line[1:]))
            old_left -= tag != "+"
            new_left -= tag != "-"
        elif line.startswith("diff --git "):
            hunks = out.setdefault(line.split(" b/", 1)[1], [])
        elif (match := _HUNK_AT.match(line)) is not None:
            old, new = (int(n) if n is not None else 1 for n in (match.group(2), match.group(4)))
            hunks.append(Hunk(int(match.group(1)), old, int(match.group(3)), new))
            old_left, new_left = old, new
    return out


@dataclass(frozen=True)
class Reversion:
    """A line that one patch of a series removes although an earlier patch of the series added it."""

    patch: int
    """Index of the patch whose diff removes the line."""
    earlier: int
    """Index of the patch that added it."""
    path: str
    line: int
    """Its line number in the file as the patches before ``patch`` leave it."""
    text: str


def reversions(diffs: Sequence[str], skip: Collection[str] = ()) -> list[Reversion]:
    """Every line that a diff of the series (in order, each made against the files the earlier ones leave)
    removes, or changes, although an earlier diff of the series added it.

    Each added line is followed, by its line number, through the later diffs of its file: exact for a series
    that applies in order, whatever the lines say (two equal lines are two lines). A line the diff adds back
    to the same file (the same text but for indentation) has moved, not gone: it keeps its patch. The files in
    ``skip`` are not followed.
    """
    found: list[Reversion] = []
    owners: dict[str, dict[int, int]] = {}  # path -> {line number now: index of the patch that added the line}
    for k, diff in enumerate(diffs):
        for path, hunks in file_hunks(diff).items():
            if path in skip:
                continue
            owned, after, shift = owners.get(path, {}), {}, 0
            kept = {text.strip() for hunk in hunks for tag, text in hunk.lines if tag == "+"}
            pending = sorted(owned.items())
            for hunk in hunks:
                while pending and pending[0][0] < hunk.old_first:
                    line, owner = pending.pop(0)
                    after[line + shift] = owner
                old, new = hunk.old_first, hunk.new_first
                for tag, text in hunk.lines:
                    if tag == "+":
                        after[new] = k
                    elif tag == "-" and old in owned and text.strip() not in kept:
                        found.append(Reversion(k, owned[old], path, old, text))
                    elif tag == " " and old in owned:
                        after[new] = owned[old]
                    old += tag != "+"
                    new += tag != "-"
                pending = [(line, owner) for line, owner in pending if line >= old]
                shift += hunk.new_count - hunk.old_count
            after.update((line + shift, owner) for line, owner in pending)
            owners[path] = after
    return found


def names_patch(message: str, patch: Patch, number: int) -> bool:
    """Whether a commit message names ``patch``, number ``number`` of its series: by its name, its title
    (without the area tag; case and line breaks aside) or "patch <number>"."""
    flat = " ".join(message.split()).lower()
    title = " ".join(patch.title.split("] ", 1)[-1].split()).lower()
    return patch.name in message or title in flat or re.search(rf"\bpatch\s+#?{number}\b", flat) is not None


def reversion_problems(labels: Sequence[str], patches: Sequence[Patch], messages: Sequence[str],
                       diffs: Sequence[str], skip: Collection[str] = ()) -> list[str]:  # fmt: skip
    """Where a patch removes lines an earlier patch added and its message does not name that patch (one line
    per pair, naming both, the first such line and the fix); ``labels`` name the patches in the lines, ``skip``
    the files not followed (:func:`reversions`).

    NOTE: a later patch may rework an earlier one's lines (a snapshot's new function, extended), but it must
    say so: its message names the earlier patch and says why. Anything else is a patch carrying another's
    change, which breaks the prefix in between (patch 3 dropping, and patch 4 restoring, patch 2's line).
    """
    problems = []
    pairs: dict[tuple[int, int], list[Reversion]] = {}
    for r in reversions(diffs, skip):
        pairs.setdefault((r.patch, r.earlier), []).append(r)
    for (k, j), found in sorted(pairs.items()):
        if names_patch(messages[k], patches[j], j + 1):
            continue
        first = found[0]
        lines = f"{len(found)} line{'s' if len(found) > 1 else ''}"
        problems.append(
            f"{labels[k]} removes {lines} that {labels[j]} added ({first.path}:{first.line}: {first.text.strip()!r})"
            f", and its message does not name {labels[j]}: move the change to the patch that owns it, or say in "
            f"{patches[k].name}'s Summary why it reworks {patches[j].name} (naming it by its name, its title or "
            f'"patch {j + 1}")'
        )
    return problems
