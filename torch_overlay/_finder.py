"""The import finder that serves the overlay modules under their upstream names.

This (and the manifest reader, :mod:`torch_overlay._manifest`) is all that the start-up hook of a persistent
install loads into every interpreter, so it imports only what a bare interpreter has already loaded (plus
``json``): the heavier machinery (the version guard, fork mode) is imported on the first import of a replaced
module, when torch is being imported anyway. It never imports the loader, which imports it: what the two share
(the stock objects replaced, for a ``keep_classes`` module first imported while active) is
:mod:`torch_overlay._originals`.
"""

from __future__ import annotations

import sys
import threading
import types
import warnings
from importlib.machinery import ModuleSpec

from torch_overlay._env import ENV_VAR
from torch_overlay._manifest import Base, load_manifest


class NotServedError(RuntimeError):
    """The overlay cannot serve this process, and ``TORCH_OVERLAY`` asks for failure rather than stock torch.

    NOTE: not an ImportError, which code that falls back when an optional module is missing would swallow.
    """


class OverlayFinder:
    """A ``sys.meta_path`` finder: our file for each manifest module, the normal finders for everything else.

    Our file is the one for the installed base (:meth:`~torch_overlay._manifest.Manifest.payload_file`), so the
    finder serves only once the base is known: ``base``, checked by the caller, or with ``guard_on_first_use``
    (the start-up hook, which must not touch torch) the base found at the first import of a manifest module; on
    a mismatch the finder stands down with one warning naming the cause and the fix, and the process runs stock
    torch, or, ``strict``, every import of a replaced module raises :class:`NotServedError`.
    """

    def __init__(self, guard_on_first_use: bool, base: Base | None = None, strict: bool = False) -> None:
        assert guard_on_first_use == (base is None), "a finder serves a checked base, or checks at first use"
        self._manifest = load_manifest()
        self._names = frozenset(m.name for m in self._manifest.runtime_modules)
        self._keep_classes = frozenset(m.name for m in self._manifest.runtime_modules if m.keep_classes)
        self._files = self._manifest.overlay_files(base) if base is not None else {}
        self._guard_pending = guard_on_first_use
        self._guard_lock = threading.Lock()
        self.strict = strict
        """``TORCH_OVERLAY=require``: where the finder stands down, a replaced module's import raises instead."""
        self.disabled_reason: str | None = None
        self.fork_mode = False
        """Stood down because fork mode serves the change from torch's own files (not an error, even if strict)."""
        self.disabled_fix: str | None = None
        """The command that gets the process served again, where the finder stood down on a torch it cannot serve."""
        self.base_warning: str | None = None
        self._refusal: str | None = None
        self._exit = False

    @classmethod
    def refusing(cls, message: str) -> OverlayFinder:
        """A finder that serves nothing: the first import of a replaced module ends the process with ``message``,
        one line on stderr and exit status 1 (an invalid ``TORCH_OVERLAY``, which must not break start-up, nor
        turn ``import torch`` into a traceback through torch's own modules)."""
        finder = cls(guard_on_first_use=True, strict=True)
        finder._guard_pending = False
        finder.disabled_reason = finder._refusal = message
        finder.disabled_fix = f"Set {ENV_VAR} to one of those values, or unset it."
        finder._exit = True
        return finder

    @property
    def module_names(self) -> tuple[str, ...]:
        """The modules this finder serves."""
        return tuple(m.name for m in self._manifest.runtime_modules)

    def file_for(self, name: str) -> str:
        """The file served for manifest module ``name``; only once the base is checked and matched."""
        assert self.verify() is None, "the finder stood down"
        return self._files[name]

    @property
    def base_checked(self) -> bool:
        return not self._guard_pending

    def verify(self) -> str | None:
        """Run the pending base check once (thread-safe); return why the finder stands down, or None.

        Any error in the check itself also makes the finder stand down: serving unchecked files is never the
        fallback.
        """
        if self._guard_pending:
            with self._guard_lock:
                if self._guard_pending:
                    try:
                        check = first_use_check()
                        self.disabled_reason, self.disabled_fix, self.base_warning, base, self.fork_mode = check
                        if base is not None:
                            self._files = self._manifest.overlay_files(base)
                    except Exception as e:  # the user's import must go on, on stock torch (unless strict)
                        self.disabled_reason = f"the base check failed: {e!r}"
                    self._guard_pending = False
                    if self.disabled_reason is None and self.base_warning is not None:
                        warnings.warn(self.base_warning, RuntimeWarning, stacklevel=3)
                    if self.disabled_reason is not None and self.strict and not self.fork_mode:
                        self._refusal = (
                            f"torch_overlay: {ENV_VAR}=require is set, and the overlay cannot serve this process: "
                            f"{self.disabled_reason}. Nothing was served. "
                            f"{self.disabled_fix or 'Fix what `python -m torch_overlay.activate --status` names.'} "
                            f"Or unset {ENV_VAR} to run stock torch (with a warning)."
                        )
                    elif self.disabled_reason is not None:
                        warnings.warn(
                            "torch_overlay: the overlay is NOT active in this process, the installed torch is not "
                            f"one of its bases: {self.disabled_reason}. "
                            f"{self.disabled_fix or 'Run `python -m torch_overlay.activate --status`.'}",
                            RuntimeWarning,
                            stacklevel=3,
                        )
        return self.disabled_reason

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "torch._dynamo.trace_rules" and self.verify() is None:
            from torch_overlay._dynamo_rules import registering_spec

            return registering_spec(fullname, path)
        if fullname not in self._names:
            return None
        if self.verify() is not None:
            if self._refusal is not None and self._exit:
                # NOTE: one line and exit status 1, as Python itself ends on an invalid PYTHON* variable: a
                # NotServedError would be a traceback through torch/__init__.py for a typo in the environment.
                raise SystemExit(self._refusal)
            if self._refusal is not None:
                raise NotServedError(self._refusal)
            return None
        return overlay_spec(fullname, self._files[fullname], onto_stock=fullname in self._keep_classes)


def first_use_check() -> tuple[str | None, str | None, str | None, Base | None, bool]:
    """The base check of a finder installed by the start-up hook: (why it must stand down, the command that
    fixes it, a warning, the base it serves, whether fork mode is why)."""
    from torch_overlay import _fork
    from torch_overlay._guard import check_base

    check = check_base()
    if check.ok:
        return None, None, check.warning, check.matched, False
    if _fork.active_state(check.torch_dir):
        return "fork mode is active (the series is applied in place)", None, None, None, True
    return "; ".join(check.problems()), check.fix(), None, None, False


def overlay_spec(name: str, overlay_file: str, onto_stock: bool = False) -> ModuleSpec | None:
    """The spec of our file for module ``name``; with ``onto_stock`` (a module served with ``keep_classes``, first
    imported while active), its loader executes torch's file first and ours onto its classes."""
    import importlib.machinery  # here, not at start-up: importlib.util pulls in contextlib, functools, collections
    import importlib.util

    class OntoStockLoader(importlib.machinery.SourceFileLoader):
        def exec_module(self, module: types.ModuleType) -> None:
            from torch_overlay._originals import exec_onto_stock

            exec_onto_stock(module, super().exec_module)

    loader = OntoStockLoader(name, overlay_file) if onto_stock else None
    return importlib.util.spec_from_file_location(name, overlay_file, loader=loader)


def installed_finder() -> OverlayFinder | None:
    """The finder on ``sys.meta_path``, if the overlay is active in this process."""
    return next((f for f in sys.meta_path if isinstance(f, OverlayFinder)), None)
