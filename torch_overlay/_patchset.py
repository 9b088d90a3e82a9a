"""The generated series on disk (``patches/series`` and its patch files), and applying it with ``git apply``.

``patches/series`` is the upstream series, made for the newest base. A base that needs more (a backport of a
fix that upstream made after it) has its own index, ``patches/series-<version>``, over the same patch files.
One reader of those indexes and one "scratch tree + ``git apply`` in order" for their users: fork mode
(which applies the ``torch/...`` parts to the installed torch), the sync check (which compares the result
with the overlay), the stack check (which applies every prefix) and the ghstack export (which ``git am``s the
files in order).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

from torch_overlay import _git

SERIES_FILE = "series"


class SeriesMissingError(RuntimeError):
    """``patches/series`` or a patch it lists cannot be read; the message says what to do."""


class PatchApplyError(RuntimeError):
    """A patch of the series does not ``git apply`` onto the state left by the ones before it."""

    def __init__(self, patch: Path, stderr: str) -> None:
        super().__init__(f"{patch.name} does not apply: {stderr}")
        self.patch = patch
        self.stderr = stderr


def series_index(patches_dir: Path, base_version: str | None = None) -> Path:
    """The index of a base's series: ``series-<version>`` where the base has one, else ``series``."""
    own = patches_dir / f"{SERIES_FILE}-{base_version}"
    return own if base_version is not None and own.is_file() else patches_dir / SERIES_FILE


def read_series(patches_dir: Path, base_version: str | None = None) -> list[Path]:
    """The patch files of a base's series (None: the upstream series) in order; each is checked to exist."""
    index = series_index(patches_dir, base_version)
    try:
        names = index.read_text(encoding="utf-8").split()
    except OSError as e:
        raise SeriesMissingError(f"{index}: cannot read the patch series ({e.strerror}); run `make patches`") from e
    missing = [name for name in names if not (patches_dir / name).is_file()]
    if missing:
        raise SeriesMissingError(f"{index}: lists {', '.join(missing)}, missing in {patches_dir}; run `make patches`")
    return [patches_dir / name for name in names]


def apply_series(
    base: dict[str, bytes], patch_files: Iterable[Path], apply_args: Iterable[str] = ()
) -> dict[str, bytes]:
    """Every file of a scratch tree holding ``base`` after ``git apply [apply_args]`` of each patch in order.

    Raises :class:`PatchApplyError` naming the first patch that does not apply. The result holds the base's
    paths and whatever the patches added (by POSIX path relative to the tree).
    """
    args = list(apply_args)
    with tempfile.TemporaryDirectory(prefix="torch-overlay-apply-") as tmp:
        tree = Path(tmp)
        _git.git(tree, "init", "--quiet")
        for path, content in base.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(content)
        for patch in patch_files:
            proc = _git.run(tree, "apply", *args, str(patch.resolve()))
            if proc.returncode != 0:
                raise PatchApplyError(patch, proc.stderr.decode("utf-8", "replace").strip())
        return {
            f.relative_to(tree).as_posix(): f.read_bytes()
            for f in sorted(tree.rglob("*"))
            if f.is_file() and ".git" not in f.relative_to(tree).parts[:1]
        }
