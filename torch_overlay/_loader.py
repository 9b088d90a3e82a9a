"""In-process activation: serve our modules in place of the upstream ones, and take them out again.

One mechanism serves every way of activating (an ``activate()`` call, the start-up hook of a persistent
install, the test suite's boot directory):

- a meta path finder, first on ``sys.meta_path``, serves the overlay file for each manifest module imported
  from then on, under the upstream name (so relative imports, pickling and ``__module__`` are unchanged);
- a manifest module that was already imported is swapped for a freshly executed overlay module, and every
  global that another module bound with ``from X import f`` is rebound to the overlay's ``f``.

Deactivation is the same swap run backwards: the finder is removed, each overlay module is swapped for the
original module object (or, if the module was first imported while active, a fresh stock one; a new module,
which stock torch does not have, is removed) and every binding is pointed back. Original module objects are
never mutated, so their functions keep their identity. References held outside module globals (a hook already
registered on a model, a closure) keep whatever they captured; that is why activation belongs before models
are built.

A class defined in a swapped module is a new class after the swap, and a subclass keeps the base it was
defined on. Torch's own subclasses are handled like the manifest modules: their module is executed afresh, from
torch's file, after the swap, so it subclasses the class now served. A subclass defined anywhere else (the
user's) cannot be redefined: activation and deactivation then refuse, having changed nothing
(:class:`SubclassedError`).

A module served with ``keep_classes`` (a file whose classes other modules and users hold: DDP's
``distributed.py``, FSDP's ``_flat_param.py``) keeps the stock class objects instead: the overlay file is executed
onto them (:mod:`torch_overlay._graft`), so its classes are the stock ones with the overlay's class bodies, and
deactivation restores their namespaces. A subclass, anyone's, and a class captured before activation (a
framework's registry) then get the change and need nothing. First imported while active, such a module is
executed from torch's file first, then from ours onto it, so that deactivation gives back the same classes. An
object keeps its class, so one built by one version runs the other's methods after a swap: where that cannot
work (``refuse_live_instances`` in the manifest: DDP, whose ``__init__`` builds the reducer its methods expect),
activation and deactivation refuse while one is alive (:class:`LiveInstancesError`).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import types
import warnings
from dataclasses import dataclass
from enum import Enum
from importlib.machinery import ModuleSpec

from torch_overlay import _dynamo_rules, _fork, _graft, _originals
from torch_overlay._dynamo_rules import TRACE_RULES
from torch_overlay._env import ENV_VAR, EnvMode, EnvValueError, env_mode
from torch_overlay._finder import OverlayFinder, installed_finder, overlay_spec
from torch_overlay._guard import BaseMismatchError, require_base
from torch_overlay._manifest import Manifest, OverlayModule, load_manifest


class ModuleState(Enum):
    """Where a manifest module comes from in this process."""

    NOT_IMPORTED = "not imported"
    STOCK = "stock"
    OVERLAY = "overlay"


@dataclass(frozen=True)
class ProcessState:
    """The overlay's state in this interpreter."""

    active: bool
    base_checked: bool
    """False while the start-up hook's finder waits for the first import of a replaced module to check."""
    disabled_reason: str | None
    """Why an activation from the start-up hook stood down (base mismatch), else None."""
    disabled_fix: str | None
    """The command that fixes what made it stand down, where there is one."""
    modules: tuple[tuple[str, ModuleState], ...]


class SubclassedError(RuntimeError):
    """A class the swap would replace has a subclass outside torch; nothing was changed."""


class LiveInstancesError(RuntimeError):
    """Objects of a served class that work only with the version that built them are alive; nothing was changed."""


class NotActiveError(RuntimeError):
    """:func:`torch_overlay.require_active`: this process does not run the overlay's change."""


def is_overlay_module(module: types.ModuleType, overlay: OverlayModule) -> bool:
    """Whether ``module`` was executed from one of our files (the payload, or a base's own payload)."""
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    ours = {os.path.realpath(f) for f in overlay.payload_files}
    return origin is not None and os.path.realpath(origin) in ours


