"""torch-overlay: fixes for TP + DDP composability and FSDP unsharding, served into a stock torch.

``activate()`` puts our versions of the upstream modules that ``manifest.json`` lists in place in this process
(before or after torch was imported), ``deactivate()`` restores the stock objects exactly, ``status()`` says
what is active, and ``require_active()`` raises unless the change serves this process. For every process of an
environment, use ``python -m torch_overlay.activate`` instead; ``TORCH_OVERLAY`` (unset or ``1``, ``on``,
``true``, ``yes``: the default; ``0``, ``off``, ``false``, ``no``: off; ``require``: strict) rules both. The
modules served and the torch releases (bases) they serve, read from the manifest when this package is
imported, close this docstring.

Importing this package never imports torch, and imports the machinery only when it is used: the start-up hook
of a persistent install imports this package in every interpreter of the environment.
"""

from __future__ import annotations

import os
import warnings

from torch_overlay._env import ENV_VAR, EnvMode, EnvValueError, env_mode
from torch_overlay._manifest import load_manifest

__version__ = "0.3.0.dev0"
"""The package's version (pyproject.toml reads it here); CHANGELOG.md says what each version changed."""

__all__ = [
    "__version__",
    "activate",
    "BaseMismatchError",
    "deactivate",
    "EnvValueError",
    "ForkError",
    "GraftError",
    "LiveInstancesError",
    "NotActiveError",
    "NotServedError",
    "OverlayStatus",
    "require_active",
    "status",
    "SubclassedError",
]


def activate() -> None:
    """Activate the overlay in this process; idempotent and thread-safe.

    Raises, having changed nothing, :class:`BaseMismatchError` when the installed torch is not the base recorded
    in the manifest, and :class:`SubclassedError` when a class the overlay serves (``DistributedDataParallel``)
    was already subclassed outside torch. ``TORCH_OVERLAY=0`` (or ``off``, ``false``, ``no``) in the environment
    wins: it leaves stock torch in place (with a warning), so one variable is enough to rule the overlay out while
    debugging. Any value of it but those, ``1``, ``on``, ``true``, ``yes``, ``require`` and none raises
    :class:`EnvValueError` (a ``ValueError``), naming the values it takes.
    """
    if env_mode() is EnvMode.OFF:
        warnings.warn(_off_warning(), RuntimeWarning, stacklevel=2)
        return
    from torch_overlay._loader import activate as activate_in_process

    activate_in_process()


def require_active() -> None:
    """Raise :class:`NotActiveError` unless the overlay's change serves this process: one line at the top of a
    training script, so that a rank where the overlay is off, stood down or was activated too late fails instead of
    training on stock torch. Fork mode (the change applied in place to torch) counts as serving."""
    from torch_overlay._loader import require_active as require

    require()


def _off_warning() -> str:
    from torch_overlay import _fork

    warning = f"torch_overlay.activate() ignored: {ENV_VAR}={os.environ[ENV_VAR]} is set"
    if _fork.active_state() is not None:
        warning += (
            "; but fork mode is applied to the installed torch, and the variable does not turn it off: this process "
            "runs the patched files (`torch-overlay revert-patches` restores stock torch)"
        )
    return warning


def deactivate() -> None:
    """Restore every stock module object and binding in this process; idempotent and thread-safe.

    Raises :class:`SubclassedError`, having changed nothing, when a class the overlay serves was subclassed
    outside torch while it was active.
    """
    from torch_overlay._loader import deactivate as deactivate_in_process

    deactivate_in_process()


def _served() -> str:
    """What the manifest says is served, and on which bases (the end of this package's docstring)."""
    try:
        manifest = load_manifest()  # already loaded by the start-up hook's finder: no cost there
    except RuntimeError as e:
        return f"\n(The manifest cannot be read: {e}.)\n"
    lines = [f"\nBases: torch {', '.join(manifest.versions)}. Served at run time:\n"]
    lines += [f"- ``{m.path}``{' (a new module)' if m.new else ''}\n" for m in manifest.runtime_modules]
    for m in manifest.modules:
        if not m.runtime:
            lines.append(f"Changed in docstrings only, in fork mode and the series, not served: ``{m.path}``.\n")
    return "".join(lines)


__doc__ = (__doc__ or "") + _served()


def __getattr__(name: str) -> object:
    # NOTE: lazy (PEP 562), so that importing the package from the start-up hook stays cheap.
    if name == "BaseMismatchError":
        from torch_overlay._guard import BaseMismatchError

        return BaseMismatchError
    if name in ("LiveInstancesError", "NotActiveError", "SubclassedError"):
        from torch_overlay import _loader

        return getattr(_loader, name)
    if name == "ForkError":
        from torch_overlay._fork import ForkError

        return ForkError
    if name == "GraftError":
        from torch_overlay._graft import GraftError

        return GraftError
    if name == "NotServedError":
        from torch_overlay._finder import NotServedError

        return NotServedError
    if name in ("OverlayStatus", "status"):
        from torch_overlay import _status

        return getattr(_status, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
