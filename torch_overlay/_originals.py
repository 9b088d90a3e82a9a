"""What activation replaced in this process: the stock module objects and the class grafts.

``activate()`` (:mod:`torch_overlay._loader`) fills this and ``deactivate()`` empties it; the finder's loader for
a module served with ``keep_classes`` that is first imported while active (:func:`exec_onto_stock`) adds to it.
Both reach the state here, so the machinery is a chain: the start-up hook, then the finder, then the loader, each
importing only those before it (and this module, which imports none of them).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from importlib.machinery import ModuleSpec

from torch_overlay import _graft

lock = threading.RLock()
"""Held by activation, deactivation and :func:`exec_onto_stock` while they change what is served."""
modules: dict[str, types.ModuleType] = {}
"""Stock module objects that were imported before activation, restored as they are on deactivation."""
grafts: dict[str, _graft.Graft] = {}
"""For each module served with ``keep_classes``, what its overlay file changed in the stock classes."""


def exec_onto_stock(module: types.ModuleType, exec_module: Callable[[types.ModuleType], None]) -> None:
    """Execute a module served with ``keep_classes`` that is first imported while active (the finder's loader):
    torch's file first, kept as the original for deactivation, then ours into ``module``, onto its classes. Imported
    again while active (a reload, or after its entry left ``sys.modules``), it goes onto the same original's classes
    again, so that deactivation restores the classes that other modules hold."""
    with lock:
        name = module.__name__
        stock = modules.get(name)
        if stock is None:
            stock = execute(name, stock_spec(name))
        ungraft(name)
        grafts[name] = _graft.execute_onto(stock, module, exec_module)
        modules[name] = stock


def ungraft(name: str) -> None:
    graft = grafts.pop(name, None)
    if graft is not None:
        graft.undo()


def stock_spec(name: str) -> ModuleSpec | None:
    parent = sys.modules[name.rpartition(".")[0]]
    return importlib.machinery.PathFinder.find_spec(name, parent.__path__)


def execute(name: str, spec: ModuleSpec | None) -> types.ModuleType:
    if spec is None or spec.loader is None:
        raise ImportError(f"torch_overlay: cannot find a source for {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
