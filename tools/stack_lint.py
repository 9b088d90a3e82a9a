"""The lint of every patch's added lines, as upstream's lint would read them (``make check-stack``).

Each patch k of the upstream series is read at its prefix: patches 1..k applied to the newest base's pristine
files (the base the series is generated on, so that the line numbers are the patch's own), the upstream test
files it edits as the prefix leaves them. Every Python file the patch changes is run through flake8 (the
linter upstream's ``lintrunner`` runs for E, F and W: pycodestyle and pyflakes), with flake8's E, F and W codes:

- ``torch/`` files: 120 columns, upstream's ``.flake8``;
- test files that keep upstream's formatting (the upstream files listed in pyproject.toml's
  ``[tool.ruff] extend-exclude``, as ``make lint`` leaves them): 120 columns too;
- the other test files, which follow PyTorch's ruff format at 88 columns (``make lint``): 88 columns.

flake8's default ignores stay ignored (``W503``/``W504`` contradict each other, ``E704``, the ``E12x``
continuation-line styles a formatter chooses), and ``E203``, which ruff format's slices break (upstream ignores
it too). Only a finding on a line the patch adds counts, a pre-existing one on an untouched line does not; but
the blank-line checks (``E30x``, ``W391``) are reported on the line after the blank lines, so they count where
the patch added any of those lines or the line before them, and an unused import (``F401``) of a multi-line
import counts where the patch added the line that names it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.project import Project
from tools.stack_rules import Hunk, file_hunks

IGNORE = ("E121", "E123", "E126", "E226", "E24", "E704", "W503", "W504", "E203")
"""flake8's default ignores (which an explicit ``--select`` would turn back on), and E203."""
TORCH_COLUMNS = 120
FORMATTED_COLUMNS = 88
_FINDING = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<code>[A-Z]\d+) (?P<text>.*)$")
_UNUSED = re.compile(r"^'(?P<name>[^']+)' imported but unused")


class LintError(RuntimeError):
    """flake8 could not run; the message says why."""


@dataclass(frozen=True)
class Finding:
    patch: str
    """The patch file's name."""
    path: str
    line: int
    col: int
    code: str
    text: str

    def __str__(self) -> str:
        return f"{self.patch}: {self.path}:{self.line}:{self.col}: {self.code} {self.text}"


@dataclass(frozen=True)
class LintFile:
    """One file a patch changes, as its prefix leaves it, and the lines the patch adds to it."""

    patch: str
    path: str
    content: bytes
    added: frozenset[int]


def upstream_formatted(project: Project) -> set[str]:
    """The upstream test files that keep upstream's formatting: pyproject.toml's ``[tool.ruff] extend-exclude``
    entries under ``test/`` (the Makefile's ``UPSTREAM_FORMATTED``)."""
    raw = tomllib.loads(project.pyproject.read_text(encoding="utf-8"))
    return {p for p in raw.get("tool", {}).get("ruff", {}).get("extend-exclude", []) if p.startswith("test/")}


def columns(path: str, formatted: set[str]) -> int:
    """The line length a file of the series is linted at."""
    if path.startswith("test/") and path not in formatted:
        return FORMATTED_COLUMNS
    return TORCH_COLUMNS


def added_lines(hunks: Sequence[Hunk]) -> frozenset[int]:
    """The new-side numbers of the lines a file's hunks add."""
    out = set()
    for hunk in hunks:
        new = hunk.new_first
        for tag, _ in hunk.lines:
            if tag == "+":
                out.add(new)
            new += tag != "-"
    return frozenset(out)


def patch_files(label: str, diff: str, tree: dict[str, bytes]) -> list[LintFile]:
    """The Python files a patch's ``diff`` changes, as ``tree`` (its prefix) holds them."""
    return [
        LintFile(label, path, tree[path], added_lines(hunks))
        for path, hunks in file_hunks(diff).items()
        if path.endswith(".py") and path in tree and added_lines(hunks)
    ]


def counts(code: str, text: str, line: int, added: frozenset[int], source: list[str], content: bytes) -> bool:
    """Whether a finding at ``line`` of a file (``source``: its lines) is the patch's: see the module's doc."""
    if line in added or code == "E999":
        return True
    if code.startswith("E30") or code == "W391":
        before = line - 1
        while before > 1 and not source[before - 1].strip():
            before -= 1
        last = len(source) if code == "W391" else line
        return any(n in added for n in range(before, last + 1))
    if code == "F401" and (match := _UNUSED.match(text)):
        name = match.group("name").split(" as ")[-1].split(".")[-1]
        try:
            module = ast.parse(content)
        except SyntaxError:
            return False
        for node in ast.walk(module):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno == line:
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                return any(n in added and re.search(rf"\b{re.escape(name)}\b", source[n - 1]) for n in span)
    return False


def lint(files: Sequence[LintFile], formatted: set[str], python: str = sys.executable) -> list[Finding]:
    """flake8 on every file, at its columns; the findings that count, in the order of ``files``."""
    findings = []
    with tempfile.TemporaryDirectory(prefix="torch-overlay-lint-") as tmp:
        where: dict[str, LintFile] = {}
        for k, f in enumerate(files):
            dest = Path(tmp, str(k), f.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.content)
            where[str(dest)] = f
        by_columns: dict[int, list[str]] = {}
        for dest, f in where.items():
            by_columns.setdefault(columns(f.path, formatted), []).append(dest)
        found: dict[str, list[tuple[int, int, str, str]]] = {}
        for width, paths in sorted(by_columns.items()):
            args = ["--isolated", "--select=E,F,W", f"--extend-ignore={','.join(IGNORE)}"]
            cmd = [python, "-m", "flake8", *args, f"--max-line-length={width}", *paths]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode not in (0, 1) or (proc.returncode == 1 and not proc.stdout.strip()):
                raise LintError(f"flake8 failed ({' '.join(cmd[:3])}): {proc.stderr.strip() or proc.returncode}")
            for out in proc.stdout.splitlines():
                if (m := _FINDING.match(out)) is not None:
                    found.setdefault(m["file"], []).append((int(m["line"]), int(m["col"]), m["code"], m["text"]))
        for dest, f in where.items():
            source = f.content.decode("utf-8", "replace").splitlines()
            for line, col, code, text in sorted(found.get(dest, [])):
                if counts(code, text, line, f.added, source, f.content):
                    findings.append(Finding(f.patch, f.path, line, col, code, text))
    return findings
