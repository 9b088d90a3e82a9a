"""``make check-stack``: is every prefix of the series a working torch, and does the upstream stack meet the rules?

Upstream lands a stack one PR at a time, so every prefix must stand on its own (bisectable). For the installed
base's series (``patches/series-<version>``, else ``patches/series``), for k = 1..n: patches 1..k (and the
base's backports, see :func:`prefixes`) are applied with ``git apply`` onto the base's pristine files; a
scratch copy of this project, whose payload (``torch_overlay/torch/...``) is that prefix's files, then serves
them in fresh interpreters, through the same start-up hook the test suite uses (``test/overlay/boot``), so
the spawned ranks get them too. Each runtime module the prefix touches is imported from it, the other
touched files are compiled, and the test files of every patch applied (their ``tests`` in series.toml, and
the upstream test files they edit, as the prefix leaves them) run with pytest: a later patch must not break
an earlier one's tests. ``--import-only`` runs no tests;
``--test-last`` (CI) runs them at the last prefix only, which costs one run of every test instead of one per
prefix that has it; ``--own-tests`` (CI) runs at each prefix only the tests its last patch adds or changes
(:mod:`tools.own_tests`), so that every patch passes its own tests where it lands.

Then the stack rules (:mod:`tools.stack_rules`) are checked on every patch of the upstream series, and no
patch may remove lines an earlier one added unless its message names that patch; and the lines each patch adds
are linted at its prefix (:mod:`tools.stack_lint`, :func:`series_lint`).

    python -m tools.check_stack [--import-only | --test-last | --own-tests] [--rules-only] [--wheel WHEEL_OR_DIR ...]
    python -m tools.check_stack --table   # docs/patches.md's table of the upstream stack
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.own_tests import REPORT_ENV, SELECT_ENV, changed_lines, changed_tests
from tools.patches import commit_message
from tools.pristine import BaseSourceError, pristine
from tools.project import Project, default_project
from tools.series import Patch, SeriesError, load_series, series_for
from tools.stack_lint import Finding, LintError, lint, patch_files, upstream_formatted
from tools.stack_rules import DiffStats, diff_stats, file_hunks, reversion_problems, split_patch, violations
from torch_overlay._guard import BaseMismatchError, check_base
from torch_overlay._manifest import Base
from torch_overlay._patchset import PatchApplyError, SeriesMissingError, apply_series, read_series

_IMPORT_SCRIPT = """
import importlib, os, sys
payload = os.path.realpath(sys.argv[1])
for name in sys.argv[2:]:
    origin = os.path.realpath(importlib.import_module(name).__file__)
    if not origin.startswith(payload + os.sep):
        sys.exit(f"{name} was imported from {origin}, not from the prefix's files in {payload}")
"""


class StackError(RuntimeError):
    """The series cannot be read as a stack (a patch file does not match series.toml); the message says why."""


@dataclass(frozen=True)
class StackPatch:
    """One generated patch of a series, with its series.toml entry."""

    number: int
    patch: Patch
    file: Path
    stats: DiffStats

    @property
    def message(self) -> str:
        """The commit message as ``make patches`` writes it (title, Summary, Test Plan, Fixes, Related)."""
        return commit_message(self.patch)


@dataclass(frozen=True)
class PrefixResult:
    """What happened to one prefix of the series (patches 1..k)."""

    prefix: Prefix
    applied: str | None
    """None when patches 1..k applied, else git's error."""
    imported: str | None = None
    """None when every touched file imported (or compiled), else the error; unset when not applied."""
    modules: tuple[str, ...] = ()
    tests: str | None = None
    """pytest's summary line, or None when no tests ran."""
    tests_ok: bool = True

    @property
    def ok(self) -> bool:
        return self.applied is None and self.imported is None and self.tests_ok

    def line(self) -> str:
        """One line for the prefix, then the details of what failed, indented."""
        after = "".join(f" + {b.file.name}" for b in self.prefix.backports)
        head = f"{self.prefix.entry.file.name}{after}: "
        if self.applied is not None:
            return head + f"NOT applied: {self.applied}"
        parts = ["applied", f"imported {len(self.modules)} touched" if self.imported is None else "NOT imported"]
        details = [self.imported] if self.imported else []
        if self.tests is not None:
            summary, *failures = self.tests.split("\n")
            parts.append(f"tests {'passed' if self.tests_ok else 'FAILED'} ({summary})")
            details += failures
        if self.prefix.without:
            names = ", ".join(b.file.name for b in self.prefix.without)
            details.insert(0, f"(checked without {names}: it does not apply this early)")
        return head + ", ".join(parts) + "".join(f"\n    {line.strip()}" for line in details)


