"""The start-up hook: what the ``.pth`` file of a persistent install (and the test suite's boot directory)
runs in every new interpreter.

It must never break interpreter start-up, must not import torch, and must cost next to nothing in programs
that never use torch, so it only puts the overlay's finder in place; the base is verified at the first import
of a replaced module (see ``_finder.OverlayFinder``).
"""

from __future__ import annotations

import os
import sys
import warnings

from torch_overlay._finder import OverlayFinder, installed_finder

ENV_VAR = "TORCH_OVERLAY"


def disabled_by_env() -> bool:
    """``TORCH_OVERLAY=0`` turns the overlay off for one process (and the children that inherit it)."""
    return os.environ.get(ENV_VAR, "").strip() == "0"


def boot() -> None:
    """Activate the overlay lazily unless ``TORCH_OVERLAY=0``; never raises, warns at most once."""
    if disabled_by_env():
        return
    try:
        finder = OverlayFinder(guard_on_first_use=True)
        if any(name in sys.modules for name in finder.module_names):
            # Imported before the hook ran (a test runner's plugins, say): swap them, checking the base now.
            from torch_overlay._loader import activate

            activate(guard_on_first_use=True)
        elif installed_finder() is None:
            sys.meta_path.insert(0, finder)
    except Exception as e:  # start-up must go on whatever happened
        warnings.warn(
            f"torch_overlay: the start-up hook did not activate the overlay: {e}", RuntimeWarning, stacklevel=2
        )
