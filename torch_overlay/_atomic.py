"""Writing a file so that a reader sees either the old content or the new, never a half-written file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(target: Path, content: bytes, mode: int | None = None) -> None:
    """Write ``content`` to a temporary sibling, then rename it over ``target``.

    ``mode``: the new file's permissions; None keeps the target's, or 0644 for a new file.

    NOTE: mkstemp creates 0600, and tools that skip files they cannot read do so without a word (``site``
    skips such a ``.pth``): the mode is always set explicitly.
    """
    if mode is None:
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
