"""Executing an overlay file onto the stock module's classes (a module served with ``keep_classes``).

Executing an overlay file creates new classes, and a module that captured a stock one would no longer recognize
objects built from the new one: FSDP's ``_init_utils`` keeps ``_flat_param.HandleShardingStrategy`` members in
``SHARDING_STRATEGY_MAP``, so a new enum makes ``NO_SHARD`` unrecognized. So here each class statement of the
overlay file that defines a top-level class the stock module defines yields the stock class object:

- an enum or a named tuple (members, fields) must be unchanged, and is the stock class as it is;
- any other class gets the overlay's class body installed on it: each attribute of the overlay's body replaces
  the stock one, what the body lacks is removed, and a method's zero-argument ``super()`` is pointed at the stock
  class. Its bases and metaclass must be the stock class's.

Everything else the file defines (functions, new classes, constants built from the classes) is the overlay
module's own, built with the stock classes. :meth:`Graft.undo` restores each class's namespace exactly.
"""

from __future__ import annotations

import builtins
import enum
import types
from collections.abc import Callable

_ABSENT = object()
_KEPT = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "_abc_impl"})
"""Attributes of a class namespace that belong to the class object, not to its body."""


class GraftError(RuntimeError):
    """The overlay file changes a class in a way the stock class object cannot take; nothing is left changed."""


class Graft:
    """What executing an overlay file changed in the stock classes."""

    def __init__(self) -> None:
        # Each class, with what its namespace held before and what was installed
        self.replaced: list[tuple[type, dict[str, object], dict[str, object]]] = []

    def install(self, stock: type, body: type) -> None:
        """Install ``body``'s namespace on ``stock`` (see the module docstring)."""
        if body.__bases__ != stock.__bases__ or type(body) is not type(stock):
            raise GraftError(f"{_name(stock)}: the overlay changes its bases or metaclass")
        ours, theirs = vars(body), vars(stock)
        if ours.get("__slots__") != theirs.get("__slots__"):
            raise GraftError(f"{_name(stock)}: the overlay changes its __slots__")
        slots = {k for k, v in theirs.items() if isinstance(v, types.MemberDescriptorType)}
        names = (set(ours) | set(theirs)) - _KEPT - slots
        saved = {name: theirs.get(name, _ABSENT) for name in names}
        self.replaced.append((stock, saved, {name: ours.get(name, _ABSENT) for name in names}))
        for name in names:
            if name in ours:
                setattr(stock, name, ours[name])
            elif name in theirs:
                delattr(stock, name)
        for cell in _class_cells(ours.values()):
            if cell.cell_contents is body:
                cell.cell_contents = stock

    def undo(self) -> None:
        """Restore every class namespace this graft changed, but a name that changed since (a ``mock.patch``
        entered before activation and left while active has restored its own value: it stays)."""
        while self.replaced:
            stock, saved, installed = self.replaced.pop()
            for name, value in saved.items():
                if vars(stock).get(name, _ABSENT) is not installed[name]:
                    continue
                if value is _ABSENT:
                    if name in vars(stock):
                        delattr(stock, name)
                else:
                    setattr(stock, name, value)


def execute_onto(
    stock: types.ModuleType, module: types.ModuleType, exec_module: Callable[[types.ModuleType], None]
) -> Graft:
    """Execute the overlay file of ``stock``'s module into ``module`` (``exec_module``, a loader's) so that its
    classes are ``stock``'s. On an error, ``stock``'s classes are restored before it propagates."""
    name = stock.__name__
    classes = {k: v for k, v in vars(stock).items() if isinstance(v, type) and v.__module__ == name}
    graft, build_class = Graft(), builtins.__build_class__

    def build_onto_stock(func, cls_name, *bases, **kwargs):
        body = build_class(func, cls_name, *bases, **kwargs)
        found = classes.get(cls_name)
        if found is None or body.__qualname__ != cls_name or body.__module__ != name:
            return body
        if isinstance(found, enum.EnumMeta) or (issubclass(found, tuple) and hasattr(found, "_fields")):
            if not _unchanged(found, body):
                raise GraftError(f"{_name(found)}: the overlay changes an enum or named tuple that other modules hold")
            return found
        graft.install(found, body)
        return found

    # NOTE: class statements look up ``__build_class__`` in the module's builtins. Functions the file defines keep
    # this dict as their builtins (a copy of the builtins with only that entry changed).
    module.__builtins__ = {**vars(builtins), "__build_class__": build_onto_stock}
    try:
        exec_module(module)
    except BaseException:
        graft.undo()
        raise
    return graft


def _unchanged(stock: type, body: type) -> bool:
    """Whether an enum or named tuple of the overlay file is the stock one: same members or fields, same code."""
    if isinstance(stock, enum.EnumMeta):
        members = [(m.name, m.value) for m in stock.__members__.values()]
        if members != [(m.name, m.value) for m in body.__members__.values()]:
            return False
    elif (stock._fields, stock._field_defaults) != (body._fields, body._field_defaults):
        return False
    ours, theirs = vars(body), vars(stock)
    functions = [k for k in set(ours) | set(theirs) if isinstance(ours.get(k, theirs.get(k)), types.FunctionType)]
    return all(k in ours and k in theirs and _same_code(ours[k].__code__, theirs[k].__code__) for k in functions)


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    return (a.co_code, a.co_consts, a.co_names) == (b.co_code, b.co_consts, b.co_names)


def _class_cells(values) -> list[types.CellType]:
    """The ``__class__`` cells (zero-argument ``super()``) of the functions among a class body's ``values``."""
    cells, todo = [], list(values)
    while todo:
        value = todo.pop()
        if isinstance(value, (staticmethod, classmethod)):
            todo.append(value.__func__)
        elif isinstance(value, property):
            todo += [f for f in (value.fget, value.fset, value.fdel) if f is not None]
        elif isinstance(value, types.FunctionType):
            code = value.__code__
            if "__class__" in code.co_freevars:
                cells.append(value.__closure__[code.co_freevars.index("__class__")])
            if hasattr(value, "__wrapped__"):
                todo.append(value.__wrapped__)
    return cells


def _name(cls: type) -> str:
    return f"torch_overlay: {cls.__module__}.{cls.__qualname__}"
