"""pytest glue that runs every test with the overlay on, or (``--stock``) proves the red tests red.

Default: the overlay is active in this process and in every rank it spawns. The boot directory goes on
PYTHONPATH, so each spawned interpreter runs the same start-up hook a persistent install runs.

``--stock``: the overlay is off everywhere and only the tests listed in ``test/overlay/red_on_stock.txt``
run. Each must fail on stock torch with an error matching its listed pattern (reported as XFAIL); a pass, a
skip or a different error fails the run, so a listed test cannot silently stop proving its fix. Red is per
base: a test of a backport (a patch with ``fixed_upstream_in`` in ``patches/series.toml``) proves a bug that
the installed release no longer has when it is at or past that release, and there it must pass on stock.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parent
BOOT_DIR = TEST_DIR / "overlay" / "boot"
RED_LIST = TEST_DIR / "overlay" / "red_on_stock.txt"
sys.path.insert(0, str(TEST_DIR.parent))  # tools/, when pytest runs from elsewhere
sys.path.insert(0, str(BOOT_DIR))  # _torch_harness: the ranks get it from the boot directory's sitecustomize


def fixed_upstream(version: str) -> dict[str, str]:
    """Test file -> why it is green on stock ``version``: its patch was fixed upstream at or before it."""
    from tools.series import load_series

    green = {}
    for patch in load_series(TEST_DIR.parent / "patches" / "series.toml"):
        if not patch.needed_on(version):
            for path in patch.test_files:
                green[path] = f"{patch.name} is fixed upstream in torch {patch.fixed_upstream_in}"
    return green


def load_red_tests(path: Path = RED_LIST, version: str | None = None) -> dict[str, re.Pattern[str]]:
    """``<node id> <pattern>`` per line: the test and what its failure on stock torch must say. A line
    ``<node id>@torch<X.Y <pattern>`` gives what it says instead on the releases before X.Y (``version``, the
    installed base), where stock's message differs."""
    from torch_overlay._manifest import version_key

    red, before = {}, {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        key, _, pattern = line.partition(" ")
        node_id, _, release = key.partition("@")
        if not pattern.strip():
            raise pytest.UsageError(f"{path}:{number}: expected '<node id> <pattern>', got {line!r}")
        bound = re.fullmatch(r"torch<(\d+(?:\.\d+)*)", release)
        if release and bound is None:
            raise pytest.UsageError(f"{path}:{number}: expected '<node id>@torch<X.Y <pattern>', got {key!r}")
        if node_id in (before if release else red) and (not release or bound[1] in before[node_id]):
            raise pytest.UsageError(f"{path}:{number}: {key} is listed twice")
        if not (TEST_DIR.parent / node_id.split("::", 1)[0]).is_file():
            raise pytest.UsageError(f"{path}:{number}: no file {node_id.split('::', 1)[0]} (renamed or removed?)")
        if release:
            before.setdefault(node_id, {})[bound[1]] = re.compile(pattern.strip())
        else:
            red[node_id] = re.compile(pattern.strip())
    for node_id, patterns in before.items():
        if node_id not in red:
            raise pytest.UsageError(f"{path}: {node_id} has a pattern for older releases only; list its own first")
        earlier = [b for b in sorted(patterns, key=version_key) if version and version_key(version) < version_key(b)]
        if earlier:
            red[node_id] = patterns[earlier[0]]
    return red


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stock",
        action="store_true",
        help="run only the tests listed in test/overlay/red_on_stock.txt, on stock torch; each must fail",
    )


def pytest_configure(config: pytest.Config) -> None:
    stock = config.getoption("--stock")
    os.environ["TORCH_OVERLAY"] = "0" if stock else "require"
    # The checkout comes before the venv's own torch-overlay (an editable install may point at another
    # checkout): the spawned ranks import torch_overlay before they get this process's sys.path.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(BOOT_DIR), str(TEST_DIR.parent), os.environ.get("PYTHONPATH")])
    )
    import _torch_harness

    import torch_overlay._loader as loader
    from torch_overlay._guard import check_base

    _torch_harness.install()  # before any test module imports the harness

    if stock:
        loader.deactivate()
    else:
        loader.activate()
    base = check_base().matched
    config.stash[_RED] = load_red_tests(version=base.version if base is not None else None)
    config.stash[_GREEN] = fixed_upstream(base.version) if stock and base is not None else {}