def stack(project: Project, base_version: str | None = None) -> list[StackPatch]:
    """The patches of a base's series (None: the upstream series), read from ``patches/``, in order."""
    try:
        files = read_series(project.patches_dir, base_version)
        patches = load_series(project.series_toml)
    except (SeriesMissingError, SeriesError) as e:
        raise StackError(str(e)) from e
    if base_version is not None:
        patches = series_for(patches, base_version)
    else:
        patches = [p for p in patches if p.fixed_upstream_in is None]
    names = [f"{k:04d}-{p.name}.patch" for k, p in enumerate(patches, 1)]
    if names != [f.name for f in files]:
        raise StackError(f"patches/ lists {[f.name for f in files]}, series.toml gives {names}; run `make patches`")
    return [
        StackPatch(k, patch, file, diff_stats(split_patch(file.read_text(encoding="utf-8"))[1]))
        for k, (patch, file) in enumerate(zip(patches, files, strict=True), 1)
    ]


def rule_violations(project: Project) -> list[str]:
    """Every stack rule broken by the upstream series, one line each, naming the patch (both patches, where
    one undoes lines of another)."""
    entries = stack(project)
    problems = [
        f"{entry.file.name}: {problem}"
        for entry in entries
        for problem in violations(entry.patch, entry.message, entry.stats)
    ]
    diffs = [split_patch(e.file.read_text(encoding="utf-8"))[1] for e in entries]
    labels, patches = [e.file.name for e in entries], [e.patch for e in entries]
    return problems + reversion_problems(labels, patches, [e.message for e in entries], diffs)


def stack_table(project: Project) -> str:
    """docs/patches.md's table of the upstream stack (markdown): one row per patch, in order."""
    rows = ["| # | title | changed lines (code / with tests) | Fixes | tests |", "|---|---|---|---|---|"]
    for entry in stack(project):
        fixes = ", ".join(
            [f"[#{n}](https://github.com/pytorch/pytorch/issues/{n})" for n in entry.patch.fixes]
            + [f"related [#{n}](https://github.com/pytorch/pytorch/issues/{n})" for n, _ in entry.patch.related]
        )
        tests = [t for t in entry.patch.test_files if Path(t).name.startswith("test_")]
        title = entry.patch.title.replace("|", "\\|")
        size = f"{entry.stats.code} / {entry.stats.total}"
        row = [str(entry.number), title, size, fixes or "-"]
        rows.append("| " + " | ".join([*row, ", ".join(f"`{t}`" for t in tests)]) + " |")
    return "\n".join(rows)


def scratch_project(project: Project, dest: Path) -> Path:
    """A copy of the project (machinery, tests, series.toml) without its payload, to serve a prefix's files."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache")
    for part in ("torch_overlay", "tools", "test"):
        if (project.root / part).is_dir():
            shutil.copytree(project.root / part, dest / part, ignore=ignore)
    shutil.rmtree(dest / "torch_overlay" / "torch")
    shutil.rmtree(dest / "torch_overlay" / "bases", ignore_errors=True)
    (dest / "patches").mkdir()
    shutil.copy2(project.series_toml, dest / "patches" / "series.toml")
    shutil.copy2(project.pyproject, dest / "pyproject.toml")
    return dest


def serve(scratch: Path, files: dict[str, bytes], base: Base) -> None:
    """Make ``files`` (manifest path -> content) what the scratch project serves on ``base``: its payload, or
    the base's own payload where the module has one (``base_payloads``)."""
    project = Project(scratch)
    manifest = project.manifest()
    for stale in (scratch / "torch_overlay" / "torch", project.bases_dir):
        shutil.rmtree(stale, ignore_errors=True)
    for path, content in files.items():
        version = manifest.payload_version(next(m for m in manifest.modules if m.path == path), base)
        target = project.overlay_file(path) if version is None else project.base_payload_file(version, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


def scratch_env(scratch: Path) -> dict[str, str]:
    """The environment that serves the scratch payload in a process and all its children (no stale bytecode)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    boot = scratch / "test" / "overlay" / "boot"
    env.update(PYTHONPATH=f"{boot}{os.pathsep}{scratch}", TORCH_OVERLAY="require", PYTHONDONTWRITEBYTECODE="1")
    return env


@dataclass(frozen=True)
class Prefix:
    """Patches 1..k of a base's series, applied."""

    entry: StackPatch
    """Patch k."""
    backports: tuple[StackPatch, ...]
    """The base's backports applied after patch k (see :func:`prefixes`)."""
    files: dict[str, bytes] | None
    """Every file after them; None when they do not apply (``error``)."""
    error: str | None = None
    without: tuple[StackPatch, ...] = ()
    """Backports that do not apply after patch k: the prefix is checked without them."""
    earlier: tuple[StackPatch, ...] = ()
    """Patches 1..k-1."""
    editors: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)
    """Each upstream test file the series edits: the patches that edit it."""

    @property
    def applied(self) -> tuple[StackPatch, ...]:
        """Every patch of the prefix, in the order applied."""
        return (*self.earlier, self.entry, *self.backports)