def dependents(modules: list[types.ModuleType], manifest: Manifest, activating: bool) -> dict[str, list[str]]:
    """For each of ``modules``, the torch modules to execute afresh right after swapping it: those defining, at
    module level, a subclass of one of its classes (outside the manifest modules).

    Raises :class:`SubclassedError` for any other subclass (the user's): it would keep the class it was defined
    on, the one being swapped out.
    """
    names = {m.name for m in manifest.runtime_modules}
    kept = {m.name for m in manifest.runtime_modules if m.keep_classes}
    found: dict[str, list[str]] = {}
    for module in modules:
        found[module.__name__] = owners = []
        if module.__name__ in kept:  # its classes stay the stock ones: every subclass gets the change
            continue
        classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
        seen: set[type] = set()
        while classes:
            cls = classes.pop()
            for sub in type.__subclasses__(cls):
                if sub in seen or sub.__module__ in names:
                    continue
                seen.add(sub)
                classes.append(sub)
                owner = sub.__module__ or ""
                torch_owned = owner == "torch" or owner.startswith("torch.")
                if torch_owned and getattr(sys.modules.get(owner), sub.__qualname__, None) is sub:
                    owners += [owner] if owner not in owners else []
                    continue
                fix = (
                    "Activate before that class is defined: `python -m torch_overlay.activate` (every process), "
                    "or torch_overlay.activate() before importing it."
                    if activating
                    else "Leave the overlay active, or deactivate it before that class is defined."
                )
                raise SubclassedError(
                    f"torch_overlay: refusing to {'activate' if activating else 'deactivate'} the overlay: "
                    f"{owner}.{sub.__qualname__} subclasses {cls.__module__}.{cls.__qualname__}, which the overlay "
                    f"serves, and would keep the {'stock' if activating else 'overlay'} class; nothing was "
                    f"changed. {fix}"
                )
    return found


def refuse_live_instances(modules: list[types.ModuleType], manifest: Manifest, activating: bool) -> None:
    """Raise :class:`LiveInstancesError` if an object of a class that the manifest lists under
    ``refuse_live_instances`` for one of ``modules`` is alive: built by one version, it would run the other's
    methods."""
    listed = {m.name: m.refuse_live_instances for m in manifest.runtime_modules if m.refuse_live_instances}
    classes = tuple(getattr(module, name) for module in modules for name in listed.get(module.__name__, ()))
    if not classes:
        return
    gc.collect()  # an unreachable model is no reason to refuse
    # NOTE: type(), not isinstance(): isinstance() reads ``__class__``, which some lazy objects compute.
    alive = [type(o) for o in gc.get_objects() if issubclass(type(o), classes)]
    if not alive:
        return
    names = ", ".join(sorted({f"{c.__module__}.{c.__qualname__}" for c in alive}))
    if activating:
        what = "before activation, and would run the overlay's methods on what stock torch built"
        fix = (
            "Activate before wrapping models: `python -m torch_overlay.activate` (every process), or "
            "torch_overlay.activate() before building them."
        )
    else:
        what = "while active, and would run stock methods on what the overlay built"
        fix = "Delete those objects first, or leave the overlay active."
    raise LiveInstancesError(
        f"torch_overlay: refusing to {'activate' if activating else 'deactivate'} the overlay: {len(alive)} "
        f"object(s) of {names} were built {what}; nothing was changed. {fix}"
    )


def activate(*, guard_on_first_use: bool = False, strict: bool = False) -> None:
    """Activate the overlay in this process; a no-op when it is already active.

    Raises :class:`~torch_overlay._guard.BaseMismatchError`, having changed nothing, when the installed
    torch is not the base (unless ``guard_on_first_use``, see :class:`~torch_overlay._finder.OverlayFinder`,
    which ``strict`` makes raise where it would stand down).
    """
    with _originals.lock:
        finder = installed_finder()
        if finder is not None:
            # Installed by the start-up hook: an explicit call checks the base now, and says so if it failed.
            if not guard_on_first_use and finder.verify() is not None:
                fix = f" {finder.disabled_fix}" if finder.disabled_fix else ""
                raise BaseMismatchError(
                    f"torch_overlay: the overlay stood down in this process: {finder.disabled_reason}.{fix}"
                )
            return
        manifest = load_manifest()
        check_now = not guard_on_first_use or any(m.name in sys.modules for m in manifest.runtime_modules)
        base = None
        if check_now:
            refusal = _fork.refusal("activate the overlay")
            if refusal:
                raise BaseMismatchError(refusal)
            check = require_base("activate the overlay", manifest)
            base = check.matched
            if check.warning:
                warnings.warn(check.warning, RuntimeWarning, stacklevel=3)
        stock = [
            sys.modules[m.name]
            for m in manifest.runtime_modules
            if m.name in sys.modules and not is_overlay_module(sys.modules[m.name], m)
        ]
        then = dependents(stock, manifest, activating=True)
        refuse_live_instances(stock, manifest, activating=True)
        # NOTE: the finder goes in first, so that a manifest module first imported while the others are
        # swapped (by an overlay module, or another thread) is served from the overlay too. The stock modules
        # of torch that are swapped for fresh ones (``then``) are kept as they are, like the manifest ones.
        finder = OverlayFinder(guard_on_first_use=not check_now, base=base, strict=strict)
        sys.meta_path.insert(0, finder)
        done: list[tuple[str, types.ModuleType, types.ModuleType]] = []
        keep = {id(sys.modules[name]) for names in then.values() for name in names}
        try:
            for current in stock:
                name = current.__name__
                replacement = _serve(current, overlay_spec(name, finder.file_for(name)), manifest)
                _swap(name, current, replacement, manifest, keep)
                done.append((name, current, replacement))
                done += _reexecute(then[name], manifest, keep)
        except BaseException:
            for name, current, replacement in reversed(done):
                _swap(name, replacement, current, manifest)
            for name in list(_originals.grafts):
                _originals.ungraft(name)
            sys.meta_path.remove(finder)
            raise
        _originals.modules.update({name: current for name, current, _ in done})
        if TRACE_RULES in sys.modules:  # else registered when torch.compile first imports it
            _dynamo_rules.register(sys.modules[TRACE_RULES])


