"""The start-up hook: what the ``.pth`` file of a persistent install (and the test suite's boot directory)
runs in every new interpreter, as the ``TORCH_OVERLAY`` variable (:mod:`torch_overlay._env`) says.

It must never break interpreter start-up, must not import torch, and must cost next to nothing in programs
that never use torch, so it only puts the overlay's finder in place; the base is verified at the first import
of a replaced module (see ``_finder.OverlayFinder``).
"""

from __future__ import annotations

import sys
import warnings

from torch_overlay._env import EnvMode, EnvValueError, env_mode
from torch_overlay._finder import OverlayFinder, installed_finder


def boot() -> None:
    """Activate the overlay lazily as ``TORCH_OVERLAY`` says; warns at most once.

    It raises only where the variable asks for failure: under ``TORCH_OVERLAY=require``, a replaced module imported
    before the hook ran and a torch the overlay cannot serve. An invalid value leaves start-up alone: the first
    import of a replaced module ends the process with one line naming the values it takes (exit status 1).
    """
    try:
        mode = env_mode()
    except EnvValueError as e:
        if installed_finder() is None:
            sys.meta_path.insert(0, OverlayFinder.refusing(str(e)))
        return
    if mode is EnvMode.OFF:
        return
    strict = mode is EnvMode.REQUIRE
    try:
        finder = OverlayFinder(guard_on_first_use=True, strict=strict)
        if any(name in sys.modules for name in finder.module_names):
            # Imported before the hook ran (a test runner's plugins, say): swap them, checking the base now.
            from torch_overlay._loader import activate

            activate(guard_on_first_use=True, strict=strict)
        elif installed_finder() is None:
            sys.meta_path.insert(0, finder)
    except Exception as e:  # start-up must go on whatever happened, unless the user asked for failure
        if strict:
            raise
        warnings.warn(
            f"torch_overlay: the start-up hook did not activate the overlay: {e}", RuntimeWarning, stacklevel=2
        )
