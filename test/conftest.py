"""pytest glue that runs every test with the overlay on, or (``--stock``) proves the red tests red.

Default: the overlay is active in this process and in every rank it spawns. The boot directory goes on
PYTHONPATH, so each spawned interpreter runs the same start-up hook a persistent install runs.

``--stock``: the overlay is off everywhere and only the tests listed in ``test/overlay/red_on_stock.txt``
run. Each must fail on stock torch with an error matching its listed pattern (reported as XFAIL); a pass, a
skip or a different error fails the run, so a listed test cannot silently stop proving its fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parent
BOOT_DIR = TEST_DIR / "overlay" / "boot"
RED_LIST = TEST_DIR / "overlay" / "red_on_stock.txt"


def load_red_tests(path: Path = RED_LIST) -> dict[str, re.Pattern[str]]:
    """``<node id> <pattern>`` per line: the test and what its failure on stock torch must say."""
    red = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        node_id, _, pattern = line.partition(" ")
        if not pattern.strip():
            raise pytest.UsageError(f"{path}:{number}: expected '<node id> <pattern>', got {line!r}")
        red[node_id] = re.compile(pattern.strip())
    return red


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stock",
        action="store_true",
        help="run only the tests listed in test/overlay/red_on_stock.txt, on stock torch; each must fail",
    )


def pytest_configure(config: pytest.Config) -> None:
    stock = config.getoption("--stock")
    os.environ["TORCH_OVERLAY"] = "0" if stock else "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BOOT_DIR), os.environ.get("PYTHONPATH")]))
    import torch_overlay._loader as loader

    if stock:
        loader.deactivate()
    else:
        loader.activate()
    config.stash[_RED] = load_red_tests() if stock else {}


_RED = pytest.StashKey[dict]()


def _node_id(item: pytest.Item) -> str:
    return item.nodeid


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    red = config.stash[_RED]
    if not config.getoption("--stock"):
        return
    collected = {_node_id(item) for item in items}
    collected_files = {node_id.split("::", 1)[0] for node_id in collected}
    missing = [n for n in red if n.split("::", 1)[0] in collected_files and n not in collected]
    if missing:
        raise pytest.UsageError(f"{RED_LIST}: listed tests not found (renamed or removed?): {missing}")
    keep = [item for item in items if _node_id(item) in red]
    config.hook.pytest_deselected(items=[item for item in items if _node_id(item) not in red])
    items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    # NOTE: A MultiProcContinuousTest class skips every test after its first failure (the "poison pill").
    # On stock torch the red tests fail on purpose, on every rank at once, so each one is judged on its own.
    if item.config.getoption("--stock") and item.cls is not None and hasattr(item.cls, "poison_pill"):
        item.cls.poison_pill = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    pattern = item.config.stash[_RED].get(_node_id(item))
    report = outcome.get_result()
    if pattern is None or report.when != "call":
        return
    if report.failed and pattern.search(report.longreprtext):
        report.outcome = "skipped"
        report.wasxfail = f"fails on stock torch as expected: /{pattern.pattern}/"
    elif report.failed:
        report.longrepr = (
            f"{report.longreprtext}\n\nred-on-stock: this test failed on stock torch, but not with "
            f"/{pattern.pattern}/ as {RED_LIST.name} says; fix the test or the pattern"
        )
    else:
        report.outcome = "failed"
        report.longrepr = (
            f"red-on-stock: {report.nodeid} was expected to fail on stock torch with /{pattern.pattern}/ but "
            f"{'passed' if report.passed else 'was skipped'}: it does not prove its fix"
        )