def prefixes(project: Project, base: Base, pristine_files: dict[str, bytes]) -> Iterator[Prefix]:
    """Patches 1..k of the base's series applied onto its pristine files, for k = 1..n.

    NOTE: a backport fixes a bug of an older base that upstream has fixed since (it is not part of the
    upstream stack): each prefix of the upstream series is checked with the base's backports applied after
    it, as the release it is made for behaves; without them, a prefix's tests would hit that bug. Where a
    backport does not apply after patch k (its context is a later patch's), the prefix goes without it.
    """
    entries = stack(project, base.version)
    backports = tuple(e for e in entries if e.patch.fixed_upstream_in is not None)
    edited = [path for e in entries for path in e.patch.upstream_test_edits]
    editors = {p: tuple(e.patch.name for e in entries if p in e.patch.upstream_test_edits) for p in edited}
    # NOTE: upstream test files are not in the wheel; their edits are checked against test/ by `make check`.
    excludes = [f"--exclude={path}" for path in edited]
    for k, entry in enumerate(entries, 1):
        after, earlier = tuple(b for b in backports if b not in entries[:k]), tuple(entries[: k - 1])
        try:
            files = apply_series(pristine_files, [e.file for e in entries[:k] + list(after)], excludes)
            yield Prefix(entry, after, files, earlier=earlier, editors=editors)
            continue
        except PatchApplyError as e:
            if not after or e.patch not in [b.file for b in after]:
                yield Prefix(entry, after, None, f"{e.patch.name}: {e.stderr}", earlier=earlier, editors=editors)
                continue
        try:
            files = apply_series(pristine_files, [e.file for e in entries[:k]], excludes)
            yield Prefix(entry, (), files, without=after, earlier=earlier, editors=editors)
        except PatchApplyError as e:
            yield Prefix(entry, (), None, f"{e.patch.name}: {e.stderr}", after, earlier, editors)


def prefix_tests(prefix: Prefix, root: Path | None = None) -> list[str]:
    """The test files a prefix runs: those of every patch it applies, in order, with the upstream test files
    they edit that ``root`` (the project) holds rewritten (as the prefix leaves them: :func:`upstream_tests`).

    NOTE: every applied patch's, not only patch k's: a patch that undoes an earlier one's change fails the
    earlier one's tests at the prefix that lands it, even where a later patch would restore the change.
    """
    files = [t for e in prefix.applied for t in e.patch.tests]
    if root is not None:
        files += [t for e in prefix.applied for t in e.patch.upstream_test_edits if (root / t).is_file()]
    return list(dict.fromkeys(t for t in files if Path(t).name.startswith("test_")))


def upstream_tests(project: Project, prefix: Prefix) -> dict[str, bytes]:
    """Each upstream test file this repository holds rewritten (the whole series' version) that a patch of the
    prefix edits, as the prefix leaves it: the diffs of the later patches that edit it, reversed, last first."""
    applied = {e.patch.name for e in prefix.applied}
    out = {}
    for path, editors in prefix.editors.items():
        content = upstream_test_at(project, path, editors, applied)
        if content is not None:
            out[path] = content
    return out


