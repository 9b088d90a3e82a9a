"""The pristine base: the upstream files the overlay replaces, exactly as the pinned torch wheel ships them.

Nothing upstream is committed to this repo. The base is read from a torch wheel (a zip), from a directory
laid out like site-packages (``<dir>/torch/...``), or from the installed torch; when fork mode has patched
the installed torch, from the originals fork mode saved. Whatever the source, every file is verified
against the manifest's ``base_sha256`` before it is used.

When the installed torch is not the base, a local wheel cache serves as a fallback if the environment names
one: ``TORCH_OVERLAY_WHEEL_CACHE=DIR`` (a directory holding ``torch-<version>+...whl``; unset by default).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from torch_overlay import _fork
from torch_overlay._guard import find_torch_dir
from torch_overlay._manifest import Manifest, sha256_hex

WHEEL_CACHE_ENV = "TORCH_OVERLAY_WHEEL_CACHE"


class BaseSourceError(RuntimeError):
    """The pristine base cannot be read, or a file is not the one recorded in the manifest."""


def read_paths(source: Path, paths: list[str]) -> dict[str, bytes]:
    """Files by site-packages path (``torch/...``) from a wheel or a site-packages-like directory."""
    if source.is_file():
        try:
            with zipfile.ZipFile(source) as wheel:
                return {p: wheel.read(p) for p in paths}
        except (zipfile.BadZipFile, KeyError) as e:
            raise BaseSourceError(f"{source}: not a torch wheel holding {', '.join(paths)} ({e})") from e
    files = {}
    for p in paths:
        try:
            files[p] = (source / p).read_bytes()
        except OSError as e:
            raise BaseSourceError(f"{source}: cannot read {p} ({e.strerror})") from e
    return files


def read_files(manifest: Manifest, source: Path) -> dict[str, bytes]:
    """The manifest's files from a wheel or a site-packages-like directory, unverified."""
    return read_paths(source, [m.path for m in manifest.modules])


def verify(manifest: Manifest, files: dict[str, bytes], source: object) -> dict[str, bytes]:
    problems = []
    for m in manifest.modules:
        found = sha256_hex(files[m.path])
        if found != m.base_sha256:
            problems.append(f"  - {m.path}: sha256 {found}, expected {m.base_sha256}")
    if problems:
        raise BaseSourceError(
            f"{source} is not the pristine base torch {manifest.version}:\n" + "\n".join(problems) + "\n"
            f"Pass the torch {manifest.version} wheel with --wheel, or reinstall it with "
            f"`pip install --force-reinstall --no-deps torch=={manifest.version}`."
        )
    return files


def cached_wheel(manifest: Manifest) -> Path | None:
    """A wheel of the base version in the wheel cache named by ``$TORCH_OVERLAY_WHEEL_CACHE``, if any."""
    cache = os.environ.get(WHEEL_CACHE_ENV)
    if not cache:
        return None
    return next(iter(sorted(Path(cache).glob(f"{manifest.package}-{manifest.version}[-+]*.whl"))), None)


def pristine_base(manifest: Manifest, source: Path | None = None) -> dict[str, bytes]:
    """The verified base files, by manifest path. ``source``: a wheel or a directory; None = installed torch.

    The installed torch serves when it is the base; in fork mode its saved originals do; otherwise the
    base version's wheel from ``$TORCH_OVERLAY_WHEEL_CACHE``, if set.
    """
    if source is not None:
        return verify(manifest, read_files(manifest, source), source)
    torch_dir = find_torch_dir()
    state = _fork.read_state(torch_dir)
    if state is not None:
        originals = _fork.originals_dir(torch_dir)
        return verify(manifest, read_files(manifest, originals), f"fork mode's saved originals {originals}")
    installed = read_files(manifest, torch_dir.parent)
    try:
        return verify(manifest, installed, f"the installed torch at {torch_dir}")
    except BaseSourceError:
        wheel = cached_wheel(manifest)
        if wheel is None:
            raise
        return verify(manifest, read_files(manifest, wheel), wheel)
