"""Persistent activation: a ``.pth`` start-up hook in the current environment's site-packages.

``site`` executes ``import`` lines of ``.pth`` files at every interpreter start, so every process of the
environment (``spawn`` children and torchrun ranks included) runs ``_startup.boot()`` without code changes.
The line itself guards everything: ``TORCH_OVERLAY=0`` (``off``, ``false``, ``no``) skips even importing this
package, and a broken package costs one line on stderr instead of a traceback from ``site``. A package that was
uninstalled (``pip uninstall torch-overlay``, which does not know the hook) leaves no distribution beside the
hook: the hook then removes itself, silently, so that no process of the environment says anything about it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from torch_overlay._atomic import write_atomically
from torch_overlay._env import ENV_VAR, OFF_VALUES
from torch_overlay._guard import require_base

HOOK_FILE_NAME = "torch_overlay_startup.pth"

# NOTE: CPython 3.11 runs the .pth files of a virtual environment twice at start-up (once from site.venv());
# the marker on ``sys`` keeps the hook to one run and one warning per interpreter.
_HOOK_CODE = f"""\
off = os.environ.get({ENV_VAR!r}, "").strip().lower() in {OFF_VALUES!r}
if not off and not getattr(sys, "_torch_overlay_hook_ran", False):
    sys._torch_overlay_hook_ran = True
    try:
        from torch_overlay._startup import boot
    except Exception as e:
        import glob
        site_dir = os.path.dirname(HOOK_PATH)
        if (isinstance(e, ModuleNotFoundError) and e.name == "torch_overlay"
                and not glob.glob(os.path.join(glob.escape(site_dir), "torch_overlay-*.dist-info"))):
            try:  # uninstalled: the hook goes too, without a word
                os.remove(HOOK_PATH)
            except OSError:
                pass
        else:
            sys.stderr.write("torch_overlay: start-up hook %s did nothing, torch_overlay cannot be imported (%r); "
                             "reinstall torch-overlay or delete that file\\n" % (HOOK_PATH, e))
    else:
        boot()
"""


def hook_path(site_packages: Path | None = None) -> Path:
    """Where the hook lives: the purelib site-packages of the running interpreter's environment."""
    return (site_packages or Path(sysconfig.get_path("purelib"))) / HOOK_FILE_NAME


def hook_text(path: Path) -> str:
    code = f"HOOK_PATH = {str(path)!r}\n" + _HOOK_CODE
    return (
        "# torch-overlay start-up hook, written by `python -m torch_overlay.activate`.\n"
        "# Remove it with `python -m torch_overlay.activate --revert`; TORCH_OVERLAY=0 disables it per process.\n"
        f"import os, sys; exec({code!r})\n"
    )


def installed_hook(site_packages: Path | None = None) -> Path | None:
    path = hook_path(site_packages)
    return path if path.exists() else None


def hook_is_current(path: Path) -> bool:
    """Whether the file at ``path`` is exactly the hook this version of the package writes."""
    try:
        return path.read_text(encoding="utf-8") == hook_text(path)
    except OSError:
        return False


def install_hook(site_packages: Path | None = None) -> tuple[Path, bool]:
    """Verify the base, then write the hook atomically; returns (path, whether anything changed)."""
    require_base("install the start-up hook")
    path = hook_path(site_packages)
    if hook_is_current(path):
        return path, False
    # NOTE: readable by all: site skips a .pth it cannot read without a word, and every other user of a shared
    # environment would silently run stock torch.
    write_atomically(path, hook_text(path).encode("utf-8"), mode=0o644)
    return path, True


def remove_hook(site_packages: Path | None = None) -> Path | None:
    """Remove the hook; returns the removed path, or None when there was none."""
    path = hook_path(site_packages)
    if not path.exists():
        return None
    path.unlink()
    return path
