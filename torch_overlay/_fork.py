"""Fork mode: the patch series applied in place to the installed torch, and taken out again byte for byte.

Like patch-package, the steps are separate and remembered: ``apply()`` checks everything first (base hashes,
no persistent overlay, a writable tree, every patch applies), saves the original files and a state file in
``<site-packages>/torch-overlay-fork/``, then replaces each file atomically, so re-applying is a no-op and
``revert()`` restores the saved bytes exactly. Only the ``torch/...`` files of the patches are applied; their
``test/...`` files belong to a PyTorch checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from torch_overlay._guard import check_base, find_torch_dir
from torch_overlay._manifest import PACKAGE_DIR, load_manifest
from torch_overlay._persistent import installed_hook

STATE_DIR_NAME = "torch-overlay-fork"
DEFAULT_PATCHES_DIR = PACKAGE_DIR.parent / "patches"


class ForkError(RuntimeError):
    """Fork mode refused, having changed nothing; the message says why and what to do."""


@dataclass(frozen=True)
class ForkFile:
    path: str
    before_sha256: str
    after_sha256: str


@dataclass(frozen=True)
class ForkState:
    """What ``state.json`` records about an applied series."""

    mode: str
    base_version: str
    patches: tuple[str, ...]
    patches_sha256: str
    """sha256 of the applied patch files, concatenated in order: tells a re-apply of the same series."""
    files: tuple[ForkFile, ...]


def state_dir(torch_dir: Path) -> Path:
    return torch_dir.parent / STATE_DIR_NAME


def originals_dir(torch_dir: Path) -> Path:
    """The saved original files, laid out like site-packages (``torch/...``)."""
    return state_dir(torch_dir) / "originals"


def read_state(torch_dir: Path) -> ForkState | None:
    path = state_dir(torch_dir) / "state.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ForkError(f"torch_overlay: cannot read the fork mode state {path}: {e}") from e
    files = tuple(ForkFile(**f) for f in raw.pop("files"))
    return ForkState(**{**raw, "patches": tuple(raw["patches"]), "files": files})


def series(patches_dir: Path) -> list[Path]:
    """The patch files in order, as ``patches/series`` lists them."""
    index = patches_dir / "series"
    try:
        names = index.read_text(encoding="utf-8").split()
    except OSError as e:
        raise ForkError(f"torch_overlay: no patch series at {index} ({e.strerror}); run `make patches`") from e
    return [patches_dir / name for name in names]


def patched(base: dict[str, bytes], patch_files: list[Path]) -> dict[str, bytes]:
    """The files after ``git apply`` of every patch in order (``torch/...`` paths only); raises naming the patch."""
    with tempfile.TemporaryDirectory(prefix="torch-overlay-fork-") as tmp:
        tree = Path(tmp)
        subprocess.run(["git", "init", "--quiet"], cwd=tree, check=True)
        for path, content in base.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(content)
        for patch in patch_files:
            proc = subprocess.run(
                ["git", "apply", "--include=torch/*", "--exclude=*", str(patch.resolve())],
                cwd=tree,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise ForkError(
                    f"torch_overlay: {patch} does not apply to the installed torch: {proc.stderr.strip()}\n"
                    "Nothing was changed. Regenerate the series with `make patches` and run `make check`."
                )
        return {path: (tree / path).read_bytes() for path in base}


def _sha(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _write_atomically(target: Path, content: bytes) -> None:
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
    # A stale bytecode cache could outlive a replacement within the same second; drop it.
    for cached in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


def _replace_all(torch_dir: Path, files: dict[str, bytes], fallback: dict[str, bytes]) -> None:
    """Replace every file, or (on any error) put back ``fallback`` for the ones already replaced."""
    done = []
    try:
        for path, content in files.items():
            _write_atomically(torch_dir.parent / path, content)
            done.append(path)
    except BaseException:
        for path in done:
            _write_atomically(torch_dir.parent / path, fallback[path])
        raise


def _refuse_unwritable(dirs: list[Path]) -> None:
    for d in dirs:
        if not os.access(d, os.W_OK):
            raise ForkError(
                f"torch_overlay: refusing fork mode: {d} is not writable. Nothing was changed. Use a virtual "
                "environment you own, or the overlay instead (`python -m torch_overlay.activate`)."
            )


def apply(patches_dir: Path = DEFAULT_PATCHES_DIR, torch_dir: Path | None = None) -> tuple[ForkState, bool]:
    """Apply the series in place; returns (state, whether anything changed). All or nothing."""
    torch_dir = torch_dir or find_torch_dir()
    manifest = load_manifest()
    patch_files = series(patches_dir)
    digest = _sha(b"".join(p.read_bytes() for p in patch_files))
    state = read_state(torch_dir)
    if state is not None:
        if state.patches_sha256 != digest:
            raise ForkError(
                f"torch_overlay: fork mode is already applied to {torch_dir} with another version of the series. "
                "Nothing was changed. Run `torch-overlay revert-patches` first, then apply again."
            )
        _require_unchanged(torch_dir, state)
        return state, False
    hook = installed_hook()
    if hook is not None:
        raise ForkError(
            f"torch_overlay: refusing fork mode: the overlay is active persistently ({hook}). Nothing was "
            "changed. Use one or the other: `python -m torch_overlay.activate --revert` first."
        )
    check = check_base(manifest, torch_dir)
    if not check.ok:
        details = "\n".join(f"  - {line}" for line in check.problems())
        raise ForkError(
            f"torch_overlay: refusing fork mode: the installed torch is not the series' base.\n{details}\n"
            f"Nothing was changed. Reinstall it with `pip install --force-reinstall --no-deps "
            f"torch=={manifest.version}`, or rebase the series (README, 'Rebase onto a newer torch')."
        )
    targets = [m.upstream_file(torch_dir) for m in manifest.modules]
    _refuse_unwritable(sorted({t.parent for t in targets} | {torch_dir.parent}))
    base = {m.path: m.upstream_file(torch_dir).read_bytes() for m in manifest.modules}
    after = patched(base, patch_files)
    changed = {p: c for p, c in after.items() if c != base[p]}
    state = ForkState(
        mode="fork",
        base_version=manifest.version,
        patches=tuple(p.name for p in patch_files),
        patches_sha256=digest,
        files=tuple(ForkFile(p, _sha(base[p]), _sha(after[p])) for p in base),
    )
    _save_originals(torch_dir, base, state)
    try:
        _replace_all(torch_dir, changed, base)
    except BaseException:
        shutil.rmtree(state_dir(torch_dir), ignore_errors=True)
        raise
    return state, True


def _save_originals(torch_dir: Path, base: dict[str, bytes], state: ForkState) -> None:
    directory = state_dir(torch_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{STATE_DIR_NAME}-", dir=directory.parent))
    try:
        tmp.chmod(0o755)
        for path, content in base.items():
            (tmp / "originals" / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "originals" / path).write_bytes(content)
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _require_unchanged(torch_dir: Path, state: ForkState) -> None:
    for f in state.files:
        target = torch_dir.parent / f.path
        found = _sha(target.read_bytes()) if target.is_file() else None
        if found != f.after_sha256:
            raise ForkError(
                f"torch_overlay: {target} changed since fork mode was applied (sha256 {found}, expected "
                f"{f.after_sha256}). Nothing was changed. Reinstall torch with `pip install --force-reinstall "
                f"--no-deps torch=={state.base_version}` and delete {state_dir(torch_dir)}."
            )


def revert(torch_dir: Path | None = None) -> ForkState | None:
    """Restore every file fork mode replaced, byte for byte; returns the reverted state, None if none."""
    torch_dir = torch_dir or find_torch_dir()
    state = read_state(torch_dir)
    if state is None:
        return None
    _require_unchanged(torch_dir, state)
    originals = {}
    for f in state.files:
        content = (originals_dir(torch_dir) / f.path).read_bytes()
        if _sha(content) != f.before_sha256:
            raise ForkError(f"torch_overlay: the saved original of {f.path} is damaged; nothing was changed.")
        originals[f.path] = content
    current = {f.path: (torch_dir.parent / f.path).read_bytes() for f in state.files}
    changed = {p: c for p, c in originals.items() if c != current[p]}
    _replace_all(torch_dir, changed, current)
    shutil.rmtree(state_dir(torch_dir))
    return state


def active_state(torch_dir: Path | None = None) -> ForkState | None:
    """The fork mode state of the installed torch, or None; never raises (for status and the loader)."""
    try:
        return read_state(torch_dir or find_torch_dir())
    except Exception:
        return None


def refusal(action: str, torch_dir: Path | None = None) -> str | None:
    """Why ``action`` (an overlay activation) must not happen: fork mode is active; None when it is not."""
    state = active_state(torch_dir=torch_dir)
    if state is None:
        return None
    return (
        f"torch_overlay: refusing to {action}: fork mode is active (the series is applied in place to the "
        f"installed torch, {len(state.patches)} patches), so the overlay would apply twice. Nothing was changed. "
        "Use the fork as it is, or `torch-overlay revert-patches` first."
    )