_RED = pytest.StashKey[dict]()
_GREEN = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    red = config.stash[_RED]
    collected = {item.nodeid for item in items}
    collected_files = {node_id.split("::", 1)[0] for node_id in collected}
    missing = [n for n in red if n.split("::", 1)[0] in collected_files and n not in collected]
    if missing:
        raise pytest.UsageError(f"{RED_LIST}: listed tests not found (renamed or removed?): {missing}")
    if config.getoption("--stock"):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in red])
        items[:] = [item for item in items if item.nodeid in red]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # NOTE: a multi-rank test spawns its ranks while it runs; with fewer GPUs than ranks they see none, and run
    # on CPU with gloo instead of skipping (tools/rank_devices.py).
    from tools.rank_devices import rank_env_here

    env = rank_env_here(getattr(item, "cls", None))
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _watch_ranks(item: pytest.Item, teardown: bool = False):
    # NOTE: a harness without a dead-rank check (torch 2.11's MultiProcContinuousTest) would wait for ever on a
    # rank that died, and its tearDownClass on the ranks it left in a collective: RankWatch answers and ends
    # them as torch 2.12+'s harness does (a no-op there).
    from _torch_harness import RankWatch

    cls = getattr(item, "cls", None)
    if not RankWatch.watches(cls):
        yield
        return
    watch = RankWatch(cls).start(item.name, teardown)
    try:
        yield
    finally:
        watch.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _watch_ranks(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield from _watch_ranks(item, teardown=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # NOTE: A MultiProcContinuousTest class skips every test after its first failure (the "poison pill").
    # On stock torch the red tests fail on purpose, on every rank at once, so each one is judged on its own.
    if item.config.getoption("--stock") and item.cls is not None and hasattr(item.cls, "poison_pill"):
        item.cls.poison_pill = False


def _exception_lines(report: pytest.TestReport) -> str:
    """The lines pytest marks with ``E`` (the exception and its message), not the source it displays."""
    return "\n".join(line[1:] for line in report.longreprtext.splitlines() if line.startswith("E "))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    pattern = item.config.stash[_RED].get(item.nodeid)
    if pattern is None or not (report.when == "call" or report.skipped):
        return
    if not item.config.getoption("--stock"):
        if report.skipped:  # a red test that does not run proves nothing, with the overlay either
            report.outcome = "failed"
            report.longrepr = f"red-on-stock: {report.nodeid} was skipped; a listed test must run and pass"
        return
    green = item.config.stash[_GREEN].get(item.nodeid.split("::", 1)[0])
    if green is not None:  # the installed release no longer has the bug: stock must pass
        if report.failed:
            report.longrepr = (
                f"{report.longreprtext}\n\nred-on-stock: {green}, so this test must pass on stock torch here"
            )
        elif report.skipped:
            report.outcome = "failed"
            report.longrepr = f"red-on-stock: {report.nodeid} was skipped; {green}, so it must run and pass"
        return
    if report.failed and pattern.search(_exception_lines(report)):
        report.outcome = "skipped"
        report.wasxfail = f"fails on stock torch as expected: /{pattern.pattern}/"
    elif report.failed:
        report.longrepr = (
            f"{report.longreprtext}\n\nred-on-stock: this test failed on stock torch, but not with "
            f"/{pattern.pattern}/ as {RED_LIST.name} says; fix the test or the pattern"
        )
    else:
        outcome = "passed" if report.passed else "was skipped"
        report.outcome = "failed"
        report.longrepr = (
            f"red-on-stock: {report.nodeid} was expected to fail on stock torch with /{pattern.pattern}/ but "
            f"{outcome}: it does not prove its fix"
        )
