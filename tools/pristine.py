"""The pristine bases: the upstream files the overlay replaces, exactly as each supported torch ships them.

Nothing upstream is committed to this repo. A base's files are looked up by content: each must have the sha256
the manifest records for that base, and any source holding such a file serves it (2.14.1's files may come
from a 2.13.0 install where they are identical). The sources, in order: the ``--wheel`` arguments (wheels or
directories laid out like site-packages, ``<dir>/torch/...``); the installed torch, or the originals fork mode
saved when it patched it; the project's base venvs (``.venv/<version>``); the wheels in ``.venv/wheels`` (what
``make sources`` downloads) and in ``$TORCH_OVERLAY_WHEEL_CACHE``.

    python -m tools.pristine [--fetch]   # say which bases are available; --fetch downloads the missing wheels
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tools.project import Project, default_project
from torch_overlay import _fork
from torch_overlay._guard import BaseMismatchError, find_torch_dir
from torch_overlay._manifest import Base, Manifest, sha256_hex

WHEEL_CACHE_ENV = "TORCH_OVERLAY_WHEEL_CACHE"


class BaseSourceError(RuntimeError):
    """A base's pristine files cannot be found, or a given source is not usable; the message says what to do."""


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


def wheel_dir(project: Project) -> Path:
    """Where ``make sources`` puts the wheels of bases whose files no venv here holds."""
    return project.root / ".venv" / "wheels"


def default_sources(project: Project) -> list[Path]:
    """Every place on this machine that may hold pristine files, most trusted first."""
    sources = []
    try:
        torch_dir = find_torch_dir()
    except BaseMismatchError:
        torch_dir = None
    if torch_dir is not None:
        if _fork.read_state(torch_dir) is not None:
            sources.append(_fork.originals_dir(torch_dir))
        sources.append(torch_dir.parent)
    sources += sorted((project.root / ".venv").glob("*/lib/python*/site-packages"))
    sources += sorted(wheel_dir(project).glob("torch-*.whl"))
    cache = os.environ.get(WHEEL_CACHE_ENV)
    if cache:
        sources += sorted(Path(cache).glob("torch-*.whl"))
    return sources


class Pristine:
    """The pristine files of every base, found by sha256 in a list of sources (read lazily, once each)."""

    def __init__(self, manifest: Manifest, sources: list[Path]) -> None:
        self.manifest = manifest
        self.sources = sources
        self._by_hash: dict[str, bytes] = {}
        self._read: set[Path] = set()

    def _find(self, sha256: str) -> bytes | None:
        for source in self.sources:
            if sha256 in self._by_hash:
                break
            if source in self._read:
                continue
            self._read.add(source)
            paths = [m.path for m in self.manifest.modules if not m.new]
            try:
                files = read_paths(source, paths)
            except BaseSourceError:
                files = {}
                for p in paths:  # a directory may hold some of the files
                    try:
                        files.update(read_paths(source, [p]))
                    except BaseSourceError:
                        pass
            for content in files.values():
                self._by_hash.setdefault(sha256_hex(content), content)
        return self._by_hash.get(sha256)

    def missing(self, base: Base) -> list[str]:
        """The paths of ``base`` that no source holds."""
        return [p for p, h in base.upstream.items() if self._find(h) is None]

    def files(self, base: Base) -> dict[str, bytes]:
        """The verified pristine files of ``base``, by manifest path (not the new modules': no release ships
        them); raises naming the missing ones."""
        missing = self.missing(base)
        if missing:
            where = "\n".join(f"    {s}" for s in self.sources) or "    (none)"
            raise BaseSourceError(
                f"the pristine files of torch {base.version} are not on this machine: {', '.join(missing)} (with "
                f"the sha256 manifest.json records) is in none of these sources:\n{where}\n"
                f"Run `make sources` (downloads the missing bases' wheels), or `make install TORCH={base.version}`, "
                f"or pass the torch {base.version} wheel with --wheel (make: WHEEL=)."
            )
        return {p: self._by_hash[h] for p, h in base.upstream.items()}


def pristine(project: Project, extra_sources: list[Path] = ()) -> Pristine:
    """The pristine bases of ``project``, from ``extra_sources`` first, then every default source."""
    for source in extra_sources:
        if not source.exists():
            raise BaseSourceError(f"{source}: no such wheel or directory")
    return Pristine(project.manifest(), list(extra_sources) + default_sources(project))


def fetch(project: Project, bases: list[Base]) -> list[Path]:
    """Download the wheel of each base into ``.venv/wheels`` (pip, no dependencies); returns the wheels."""
    dest = wheel_dir(project)
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("torch-*.whl"))
    for base in bases:
        # NOTE: an exact pin, never a range; the cap some machines put on torch (a pip constraint) is lifted for
        # this download only, as for the base venvs (Makefile).
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(dest)]
        proc = subprocess.run([*command, f"torch=={base.version}"], env={**os.environ, "PIP_CONSTRAINT": os.devnull})
        if proc.returncode != 0:
            raise BaseSourceError(f"pip could not download torch=={base.version}; pass its wheel with --wheel")
    return sorted(set(dest.glob("torch-*.whl")) - before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.pristine", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, action="append", default=[], help="an extra source (repeatable)")
    parser.add_argument("--fetch", action="store_true", help="download the wheels of the bases not available here")
    args = parser.parse_args(argv)
    project = default_project()
    try:
        found = pristine(project, args.wheel)
        missing = [b for b in project.manifest().bases if found.missing(b)]
        if args.fetch and missing:
            fetch(project, missing)
            found = pristine(project, args.wheel)
            missing = [b for b in project.manifest().bases if found.missing(b)]
    except BaseSourceError as e:
        print(f"pristine: {e}", file=sys.stderr)
        return 1
    for base in project.manifest().bases:
        print(f"torch {base.version}: {'MISSING' if base in missing else 'available'}")
    if missing:
        print("Run `make sources` to download the missing bases' wheels.", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
