"""Where the inputs of the patch tools live: a project root with the manifest, the overlay, series.toml, tests.

The tools take a :class:`Project` instead of reading fixed paths so that their tests can run them on a
synthetic project in a temporary directory.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from torch_overlay._manifest import BASES_DIR, Manifest, load_manifest

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Project:
    root: Path

    @property
    def manifest_path(self) -> Path:
        return self.root / "torch_overlay" / "manifest.json"

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def series_toml(self) -> Path:
        return self.patches_dir / "series.toml"

    @property
    def pyproject(self) -> Path:
        return self.root / "pyproject.toml"

    def manifest(self) -> Manifest:
        return load_manifest(self.manifest_path)

    def declared_requirement(self) -> str | None:
        """A ``torch`` requirement in pyproject.toml's ``[project] dependencies`` (there must be none), or None."""
        try:
            deps = tomllib.loads(self.pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return None
        return next((d for d in deps if re.match(r"torch\b", d)), None)

    def overlay_file(self, path: str) -> Path:
        """Our version of upstream file ``path`` (``torch/...``)."""
        return self.root / "torch_overlay" / path

    @property
    def bases_dir(self) -> Path:
        """The per-base payloads (``torch_overlay/bases/<version>/torch/...``, see :mod:`tools.transplant`)."""
        return self.root / "torch_overlay" / BASES_DIR

    def base_payload_file(self, version: str, path: str) -> Path:
        """Our version of upstream file ``path`` for the bases that ship ``version``'s file."""
        return self.bases_dir / version / path

    def overlay_files(self) -> dict[str, bytes]:
        return {m.path: self.overlay_file(m.path).read_bytes() for m in self.manifest().modules}

    def repo_file(self, path: str) -> Path:
        """A file at its PyTorch-checkout path in this repo (``test/...``)."""
        return self.root / path

    def upstream_edit_file(self, path: str, patch: str | None = None) -> Path:
        """The diff of upstream test file ``path``: ``<path>.diff`` where one patch edits it, else each
        patch's own ``<path>.<patch>.diff`` (:func:`tools.series.edit_owner`)."""
        return self.root / "test" / "upstream_edits" / (path + (f".{patch}" if patch else "") + ".diff")


def default_project() -> Project:
    return Project(REPO_ROOT)
