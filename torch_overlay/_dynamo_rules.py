"""``torch.compile`` treats each overlay file as it treats the upstream file it replaces.

Dynamo decides what to trace from file paths: the stock files under ``torch/distributed`` are skipped when a
frame starts in them and inlined when traced code calls into them (MOD_SKIPLIST, MOD_INLINELIST), while our
files live outside the torch package and would be traced by default. So each overlay file joins every rule set
that its upstream path matches. Fork mode and the upstream series need none of this: their files are in place.
"""

from __future__ import annotations

import os
import sys
import types
from importlib.machinery import ModuleSpec, PathFinder

from torch_overlay._finder import overlay_files

TRACE_RULES = "torch._dynamo.trace_rules"


def _rule_sets(trace_rules: types.ModuleType) -> tuple[set[str], ...]:
    # NOTE: cached sets of path prefixes, built on first use from module names; adding to them is how a path
    # joins a rule set without reimplementing dynamo's rules.
    return (
        trace_rules.get_legacy_mod_inlinelist(),
        trace_rules.get_mod_inlinelist(),
        trace_rules.get_mod_skiplist(),
    )


def _upstream_and_overlay_paths() -> list[tuple[str, str]]:
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)))
    return [
        (os.path.join(site_dir, *name.split(".")) + ".py", overlay_file)
        for name, overlay_file in overlay_files().items()
    ]


def register(trace_rules: types.ModuleType) -> None:
    """Put each overlay file in the rule sets its upstream file is in."""
    for rule_set in _rule_sets(trace_rules):
        for upstream, overlay in _upstream_and_overlay_paths():
            if any(upstream.startswith(prefix) for prefix in rule_set):
                rule_set.add(overlay)


def unregister(trace_rules: types.ModuleType) -> None:
    overlays = {overlay for _, overlay in _upstream_and_overlay_paths()}
    for rule_set in _rule_sets(trace_rules):
        rule_set -= overlays


def registering_spec(name: str, path: object) -> ModuleSpec | None:
    """The normal spec of ``torch._dynamo.trace_rules``, whose loader registers the overlay files after it runs."""
    spec = PathFinder.find_spec(name, path)  # type: ignore[arg-type]
    if spec is None or spec.loader is None:
        return spec
    exec_module = spec.loader.exec_module

    def exec_then_register(module: types.ModuleType) -> None:
        exec_module(module)
        register(module)

    spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
    return spec
