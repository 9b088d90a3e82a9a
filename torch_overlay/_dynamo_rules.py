"""``torch.compile`` treats each overlay file as it treats the upstream file it replaces.

Dynamo decides what to trace from file paths: the stock files under ``torch/distributed`` are in path lists
such as MOD_SKIPLIST (skip a frame that starts there), MOD_INLINELIST (inline calls into them) and, from
torch 2.14 on, NGB_SUPPRESS_INLINELIST (no nested graph breaks inside them), while our files live outside
the torch package and would be treated as user code. So each overlay file joins every path list that its
upstream path is in. The lists differ between releases; each is built by a ``get_<name>list()`` function of
``torch._dynamo.trace_rules`` that caches a set of path prefixes, so every such set is found by name, and
adding to it is how a path joins a list without reimplementing dynamo's rules. Fork mode and the upstream
series need none of this: their files are in place.

NOTE: ``init_process_group`` calls ``trace_rules.clear_lru_cache()``, which rebuilds some of these sets
(MOD_INLINELIST among them) but not MOD_SKIPLIST. Without registering again after it, an overlay file stayed
in MOD_SKIPLIST only: dynamo skipped it where it inlines the upstream file, so e.g. the TP + DDP forward hooks
ran eagerly between graph breaks and training failed in backward on torch 2.14+ ("A view was created in
no_grad mode ...") whenever ``torch._dynamo`` was imported before ``init_process_group``. So ``register``
wraps ``clear_lru_cache`` to register again after it.
"""

from __future__ import annotations

import os
import sys
import types
from importlib.machinery import ModuleSpec, PathFinder

from torch_overlay._manifest import load_manifest

TRACE_RULES = "torch._dynamo.trace_rules"


def path_lists(trace_rules: types.ModuleType) -> dict[str, set[str]]:
    """Every cached path-prefix set of ``trace_rules``, by the name of the function that builds it."""
    lists = {}
    for name, getter in sorted(vars(trace_rules).items()):
        if name.startswith("get_") and name.endswith("list") and hasattr(getter, "cache_clear"):
            value = getter()
            if isinstance(value, set) and all(isinstance(p, str) for p in value):
                lists[name] = value
    return lists


def upstream_and_overlay_paths() -> list[tuple[str, str]]:
    """(the upstream file's path, our file's path) for each file the overlay may serve (every base's)."""
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)))
    return [
        (os.path.join(site_dir, *m.path.split("/")), payload)
        for m in load_manifest().runtime_modules
        for payload in m.payload_files
    ]


def _add_overlay_paths(trace_rules: types.ModuleType) -> None:
    for rule_set in path_lists(trace_rules).values():
        for upstream, overlay in upstream_and_overlay_paths():
            if any(upstream.startswith(prefix) for prefix in rule_set):
                rule_set.add(overlay)


def register(trace_rules: types.ModuleType) -> None:
    """Put each overlay file in the path lists its upstream file is in, also after ``clear_lru_cache()``."""
    _add_overlay_paths(trace_rules)
    clear = getattr(trace_rules, "clear_lru_cache", None)
    if clear is None or getattr(clear, "_overlay_original", None) is not None:
        return

    def clear_lru_cache_then_register() -> None:
        clear()
        _add_overlay_paths(trace_rules)

    clear_lru_cache_then_register._overlay_original = clear  # type: ignore[attr-defined]
    trace_rules.clear_lru_cache = clear_lru_cache_then_register  # type: ignore[attr-defined]


def unregister(trace_rules: types.ModuleType) -> None:
    original = getattr(getattr(trace_rules, "clear_lru_cache", None), "_overlay_original", None)
    if original is not None:
        trace_rules.clear_lru_cache = original  # type: ignore[attr-defined]
    overlays = {overlay for _, overlay in upstream_and_overlay_paths()}
    for rule_set in path_lists(trace_rules).values():
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
