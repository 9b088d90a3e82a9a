"""The version guard: is the installed torch one of the bases the overlay was made from?

Every way of applying the change (in-process, persistent, fork mode) replaces whole upstream files, so it is
only correct on the exact files it was made from. The guard reads the installed torch's version and the
sha256 of every replaced file and matches them against the bases of the manifest, before anything is
changed. It never imports torch: it reads files, so it is cheap enough for the first import of a replaced
module.

A release the manifest does not list, but whose replaced files are all exactly those of a listed base, is
served as that base with a one-line warning: the overlay replaces only those files, and they are the ones it
was made from. Anything else is refused, saying which files differ.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from torch_overlay._manifest import Base, Manifest, hash_mismatches, load_manifest, sha256_of, version_key

_VERSION_RE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


class BaseMismatchError(RuntimeError):
    """The installed torch is not a base recorded in the manifest; nothing was changed."""


def reinstall_hint(version: str) -> str:
    """The command that puts back a release's pristine files (local edits included)."""
    return f"`pip install --force-reinstall --no-deps torch=={version}`"


@dataclass(frozen=True)
class BaseCheck:
    """What the guard found: the installed torch, its version and each replaced file against the bases."""

    manifest: Manifest
    found_version: str | None
    torch_dir: Path
    found: dict[str, str | None]
    """Manifest path -> sha256 of the installed file, None when it is missing."""

    @property
    def listed(self) -> Base | None:
        """The listed base of the installed version, whether or not its files match."""
        return self.manifest.base(self.found_version)

    @property
    def matched(self) -> Base | None:
        """The base the overlay serves this torch as; None when it must refuse.

        The listed base of the installed version when its files match; for an unlisted version, of the bases
        whose files are all identical, the newest not newer than it (its series carries the backports a release
        of that age needs), else the oldest.
        """
        if self.listed is not None:
            return self.listed if not hash_mismatches(self.listed.sha256, self.found) else None
        same = self.manifest.bases_with_files(self.found)
        if not same or self.found_version is None:
            return same[0] if same else None
        found = version_key(self.found_version)
        return next((b for b in same if version_key(b.version) <= found), same[-1])

    @property
    def ok(self) -> bool:
        return self.matched is not None

    @property
    def warning(self) -> str | None:
        """One line when an unlisted release is served because its files are those of a listed base."""
        matched = self.matched
        if matched is None or self.listed is not None:
            return None
        return (
            f"torch_overlay: torch {self.found_version} is not a listed base, but its {len(self.found)} replaced "
            f"files are exactly those of torch {matched.version}, so the overlay serves it as {matched.version}; "
            "add the release with `make rebase UPSTREAM=<its wheel>` in a torch-overlay checkout"
        )

    def summary(self) -> str:
        """What ``status`` prints on its ``base:`` line."""
        n = len(self.found)
        if self.listed is not None:
            verdict = "matches" if self.ok else "MISMATCH"
            return f"torch {self.listed.version}, {n} files: {verdict}"
        if self.ok:
            return f"torch {self.matched.version} (files of {self.found_version}, not listed), {n} files: matches"
        return f"torch {self.found_version} is not a listed base ({', '.join(self.manifest.versions)}): MISMATCH"

    def problems(self) -> list[str]:
        """One line per problem, naming the version or the file, what was expected and what was found."""
        if self.ok:
            return []
        here = f"torch {self.found_version} at {self.torch_dir}"
        if self.listed is not None:
            lines = [f"{here}: its replaced files are not those of the torch {self.listed.version} release"]
            return lines + hash_mismatches(self.listed.sha256, self.found)
        nearest = max(
            reversed(self.manifest.bases), key=lambda b: sum(self.found.get(p) == h for p, h in b.sha256.items())
        )
        lines = [
            f"{here} is not a listed base ({', '.join(self.manifest.versions)}), and its replaced files are not "
            f"all those of any base; compared with the nearest, torch {nearest.version}:"
        ]
        return lines + hash_mismatches(nearest.sha256, self.found)

    def fix(self) -> str:
        """The command that gets a user out of a mismatch."""
        if self.listed is not None:
            return f"Reinstall torch with {reinstall_hint(self.listed.version)} (this also undoes local edits)."
        return (
            f"Install a supported release (`pip install torch=={self.manifest.payload_base.version}`), or add "
            "this one in a torch-overlay checkout with `make rebase UPSTREAM=<its wheel or site-packages>` "
            "(docs/patches.md, 'Add a torch release')."
        )


def find_torch_dir() -> Path:
    """The installed ``torch`` package directory, found without importing torch.

    NOTE: absolute, not resolved: a torch tree made of symlinks is checked where it is imported from.
    """
    module = sys.modules.get("torch")
    if module is not None and getattr(module, "__file__", None):
        return Path(os.path.abspath(module.__file__)).parent
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        versions = load_manifest().versions
        raise BaseMismatchError(
            f"torch_overlay: torch is not installed for {sys.executable}. Install one of the releases it serves "
            f"first, {', '.join(versions[:-1])} or {versions[-1]}: `pip install torch==<version>`."
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
    """Compare an installed torch with the manifest's bases; reads files only, changes nothing."""
    manifest = manifest or load_manifest()
    torch_dir = torch_dir or find_torch_dir()
    found = {}
    for module in manifest.modules:
        upstream = module.upstream_file(torch_dir)
        found[module.path] = sha256_of(upstream) if os.path.isfile(upstream) else None
    return BaseCheck(manifest, read_torch_version(torch_dir), torch_dir, found)


def require_base(action: str, manifest: Manifest | None = None, torch_dir: Path | None = None) -> BaseCheck:
    """Return the check if a base matches, else raise :class:`BaseMismatchError` saying what to do."""
    check = check_base(manifest, torch_dir)
    if check.ok:
        return check
    details = "\n".join(f"  - {line}" for line in check.problems())
    raise BaseMismatchError(
        f"torch_overlay: refusing to {action}: the installed torch is not a base of the overlay.\n{details}\n"
        f"Nothing was changed. {check.fix()}"
    )
