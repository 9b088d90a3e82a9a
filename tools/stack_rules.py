"""The rules a patch of the upstream stack must meet to be reviewable by PyTorch maintainers, one by one.

The upstream series (``patches/series``; backports, with ``fixed_upstream_in``, stay out of it) is submitted as
a ghstack stack, one PR per patch. Each PR must read like any other PyTorch PR: an area tag in the title, a
short Summary, a Test Plan with the command, ``Fixes #N`` for the open issues it fixes (``Related: #N`` for
closed ones), a size a reviewer takes in one sitting, and nothing about how this project produces it.
:func:`violations` says which rules a generated patch breaks; :func:`diff_stats` counts its changed lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
