"""The manifest: which upstream files the overlay replaces, and the base they were taken from.

``manifest.json`` is the single source of truth for the base. The loader reads it to know which modules to
serve from the overlay, the version guard to know what the installed torch must be, and the patch tools to
know what the pristine base is. Nothing else in the project spells out a path, a module name or a hash of
the base.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST_PATH = PACKAGE_DIR / "manifest.json"


@dataclass(frozen=True)
class OverlayModule:
    """One upstream module that the overlay replaces as a whole file."""

    name: str
    """Dotted module name, e.g. ``torch.distributed.fsdp._unshard_param_utils``."""
    path: str
    """POSIX path relative to a PyTorch checkout or to site-packages, e.g. ``torch/distributed/...py``."""
    base_sha256: str
    """sha256 of the upstream file at the base version."""
    runtime: bool = True
    """Served by the runtime overlay. False for a file changed only in its docstrings whose module defines
    classes that live objects are instances of (``FullyShardedDataParallel``): serving a new copy at run time
    would break ``isinstance`` for every model built before activation, for a change no program can observe.
    Such a file is still checked by the guard, patched by fork mode and carried by the upstream series."""

    @property
    def overlay_file(self) -> Path:
        """Our version of the file, inside this package (``torch_overlay/torch/...``)."""
        return PACKAGE_DIR / self.path

    def upstream_file(self, torch_dir: Path) -> Path:
        """The upstream file inside an installed ``torch`` package directory."""
        return torch_dir.parent / self.path


@dataclass(frozen=True)
class Manifest:
    """The base (package and version) and the modules the overlay replaces, in dependency order."""

    package: str
    version: str
    modules: tuple[OverlayModule, ...]

    def module(self, name: str) -> OverlayModule | None:
        return next((m for m in self.modules if m.name == name), None)

    @property
    def runtime_modules(self) -> tuple[OverlayModule, ...]:
        """The modules the runtime overlay serves (see :attr:`OverlayModule.runtime`)."""
        return tuple(m for m in self.modules if m.runtime)


def load_manifest(path: Path = MANIFEST_PATH) -> Manifest:
    """Read and validate ``manifest.json``; a malformed manifest is a bug in this package, said plainly."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        modules = tuple(
            OverlayModule(m["name"], m["path"], m["base_sha256"], m.get("runtime", True)) for m in raw["modules"]
        )
        manifest = Manifest(raw["base"]["package"], raw["base"]["version"], modules)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"torch_overlay: cannot read the manifest {path}: {e!r}") from e
    for m in manifest.modules:
        expected = m.name.replace(".", "/") + ".py"
        if m.path != expected:
            raise RuntimeError(
                f"torch_overlay: manifest {path}: module {m.name} has path {m.path}, expected {expected}"
            )
    return manifest


def sha256_hex(content: bytes) -> str:
    """The hash the manifest records for an upstream file with ``content`` (``base_sha256``)."""
    return hashlib.sha256(content).hexdigest()


def sha256_of(path: Path) -> str:
    return sha256_hex(path.read_bytes())
