"""The import finder that serves the overlay modules under their upstream names.

This is all that the start-up hook of a persistent install loads into every interpreter, so it imports only
what a bare interpreter has already loaded (plus ``json``): the heavier machinery (the version guard, fork
mode) is imported on the first import of a replaced module, when torch is being imported anyway.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import types
import warnings
from importlib.machinery import ModuleSpec

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def overlay_files() -> dict[str, str]:
    """Module name -> our file for the modules served at run time, in the manifest's (dependency) order."""
    with open(os.path.join(PACKAGE_DIR, "manifest.json"), encoding="utf-8") as f:
        modules = json.load(f)["modules"]
    return {m["name"]: os.path.join(PACKAGE_DIR, *m["path"].split("/")) for m in modules if m.get("runtime", True)}


class OverlayFinder:
    """A ``sys.meta_path`` finder: our file for each manifest module, the normal finders for everything else.

    With ``guard_on_first_use`` (the start-up hook, which must not touch torch), the base is verified at the
    first import of a manifest module instead of at activation; on a mismatch the finder stands down with
    one warning, and the process runs stock torch.
    """

    def __init__(self, guard_on_first_use: bool) -> None:
        self._files = overlay_files()
        self._guard_pending = guard_on_first_use
        self._guard_lock = threading.Lock()
        self.disabled_reason: str | None = None

    @property
    def module_names(self) -> tuple[str, ...]:
        """The modules this finder serves."""
        return tuple(self._files)

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
                    from torch_overlay._loader import stand_down_reason

                    try:
                        self.disabled_reason = stand_down_reason()
                    except Exception as e:  # the user's import must go on, on stock torch
                        self.disabled_reason = f"the base check failed: {e!r}"
                    self._guard_pending = False
                    if self.disabled_reason is not None:
                        warnings.warn(
                            "torch_overlay: the overlay is NOT active in this process, the installed torch is "
                            f"not its base: {self.disabled_reason}. "
                            "Run `python -m torch_overlay.activate --status`.",
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
        overlay_file = self._files.get(fullname)
        if overlay_file is None or self.verify() is not None:
            return None
        return overlay_spec(fullname, overlay_file)


def overlay_spec(name: str, overlay_file: str) -> ModuleSpec | None:
    import importlib.util  # here, not at start-up: it pulls in contextlib, functools, collections

    return importlib.util.spec_from_file_location(name, overlay_file)


def installed_finder() -> OverlayFinder | None:
    """The finder on ``sys.meta_path``, if the overlay is active in this process."""
    return next((f for f in sys.meta_path if isinstance(f, OverlayFinder)), None)
