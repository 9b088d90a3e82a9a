"""Fork mode: the patch series applied in place to the installed torch, and taken out again byte for byte.

Like patch-package, the steps are separate and remembered: ``apply()`` checks everything first (base hashes,
no persistent overlay, a writable tree, every patch applies), saves the original files and a state file in
``<site-packages>/torch-overlay-fork/``, then replaces each file atomically, so re-applying is a no-op and
``revert()`` restores the saved bytes exactly. Only the ``torch/...`` files of the patches are applied; their
``test/...`` files belong to a PyTorch checkout.

NOTE: the state is saved before the first file is replaced, so a process killed half-way leaves each file at
either its ``before_sha256`` or its ``after_sha256``: ``apply()`` of the same series completes such a state,
``revert()`` restores only the files at ``after_sha256``, and the state directory goes last (renamed away in
one step), so a revert killed before that is completed by running it again. A new module (one no release
ships) is absent before: its ``before_sha256`` is None; apply creates it and revert removes it.

``pip uninstall torch-overlay`` cannot revert fork mode (it runs none of our code): apply also leaves a start-up
line beside torch, ``torch_overlay_fork.pth``, silent while torch-overlay is installed, that says in every process
what to run once it is gone (revert removes it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from torch_overlay._atomic import write_atomically
from torch_overlay._guard import check_base, find_torch_dir, reinstall_hint
from torch_overlay._manifest import PACKAGE_DIR, load_manifest, public_version, sha256_hex
from torch_overlay._patchset import SERIES_FILE, PatchApplyError, SeriesMissingError, apply_series, read_series
from torch_overlay._persistent import installed_hook

STATE_DIR_NAME = "torch-overlay-fork"
DEFAULT_PATCHES_DIR = Path(PACKAGE_DIR) / "patches"
"""The series this package carries: in a checkout, a link to its ``patches/``; in an installed wheel, a copy of
the generated series (package data: every base's index and patch files, no ``series.toml`` or snapshots)."""


class ForkError(RuntimeError):
    """Fork mode refused, having changed nothing; the message says why and what to do."""


@dataclass(frozen=True)
class ForkFile:
    path: str
    before_sha256: str | None
    """None: the file is absent before (a new module)."""
    after_sha256: str | None


@dataclass(frozen=True)
class ForkState:
    """What ``state.json`` records about an applied series."""

    mode: str
    base_version: str
    """The base the series was chosen for (see ``torch_version``)."""
    patches: tuple[str, ...]
    patches_sha256: str
    """sha256 of the applied patch files, concatenated in order: tells a re-apply of the same series."""
    files: tuple[ForkFile, ...]
    torch_version: str = ""
    """The installed torch's public version: the base's, or an unlisted release with the same files."""


NOTICE_FILE_NAME = "torch_overlay_fork.pth"


def state_dir(torch_dir: Path) -> Path:
    return torch_dir.parent / STATE_DIR_NAME


def notice_path(torch_dir: Path) -> Path:
    return torch_dir.parent / NOTICE_FILE_NAME


# NOTE: `pip uninstall torch-overlay` runs none of our code, so it cannot revert fork mode: this start-up line,
# beside torch (site-packages), says so in every process while torch stays patched and torch-overlay is gone
# (silent while torch-overlay is installed; once the state directory is gone it removes itself).
_NOTICE_CODE = """\
if not getattr(sys, "_torch_overlay_fork_checked", False):
    sys._torch_overlay_fork_checked = True
    if not os.path.isdir(STATE):
        try:
            os.remove(NOTICE)
        except OSError:
            pass
    else:
        import importlib.util
        if importlib.util.find_spec("torch_overlay") is None:
            sys.stderr.write(MESSAGE + "\\n")
"""


def notice_text(torch_dir: Path, base_version: str) -> str:
    """The start-up line that fork mode leaves beside torch (see ``_NOTICE_CODE``)."""
    message = (
        f"torch_overlay: torch-overlay was uninstalled, but its fork mode still patches torch {base_version} in "
        f"{torch_dir}: reinstall torch-overlay and run `torch-overlay revert-patches`, or run "
        f"`pip install --force-reinstall --no-deps torch=={base_version}` and delete {state_dir(torch_dir)}"
    )
    code = f"STATE = {str(state_dir(torch_dir))!r}\nNOTICE = {str(notice_path(torch_dir))!r}\n"
    code += f"MESSAGE = {message!r}\n" + _NOTICE_CODE
    return (
        "# torch-overlay fork mode: torch here is patched; `torch-overlay revert-patches` removes this file.\n"
        f"import os, sys; exec({code!r})\n"
    )


def _write_notice(torch_dir: Path, state: ForkState) -> None:
    # NOTE: readable by all, as the persistent hook (site skips a .pth it cannot read).
    write_atomically(notice_path(torch_dir), notice_text(torch_dir, state.base_version).encode("utf-8"), mode=0o644)


def originals_dir(torch_dir: Path) -> Path:
    """The saved original files, laid out like site-packages (``torch/...``)."""
    return state_dir(torch_dir) / "originals"


def _reinstall_hint(torch_dir: Path, version: str) -> str:
    return f"Reinstall torch with {reinstall_hint(version)} and delete {state_dir(torch_dir)}."


def read_state(torch_dir: Path) -> ForkState | None:
    path = state_dir(torch_dir) / "state.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        files = tuple(ForkFile(**f) for f in raw.pop("files"))
        return ForkState(**{**raw, "patches": tuple(raw["patches"]), "files": files})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ForkError(
            f"torch_overlay: the fork mode state {path} is unreadable or damaged ({type(e).__name__}: {e}). "
            f"Nothing was changed. {_reinstall_hint(torch_dir, load_manifest().payload_base.version)}"
        ) from e


def series(patches_dir: Path | None, base_version: str) -> list[Path]:
    """The patch files for a base, in order (:func:`~torch_overlay._patchset.read_series`).

    ``patches_dir``: None is the series this package carries (:data:`DEFAULT_PATCHES_DIR`); a directory the
    user names (``--patches``) is checked to be one, with a series index, and the message says so if not.
    """
    if patches_dir is None:
        patches_dir = DEFAULT_PATCHES_DIR
        if not patches_dir.is_dir():
            raise ForkError(
                f"torch_overlay: no patch series at {patches_dir}: this torch-overlay was installed without it. "
                "Nothing was changed. Reinstall it from a checkout (`pip install .`), or pass a checkout's "
                "patches/ directory: `torch-overlay apply-patches --patches DIR`."
            )
    elif not patches_dir.is_dir() or not (patches_dir / SERIES_FILE).is_file():
        what = "no such directory" if not patches_dir.is_dir() else f"a directory without a `{SERIES_FILE}` index"
        raise ForkError(
            f"torch_overlay: --patches {patches_dir}: {what}, not a patch series. Nothing was changed. Pass a "
            "torch-overlay checkout's patches/ directory, or leave --patches out: this package carries the "
            f"series ({DEFAULT_PATCHES_DIR})."
        )
    try:
        return read_series(patches_dir, base_version)
    except SeriesMissingError as e:
        raise ForkError(f"torch_overlay: {e}. Nothing was changed.") from e


def _sha256(content: bytes | None) -> str | None:
    return None if content is None else sha256_hex(content)


def patched(base: dict[str, bytes | None], patch_files: list[Path]) -> dict[str, bytes | None]:
    """The files after ``git apply`` of every patch in order (``torch/...`` paths only; None: absent); raises
    naming the patch."""
    present = {path: content for path, content in base.items() if content is not None}
    try:
        tree = apply_series(present, patch_files, ["--include=torch/*", "--exclude=*"])
    except PatchApplyError as e:
        raise ForkError(
            f"torch_overlay: {e.patch} does not apply to the installed torch: {e.stderr}\n"
            "Nothing was changed. Regenerate the series with `make patches` and run `make check`."
        ) from e
    return {path: tree.get(path) for path in base}


def _write_atomically(target: Path, content: bytes | None) -> None:
    """Write ``content``, or remove the file for None (a new module, on revert)."""
    if content is None:
        target.unlink(missing_ok=True)
    else:
        write_atomically(target, content)
    # A stale bytecode cache could outlive a replacement within the same second; drop it.
    for cached in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


class InterruptedForkError(ForkError):
    """Replacing the files failed half-way and putting the replaced ones back failed too; the state is kept."""


def _replace_all(torch_dir: Path, files: dict[str, bytes | None], fallback: dict[str, bytes | None], redo: str) -> None:
    """Replace every file, or (on any error) put back ``fallback`` for the ones already replaced.

    When putting back fails too, raises :class:`InterruptedForkError`, saying to run ``redo`` (which completes
    or undoes the interrupted step from the kept state).
    """
    done = []
    try:
        for path, content in files.items():
            _write_atomically(torch_dir.parent / path, content)
            done.append(path)
    except BaseException as error:
        try:
            for path in done:
                _write_atomically(torch_dir.parent / path, fallback[path])
        except BaseException as e:
            raise InterruptedForkError(
                f"torch_overlay: fork mode was interrupted while replacing {torch_dir.parent / path} ({e}); "
                f"some files are patched, some are not. Run `{redo}` to finish."
            ) from error
        raise


_UNWRITABLE_FIX = (
    "Use the overlay in the process instead, which writes nothing: `import torch_overlay; torch_overlay.activate()` "
    "at the top of your script (`python -m torch_overlay.activate` writes to this environment too)."
)


def _refuse_unwritable(dirs: list[Path]) -> None:
    for d in dirs:
        if not os.access(d, os.W_OK):
            raise ForkError(
                f"torch_overlay: refusing fork mode: {d} is not writable. Nothing was changed. {_UNWRITABLE_FIX}"
            )


def apply(patches_dir: Path | None = None, torch_dir: Path | None = None) -> tuple[ForkState, bool]:
    """Apply the series in place; returns (state, whether anything changed). All or nothing.

    ``patches_dir``: a ``patches/`` directory; None = the series this package carries (:data:`DEFAULT_PATCHES_DIR`).
    """
    torch_dir = torch_dir or find_torch_dir()
    manifest = load_manifest()
    state = read_state(torch_dir)
    if state is not None:
        patch_files = series(patches_dir, state.base_version)
        if state.patches_sha256 != _digest(patch_files):
            raise ForkError(
                f"torch_overlay: fork mode is already applied to {torch_dir} with another version of the series. "
                "Nothing was changed. Run `torch-overlay revert-patches` first, then apply again."
            )
        changed = _complete(torch_dir, state, patch_files)
        if not notice_path(torch_dir).is_file():
            _write_notice(torch_dir, state)
        return state, changed
    hook = installed_hook()
    if hook is not None:
        raise ForkError(
            f"torch_overlay: refusing fork mode: the overlay is active persistently ({hook}). Nothing was "
            "changed. Use one or the other: `python -m torch_overlay.activate --revert` first."
        )
    check = check_base(manifest, torch_dir)
    if check.matched is None:
        details = "\n".join(f"  - {line}" for line in check.problems())
        raise ForkError(
            f"torch_overlay: refusing fork mode: the installed torch is not a base of the series.\n{details}\n"
            f"Nothing was changed. {check.fix()}"
        )
    patch_files = series(patches_dir, check.matched.version)
    digest = _digest(patch_files)
    targets = [Path(m.upstream_file(torch_dir)) for m in manifest.modules]
    _refuse_unwritable(sorted({t.parent for t in targets} | {torch_dir.parent}))
    # NOTE: a new module's file is absent here: the base check refuses a torch that ships one.
    base = {m.path: None if m.new else Path(m.upstream_file(torch_dir)).read_bytes() for m in manifest.modules}
    after = patched(base, patch_files)
    changed = {p: c for p, c in after.items() if c != base[p]}
    state = ForkState(
        mode="fork",
        base_version=check.matched.version,
        patches=tuple(p.name for p in patch_files),
        patches_sha256=digest,
        files=tuple(ForkFile(p, _sha256(base[p]), _sha256(after[p])) for p in base),
        torch_version=public_version(check.found_version or check.matched.version),
    )
    _save_originals(torch_dir, base, state)
    try:
        _replace_all(torch_dir, changed, base, redo="torch-overlay apply-patches")
    except InterruptedForkError:
        raise
    except BaseException:
        shutil.rmtree(state_dir(torch_dir), ignore_errors=True)
        raise
    _write_notice(torch_dir, state)
    return state, True


def _digest(patch_files: list[Path]) -> str:
    return sha256_hex(b"".join(p.read_bytes() for p in patch_files))


def _complete(torch_dir: Path, state: ForkState, patch_files: list[Path]) -> bool:
    """Finish an apply that was interrupted (files still at ``before_sha256``); False when none is left."""
    current = _current(torch_dir, state)
    pending = [f for f in state.files if _sha256(current[f.path]) != f.after_sha256]
    if not pending:
        return False
    after = patched(_saved_originals(torch_dir, state, state.files), patch_files)
    for f in pending:
        if _sha256(after[f.path]) != f.after_sha256:
            raise ForkError(
                f"torch_overlay: the series does not rebuild the patched {f.path} recorded in "
                f"{state_dir(torch_dir) / 'state.json'}. Nothing was changed. Run `torch-overlay revert-patches`."
            )
    _replace_all(torch_dir, {f.path: after[f.path] for f in pending}, current, redo="torch-overlay apply-patches")
    return True


def _save_originals(torch_dir: Path, base: dict[str, bytes | None], state: ForkState) -> None:
    directory = state_dir(torch_dir)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{STATE_DIR_NAME}-", dir=directory.parent))
    except OSError as e:
        raise ForkError(
            f"torch_overlay: refusing fork mode: cannot write in {directory.parent} ({e.strerror}). Nothing was "
            f"changed. {_UNWRITABLE_FIX}"
        ) from e
    try:
        tmp.chmod(0o755)
        for path, content in [(p, c) for p, c in base.items() if c is not None]:
            (tmp / "originals" / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "originals" / path).write_bytes(content)
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, directory)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ForkError(
            f"torch_overlay: refusing fork mode: cannot save the originals in {directory} ({e}). Nothing was "
            "changed. Use a virtual environment you own, or the overlay instead."
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _current(torch_dir: Path, state: ForkState) -> dict[str, bytes | None]:
    """Each file's bytes (None: absent); raises when one is at neither its original nor its patched sha256."""
    current = {}
    for f in state.files:
        target = torch_dir.parent / f.path
        content = target.read_bytes() if target.is_file() else None
        found = _sha256(content)
        if found not in (f.before_sha256, f.after_sha256):
            raise ForkError(
                f"torch_overlay: {target} changed since fork mode was applied (sha256 {found or 'absent'}; "
                f"expected the patched {f.after_sha256} or the original {f.before_sha256 or 'absent file'}). "
                "Nothing was changed. " + _reinstall_hint(torch_dir, state.base_version)
            )
        current[f.path] = content
    return current


def _saved_originals(torch_dir: Path, state: ForkState, files: tuple[ForkFile, ...]) -> dict[str, bytes | None]:
    originals: dict[str, bytes | None] = {}
    for f in files:
        if f.before_sha256 is None:  # a new module: nothing saved, absent before
            originals[f.path] = None
            continue
        saved = originals_dir(torch_dir) / f.path
        try:
            content = saved.read_bytes()
        except OSError as e:
            raise ForkError(
                f"torch_overlay: the saved original {saved} is missing or unreadable ({e.strerror}). Nothing was "
                f"changed. {_reinstall_hint(torch_dir, state.base_version)}"
            ) from e
        if sha256_hex(content) != f.before_sha256:
            raise ForkError(
                f"torch_overlay: the saved original {saved} is damaged (not sha256 {f.before_sha256}). Nothing "
                f"was changed. {_reinstall_hint(torch_dir, state.base_version)}"
            )
        originals[f.path] = content
    return originals


def _remove_state(torch_dir: Path) -> None:
    """Remove the state directory in one step (a rename), so that no half-removed state is ever read."""
    directory = state_dir(torch_dir)
    trash = Path(tempfile.mkdtemp(prefix=f".{STATE_DIR_NAME}-removed-", dir=directory.parent))
    os.replace(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)


def revert(torch_dir: Path | None = None) -> ForkState | None:
    """Restore every file fork mode replaced, byte for byte; returns the reverted state, None if none.

    Each file may be at its patched or its original bytes (an interrupted apply or revert): only the patched
    ones are restored.
    """
    torch_dir = torch_dir or find_torch_dir()
    state = read_state(torch_dir)
    if state is None:
        return None
    current = _current(torch_dir, state)
    patched_files = tuple(f for f in state.files if _sha256(current[f.path]) != f.before_sha256)
    originals = _saved_originals(torch_dir, state, patched_files)
    _replace_all(torch_dir, originals, current, redo="torch-overlay revert-patches")
    _remove_state(torch_dir)
    notice_path(torch_dir).unlink(missing_ok=True)
    return state


def active_state(torch_dir: Path | None = None) -> ForkState | None:
    """The fork mode state of the installed torch, or None; never raises (for status and the loader)."""
    try:
        return read_state(torch_dir or find_torch_dir())
    except Exception:
        return None


def fork_problems(state: ForkState, torch_dir: Path) -> list[str]:
    """What is wrong with an applied fork: each file fork mode replaced that is not at its patched bytes, with the
    command that fixes it; none on a healthy fork. Reads only, never raises."""
    lines = []
    for f in state.files:
        target = torch_dir.parent / f.path
        try:
            found = sha256_hex(target.read_bytes()) if target.is_file() else None
        except OSError as e:
            found = f"unreadable ({e.strerror})"
        if found == f.after_sha256:
            continue
        if found == f.before_sha256:
            lines.append(
                f"{target} is the original, not the patched file (fork mode was interrupted): run "
                "`torch-overlay apply-patches` to finish, or `torch-overlay revert-patches`"
            )
        else:
            lines.append(
                f"{target} changed since fork mode was applied (sha256 {found or 'absent'}, patched "
                f"{f.after_sha256}). {_reinstall_hint(torch_dir, state.base_version)}"
            )
    return lines


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