def upstream_test_at(project: Project, path: str, editors: Sequence[str], applied: Collection[str]) -> bytes | None:
    """Upstream test file ``path``, which the patches ``editors`` edit (in order), as the patches ``applied``
    leave it; None where this repository does not hold it or none of them is applied."""
    rewritten = project.repo_file(path)
    if not rewritten.is_file() or not set(applied) & set(editors):
        return None
    later = [name for name in editors if name not in applied]
    if not later:  # every patch that edits it is applied: the rewritten file
        return rewritten.read_bytes()
    diffs = [project.upstream_edit_file(path, name if len(editors) > 1 else None) for name in later]
    return apply_series({path: rewritten.read_bytes()}, reversed(diffs), ["-R"])[path]


def prefix_red_list(red_list: str, rewritten: dict[str, bytes]) -> str:
    """The suite's red list without the tests that a prefix's earlier version of an upstream test file lacks (a
    later patch adds them), which the suite would take for renamed or removed."""

    def kept(line: str) -> bool:
        path, _, test = line.partition(" ")[0].partition("@")[0].partition("::")
        if path not in rewritten:
            return True
        *classes, name = test.split("::")  # a test of the same name in a class the prefix lacks is left out too
        text = rewritten[path]
        has_classes = all(re.search(rf"^\s*class {c}\b".encode(), text, re.M) for c in classes)
        return has_classes and f"def {name}(".encode() in text

    return "".join(line for line in red_list.splitlines(keepends=True) if line.startswith("#") or kept(line))


def check_prefix(
    project: Project, scratch: Path, prefix: Prefix, pristine_files: dict[str, bytes], import_only: bool,
    base: Base, python: str = sys.executable, jobs: int = 1, own: bool = False,
) -> PrefixResult:  # fmt: skip
    """Apply, import and test one prefix in the scratch project; ``own``: run patch k's own tests only
    (:func:`own_test_ids`), else the tests of every patch applied (:func:`prefix_tests`)."""
    manifest = project.manifest()
    tree = prefix.files
    assert tree is not None, "only a prefix that applied is checked"
    # NOTE: a new module (no release ships it) is served from the prefix that adds it on.
    serve(scratch, {m.path: tree[m.path] for m in manifest.runtime_modules if m.path in tree}, base)
    touched = [m for m in manifest.modules if tree.get(m.path) != pristine_files.get(m.path)]
    modules = tuple(m.name for m in touched if m.runtime)
    env = scratch_env(scratch)
    imported = None
    for m in touched:
        try:
            compile(tree[m.path], m.path, "exec")
        except SyntaxError as e:
            imported = f"{m.path}: {e}"
    if imported is None and modules:
        payload = str(scratch / "torch_overlay")
        proc = subprocess.run(
            [python, "-c", _IMPORT_SCRIPT, payload, *modules], cwd=scratch, env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            imported = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    result = PrefixResult(prefix, None, imported, modules)
    tests = prefix_tests(prefix, scratch)
    if import_only or imported is not None or not tests:
        return result
    try:
        rewritten = upstream_tests(project, prefix)
    except PatchApplyError as e:
        return PrefixResult(prefix, f"{e.patch.name} does not reverse: {e.stderr}")
    # The test files the series adds, and the upstream ones it edits, as the prefix leaves them.
    served = {**{p: c for p, c in tree.items() if p.startswith("test/")}, **rewritten}
    for path, content in served.items():
        (scratch / path).parent.mkdir(parents=True, exist_ok=True)
        (scratch / path).write_bytes(content)
    red_list = Path("test", "overlay", "red_on_stock.txt")
    if (project.root / red_list).is_file():
        repo = {p: project.repo_file(p) for p in served}
        earlier = {p: c for p, c in served.items() if not repo[p].is_file() or c != repo[p].read_bytes()}
        (scratch / red_list).write_text(prefix_red_list((project.root / red_list).read_text(), earlier))
    select: list[str] = []
    if own:
        ids = own_test_ids(prefix.entry, {**tree, **rewritten})
        absent = [f"\nnot run: {p} is not in this repository" for p in own_test_files(prefix.entry) if p not in served]
        if not ids:
            return dataclasses.replace(result, tests="its diff changes no test here" + "".join(absent))
        tests, select = list(dict.fromkeys(i.split("::", 1)[0] for i in ids)), ["-p", "tools._own_tests_plugin"]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torch-overlay-own-") as tmp:
        if own:
            Path(tmp, "select.json").write_text(json.dumps(ids))
            env.update({SELECT_ENV: str(Path(tmp, "select.json")), REPORT_ENV: tmp})
        proc = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select, *pytest_jobs(jobs), *tests],
            cwd=scratch, env=env, capture_output=True, text=True,
        )  # fmt: skip
        reports = [json.loads(f.read_text()) for f in Path(tmp).glob("[0-9]*.json")]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = (
        f"{lines[-1].strip('= ') if lines else f'exit status {proc.returncode}'}, {time.monotonic() - start:.0f} s"
    )
    # NOTE: pytest exits 5 when every selected test is deselected here (an accelerator-only class).
    ok = proc.returncode == 0 or (own and proc.returncode == 5 and bool(reports))
    if own and reports:
        unmatched = sorted(set.intersection(*(set(r["unmatched"]) for r in reports)))
        summary += "".join(f"\nnot collected here (deselected, or absent): {i}" for i in unmatched)
    if own:
        summary += "".join(absent)
    if not ok:
        summary += "".join(f"\n{line}" for line in failure_lines(proc.stdout))
    return PrefixResult(prefix, None, imported, modules, summary, ok)