def deactivate() -> None:
    """Restore stock torch in this process exactly; a no-op when the overlay is not active."""
    with _originals.lock:
        finder = installed_finder()
        if finder is None:
            return
        manifest = load_manifest()
        ours = [
            sys.modules[m.name]
            for m in manifest.runtime_modules
            if m.name in sys.modules and is_overlay_module(sys.modules[m.name], m)
        ]
        then = dependents(ours, manifest, activating=False)
        refuse_live_instances(ours, manifest, activating=False)
        done: list[tuple[str, types.ModuleType, types.ModuleType]] = []
        removed: list[tuple[str, types.ModuleType]] = []
        try:
            # NOTE: forward (dependency) order, so that a stock module executed afresh here imports the
            # stock versions of the manifest modules before it, never the overlay ones (and torch's modules
            # that subclass a module's classes right after it, for the same reason).
            new_modules = {m.name for m in manifest.runtime_modules if m.new}
            for current in ours:
                name = current.__name__
                if name in new_modules:  # no stock module: stock torch has none
                    _remove(name, current)
                    removed.append((name, current))
                    continue
                original = _originals.modules.get(name) or _originals.execute(name, _originals.stock_spec(name))
                _swap(name, current, original, manifest)
                done.append((name, current, original))

                done += _reexecute(then[name], manifest)
        except BaseException:
            for name, current in removed:
                sys.modules[name] = current
                parent_name, _, child = name.rpartition(".")
                setattr(sys.modules[parent_name], child, current)
            for name, current, original in reversed(done):
                _swap(name, original, current, manifest)
            raise
        for name in list(_originals.grafts):  # the stock classes get their own namespaces back
            _originals.ungraft(name)
        sys.meta_path.remove(finder)
        _originals.modules.clear()
        if TRACE_RULES in sys.modules:
            _dynamo_rules.unregister(sys.modules[TRACE_RULES])


def require_active() -> None:
    """Raise :class:`NotActiveError` unless this process runs the change: the overlay active, its base matched and
    no replaced module left stock, or fork mode applied to the installed torch. The message names the cause and
    its fix (for a torch changed under the start-up hook, the reinstall that the base check names)."""
    fix = (
        "Activate it before building models: `python -m torch_overlay.activate` (every process) or "
        "`torch_overlay.activate()`; `python -m torch_overlay.activate --status` says what is served."
    )
    with _originals.lock:
        finder = installed_finder()
        if finder is None:
            try:
                off, env_error = env_mode() is EnvMode.OFF, None
            except EnvValueError as e:  # not activated either: say both
                off, env_error = False, str(e).removeprefix("torch_overlay: ")
            reason = f"{ENV_VAR}={os.environ[ENV_VAR]} turns it off" if off else "it was not activated"
            if off:
                fix = f"Unset {ENV_VAR}; `python -m torch_overlay.activate --status` says what is served."
            if env_error is not None:
                reason += f", and {env_error}"
        elif finder.verify() is not None:
            reason = "" if finder.fork_mode else f"it stood down: {finder.disabled_reason}"
            fix = finder.disabled_fix or fix
        else:
            stock = [name for name, state in process_state().modules if state is ModuleState.STOCK]
            reason = f"{', '.join(stock)} stayed stock" if stock else ""
    if not reason or _fork.active_state() is not None:
        return
    raise NotActiveError(f"torch_overlay: the overlay is not active in this process: {reason}. {fix}")


