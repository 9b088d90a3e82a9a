"""The ``TORCH_OVERLAY`` variable: what it asks of a process, read by the start-up hook, ``activate()`` and
``--status``. Standard library only, imported by the start-up hook into every interpreter.
"""

from __future__ import annotations

import enum
import os

ENV_VAR = "TORCH_OVERLAY"
ON_VALUES = ("1", "on", "true", "yes")
"""``TORCH_OVERLAY`` values (any case) that mean the default, as unset: the spellings of "on" users try first."""
OFF_VALUES = ("0", "off", "false", "no")
"""``TORCH_OVERLAY`` values (any case) that turn the overlay off for a process and the children that inherit it."""
REQUIRE_VALUE = "require"
"""The strict value: where the overlay cannot be served, the first import of a replaced module raises."""


class EnvMode(enum.Enum):
    """What ``TORCH_OVERLAY`` asks of this process."""

    DEFAULT = "default"
    """Unset, empty or one of :data:`ON_VALUES`: the overlay serves where activated; a torch it cannot serve runs
    stock, with a warning."""
    OFF = "off"
    REQUIRE = "require"


class EnvValueError(ValueError):
    """``TORCH_OVERLAY`` holds a value the overlay does not take."""


def env_mode() -> EnvMode:
    """The mode ``TORCH_OVERLAY`` sets; raises :class:`EnvValueError`, naming the values it takes, for any other."""
    raw = os.environ.get(ENV_VAR)
    value = (raw or "").strip().lower()
    if not value or value in ON_VALUES:
        return EnvMode.DEFAULT
    if value in OFF_VALUES:
        return EnvMode.OFF
    if value == REQUIRE_VALUE:
        return EnvMode.REQUIRE
    raise EnvValueError(
        f"torch_overlay: {ENV_VAR}={raw!r} is not a value it takes: unset or {', '.join(ON_VALUES)} (the overlay "
        f"serves where it is activated), {', '.join(OFF_VALUES)} (stock torch), or {REQUIRE_VALUE} (raise where it "
        "cannot serve)"
    )