def own_test_files(entry: StackPatch) -> list[str]:
    """The test files (``test/**/test_*.py``) patch ``entry``'s diff adds or changes."""
    diff = split_patch(entry.file.read_text(encoding="utf-8"))[1]
    return [p for p in file_hunks(diff) if p.startswith("test/") and re.fullmatch(r"test_.*\.py", Path(p).name)]


def own_test_ids(entry: StackPatch, files: dict[str, bytes]) -> list[str]:
    """The node ids of patch ``entry``'s own tests (:mod:`tools.own_tests`), in ``files`` (its prefix's): each
    test file it adds whole (its ``tests``), and in each other test file its diff changes, the tests it adds or
    changes (a file ``files`` lacks, an upstream test file this repository does not hold, is left out)."""
    ids = []
    for path, hunks in file_hunks(split_patch(entry.file.read_text(encoding="utf-8"))[1]).items():
        if path not in own_test_files(entry) or path not in files:
            continue
        if path in entry.patch.tests:
            ids.append(path)
        else:
            ids += changed_tests(path, files[path], *changed_lines(hunks))
    return ids


def pytest_jobs(jobs: int) -> list[str]:
    """pytest-xdist's options for ``jobs`` workers, a test class (or module) to a worker, so that a class that
    keeps its process group across its tests (MultiProcContinuousTest) starts it once."""
    return ["-n", str(jobs), "--dist", "loadscope"] if jobs > 1 else []


def failure_lines(output: str, limit: int = 8) -> list[str]:
    """What a failed pytest run says went wrong: each failed test, and each distinct error (deepest first)."""
    failed = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    errors = re.findall(r"^E +((?:\w+\.)*\w+(?:Error|Exception|Interrupt)\b.*)$", output, re.MULTILINE)
    errors = [e for e in dict.fromkeys(reversed(errors)) if "Exception in worker process" not in e]
    return [line.split(" - ")[0] for line in failed][:limit] + errors[:limit]


def check_stack(
    project: Project, base: Base, pristine_files: dict[str, bytes], import_only: bool,
    report: Callable[[str], None] = print, test_last: bool = False, jobs: int = 1, own_tests: bool = False,
) -> list[PrefixResult]:  # fmt: skip
    """Check every prefix of the base's series, reporting one line per prefix as it goes; ``test_last``: run the
    tests at the last prefix only (every prefix is still applied and imported); ``own_tests``: run, at each
    prefix, the tests of its last patch only (:func:`own_test_ids`); ``jobs``: pytest workers."""
    results = []
    last = len(stack(project, base.version))
    with tempfile.TemporaryDirectory(prefix="torch-overlay-stack-") as tmp:
        scratch = scratch_project(project, Path(tmp) / "project")
        for prefix in prefixes(project, base, pristine_files):
            if prefix.error is not None:
                result = PrefixResult(prefix, prefix.error)
            else:
                untested = import_only or (test_last and prefix.entry.number != last)
                result = check_prefix(
                    project, scratch, prefix, pristine_files, untested, base, jobs=jobs, own=own_tests
                )
            results.append(result)
            report(result.line())
    return results


