"""The pytest plugin of ``make check-stack CHECK_STACK_ARGS=--own-tests`` (``-p tools._own_tests_plugin``):
keeps only the tests that the node ids in the JSON list at ``$OWN_TESTS_SELECT`` select
(:func:`tools.own_tests.matches`), after the suite's own selection (its red-list check and ``--deselect``).
Each process that collects writes the node ids it kept, and the ids that matched nothing, to
``$OWN_TESTS_REPORT/<pid>.json`` (under pytest-xdist each worker collects)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tools.own_tests import REPORT_ENV, SELECT_ENV, matches


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select = os.environ.get(SELECT_ENV)
    if not select:
        return
    ids = json.loads(Path(select).read_text())
    kept = [item for item in items if any(matches(item, i) for i in ids)]
    unmatched = [i for i in ids if not any(matches(item, i) for item in items)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
    report = os.environ.get(REPORT_ENV)
    if report:
        out = {"kept": [item.nodeid for item in kept], "unmatched": unmatched}
        (Path(report) / f"{os.getpid()}.json").write_text(json.dumps(out))