def process_state() -> ProcessState:
    with _originals.lock:
        manifest = load_manifest()
        modules = []
        for overlay in manifest.runtime_modules:
            module = sys.modules.get(overlay.name)
            if module is None:
                state = ModuleState.NOT_IMPORTED
            elif is_overlay_module(module, overlay):
                state = ModuleState.OVERLAY
            else:
                state = ModuleState.STOCK
            modules.append((overlay.name, state))
        finder = installed_finder()
        disabled = finder.disabled_reason if finder is not None else None
        fix = finder.disabled_fix if finder is not None else None
        checked = finder is not None and finder.base_checked
        return ProcessState(finder is not None and disabled is None, checked, disabled, fix, tuple(modules))


def _serve(stock: types.ModuleType, spec: ModuleSpec | None, manifest: Manifest) -> types.ModuleType:
    """The overlay module for the stock module ``stock``, executed from ``spec`` (onto its classes, for a module
    served with ``keep_classes``)."""
    name = stock.__name__
    if not any(m.name == name and m.keep_classes for m in manifest.runtime_modules):
        return _originals.execute(name, spec)
    module = importlib.util.module_from_spec(spec)
    _originals.grafts[name] = _graft.execute_onto(stock, module, spec.loader.exec_module)
    return module


def _remove(name: str, module: types.ModuleType) -> None:
    """Take a new module (one stock torch does not have) out of ``sys.modules`` and its parent package."""
    del sys.modules[name]
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is not None and getattr(parent, child, None) is module:
        delattr(parent, child)


def _reexecute(
    names: list[str], manifest: Manifest, keep: set[int] = frozenset()
) -> list[tuple[str, types.ModuleType, types.ModuleType]]:
    """Swap each torch module in ``names`` for its original (on deactivation) or a fresh stock execution.

    A fresh package gets the submodule attributes of the one it replaces (the import system set those when
    each submodule was first imported), each bound to the submodule now in ``sys.modules``.
    """
    done = []
    try:
        for name in names:
            current = sys.modules[name]
            new = _originals.modules.get(name)
            if new is None:
                new = _originals.execute(name, _originals.stock_spec(name))
                for attr in set(vars(current)) - set(vars(new)):
                    was = getattr(current, attr)
                    if isinstance(was, types.ModuleType) and was.__name__ == f"{name}.{attr}":
                        setattr(new, attr, sys.modules.get(was.__name__, was))
            _swap(name, current, new, manifest, keep)
            done.append((name, current, new))
    except BaseException:
        for name, current, new in reversed(done):
            _swap(name, new, current, manifest)
        raise
    return done


def _swap(
    name: str, old: types.ModuleType, new: types.ModuleType, manifest: Manifest, keep: set[int] = frozenset()
) -> None:
    """Make ``new`` the module ``name`` everywhere ``old`` was: sys.modules, its parent, and every global.

    A global is rebound when it is ``old`` itself or a function/class defined in ``old`` that ``new`` also
    defines. The manifest modules' own namespaces are left alone so that original objects stay pristine, and
    so are the modules in ``keep`` (by id: torch's modules that are swapped next, see :func:`dependents`).
    """
    sys.modules[name] = new
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is not None and id(parent) not in keep and getattr(parent, child, None) is old:
        setattr(parent, child, new)
    replacements: dict[int, tuple[object, object]] = {id(old): (old, new)}
    new_globals = vars(new)
    for attr, value in vars(old).items():
        if (
            isinstance(value, (types.FunctionType, type))
            and getattr(value, "__module__", None) == name
            and attr in new_globals
        ):
            replacements[id(value)] = (value, new_globals[attr])
        # NOTE: a module-level list that other modules register into stays one object, or what was registered
        # before the swap is lost: DTensor appends itself to `_foreach_utils._foreach_supported_types` when
        # imported. ``new`` takes ``old``'s list when that holds every entry of its own.
        fresh = new_globals.get(attr)
        if type(value) is list and type(fresh) is list and not attr.startswith("__") and all(x in value for x in fresh):
            new_globals[attr] = value
    untouchable = {id(old), id(new)} | {id(m) for m in _originals.modules.values()} | set(keep)
    untouchable |= {id(sys.modules.get(m.name)) for m in manifest.runtime_modules}
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or id(module) in untouchable:
            continue
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            hit = replacements.get(id(value))
            if hit is not None and hit[0] is value:
                namespace[attr] = hit[1]
