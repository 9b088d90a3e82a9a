"""The version guard: is the installed torch exactly the base the overlay was made from?

Every way of applying the change (in-process, persistent, fork mode) replaces whole upstream files, so it is
only correct on the exact files it was made from. The guard compares the installed torch's version and the
sha256 of every replaced file with the manifest before anything is changed, and it never imports torch: it
reads files, so it is cheap enough for interpreter start-up.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from torch_overlay._manifest import Manifest, OverlayModule, load_manifest, sha256_of

_VERSION_RE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


class BaseMismatchError(RuntimeError):
    """The installed torch is not the base recorded in the manifest; nothing was changed."""


@dataclass(frozen=True)
class FileCheck:
    module: OverlayModule
    found_sha256: str | None
    """sha256 of the installed upstream file, or None when the file is missing."""

    @property
    def ok(self) -> bool:
        return self.found_sha256 == self.module.base_sha256


@dataclass(frozen=True)
class BaseCheck:
    """What the guard found: the installed torch, its version and each replaced file against the manifest."""

    expected_version: str
    found_version: str | None
    torch_dir: Path
    files: tuple[FileCheck, ...]

    @property
    def version_ok(self) -> bool:
        return self.found_version is not None and public_version(self.found_version) == self.expected_version

    @property
    def ok(self) -> bool:
        return self.version_ok and all(f.ok for f in self.files)

    def problems(self) -> list[str]:
        """One line per problem, naming the file or version, what was expected and what was found."""
        lines = []
        if not self.version_ok:
            lines.append(
                f"torch at {self.torch_dir} is version {self.found_version}, "
                f"the overlay's base is {self.expected_version}"
            )
        for f in self.files:
            if f.found_sha256 is None:
                lines.append(f"{f.module.path}: missing (expected sha256 {f.module.base_sha256})")
            elif not f.ok:
                lines.append(
                    f"{f.module.path}: sha256 {f.found_sha256}, expected {f.module.base_sha256} "
                    "(edited locally, or from another torch version)"
                )
        return lines


def public_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the local build tag names the wheel flavour, not the source."""
    return version.split("+", 1)[0]


def find_torch_dir() -> Path:
    """The installed ``torch`` package directory, found without importing torch.

    NOTE: absolute, not resolved: a torch tree made of symlinks is checked where it is imported from.
    """
    module = sys.modules.get("torch")
    if module is not None and getattr(module, "__file__", None):
        return Path(os.path.abspath(module.__file__)).parent
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise BaseMismatchError(
            f"torch_overlay: torch is not installed for {sys.executable}. "
            "Install the base with `pip install torch==2.13.0`."
        )
    return Path(os.path.abspath(next(iter(spec.submodule_search_locations))))


def read_torch_version(torch_dir: Path) -> str | None:
    """The version recorded in ``torch/version.py`` of that tree (the tree being checked, not the import)."""
    try:
        match = _VERSION_RE.search((torch_dir / "version.py").read_text(encoding="utf-8"))
    except OSError:
        return None
    return match.group(1) if match else None


def check_base(manifest: Manifest | None = None, torch_dir: Path | None = None) -> BaseCheck:
    """Compare an installed torch with the manifest; reads files only, changes nothing."""
    manifest = manifest or load_manifest()
    torch_dir = torch_dir or find_torch_dir()
    files = []
    for module in manifest.modules:
        upstream = module.upstream_file(torch_dir)
        files.append(FileCheck(module, sha256_of(upstream) if upstream.is_file() else None))
    return BaseCheck(manifest.version, read_torch_version(torch_dir), torch_dir, tuple(files))


def require_base(action: str, manifest: Manifest | None = None, torch_dir: Path | None = None) -> BaseCheck:
    """Return the check if the base matches, else raise :class:`BaseMismatchError` saying what to do."""
    check = check_base(manifest, torch_dir)
    if check.ok:
        return check
    details = "\n".join(f"  - {line}" for line in check.problems())
    raise BaseMismatchError(
        f"torch_overlay: refusing to {action}: the installed torch is not the overlay's base.\n{details}\n"
        "Nothing was changed. Install the base with "
        f"`pip install --force-reinstall --no-deps torch=={check.expected_version}` (this also undoes local "
        "edits), or rebase the overlay onto your torch (README, 'Rebase onto a newer torch')."
    )