def series_lint(project: Project, base_files: dict[str, bytes], python: str = sys.executable) -> list[Finding]:
    """The lint findings of the lines every patch of the upstream series adds (:mod:`tools.stack_lint`), each
    patch read at its prefix: ``base_files`` (the newest base's pristine files, which the series is generated
    on) with patches 1..k applied, and the upstream test files as the prefix leaves them."""
    entries = stack(project)
    editors = {
        path: tuple(e.patch.name for e in entries if path in e.patch.upstream_test_edits)
        for entry in entries
        for path in entry.patch.upstream_test_edits
    }
    excludes = [f"--exclude={path}" for path in editors]
    tree, files = dict(base_files), []
    for k, entry in enumerate(entries, 1):
        try:
            tree = apply_series(tree, [entry.file], excludes)
        except PatchApplyError as e:
            raise StackError(f"{e.patch.name} does not apply to the newest base's files: {e.stderr}") from e
        applied = {e.patch.name for e in entries[:k]}
        edited = {p: upstream_test_at(project, p, names, applied) for p, names in editors.items()}
        view = {**tree, **{p: c for p, c in edited.items() if c is not None}}
        files += patch_files(entry.file.name, split_patch(entry.file.read_text(encoding="utf-8"))[1], view)
    return lint(files, upstream_formatted(project), python)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.check_stack", description=__doc__.splitlines()[0])
    tests = parser.add_mutually_exclusive_group()
    tests.add_argument("--import-only", action="store_true", help="apply and import every prefix; run no tests")
    tests.add_argument(
        "--test-last", action="store_true", help="apply and import every prefix; run every patch's tests at the last"
    )
    tests.add_argument(
        "--own-tests",
        action="store_true",
        help="apply and import every prefix; run the tests its last patch adds or changes (CI)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="pytest workers for the tests (pytest-xdist)")
    parser.add_argument("--rules-only", action="store_true", help="check the stack rules and the lint only")
    parser.add_argument("--table", action="store_true", help="print docs/patches.md's stack table (markdown) and exit")
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="a torch wheel or site-packages-like directory"
    )
    args = parser.parse_args(argv)
    project = default_project()
    failed = False
    try:
        if args.table:
            print(stack_table(project))
            return 0
        found = pristine(project, args.wheel)
        if not args.rules_only:
            try:
                base = check_base().matched
            except BaseMismatchError as e:
                raise StackError(str(e)) from e
            if base is None:
                raise StackError("the installed torch is not a base; run it in a base venv (make TORCH=<version>)")
            files = found.files(base)
            start = time.monotonic()
            print(f"check-stack: torch {base.version}, every prefix of its series")
            results = check_stack(
                project, base, files, args.import_only, test_last=args.test_last, jobs=args.jobs,
                own_tests=args.own_tests,
            )  # fmt: skip
            bad = [r for r in results if not r.ok]
            failed = bool(bad)
            what = "applied, imported and tested (each with the tests of every patch applied)"
            if args.own_tests:
                what = "applied, imported and tested (each with the tests its last patch adds or changes)"
            elif args.import_only or args.test_last:
                what = "applied and imported" + (", the last tested with every patch's tests" if args.test_last else "")
            verdict = f"{len(bad)} of {len(results)} prefixes FAILED" if bad else f"all {len(results)} prefixes {what}"
            print(f"check-stack: torch {base.version}: {verdict} ({time.monotonic() - start:.0f} s)")
        problems = rule_violations(project)
        start = time.monotonic()
        findings = series_lint(project, found.files(project.manifest().bases[-1]))
    except (StackError, BaseSourceError, LintError) as e:
        print(f"make check-stack: {e}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"stack rule broken: {problem}")
    if problems:
        print(
            f"check-stack: {len(problems)} stack rule violations in the upstream series "
            "(docs/patches.md, 'Stack check')"
        )
    else:
        print("check-stack: every patch of the upstream series meets the stack rules")
    for finding in findings:
        print(f"lint: {finding}")
    took = f"{time.monotonic() - start:.0f} s"
    if findings:
        print(f"check-stack: {len(findings)} lint findings on the lines the patches add ({took}; docs/patches.md)")
    else:
        print(f"check-stack: the lines every patch adds are lint-clean (flake8 E, F, W; {took})")
    return 1 if failed or problems or findings else 0


if __name__ == "__main__":
    sys.exit(main())
