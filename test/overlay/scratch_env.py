"""Scratch environments for the machinery tests: fresh interpreters, virtual environments and torch trees.

Nothing here touches the project's own ``.venv``: a scratch virtual environment sees the project's torch and
this checkout through a path file, and a scratch torch tree is a symlink copy of the installed one, where a
test may replace single files (writing a file replaces its link, never the installed original).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "probe.py"
BOOT_DIR = Path(__file__).resolve().parent / "boot"


def clean_env(**overrides: str) -> dict[str, str]:
    """The current environment minus the test suite's overlay switches (boot directory and checkout on
    PYTHONPATH, TORCH_OVERLAY)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_OVERLAY"}
    paths = [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() not in (BOOT_DIR, REPO_ROOT)
    ]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(overrides)
    return env


def run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, env=env or clean_env(), cwd=cwd or REPO_ROOT, capture_output=True, text=True, timeout=300
    )


def probe(python: str, *flags: str, env: dict[str, str] | None = None) -> dict:
    """Run probe.py in a fresh interpreter and return its report (raises with stderr when it fails)."""
    result = run([python, str(PROBE), *flags], env=env)
    if result.returncode != 0:
        raise AssertionError(f"probe failed (rc {result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


class ScratchVenv:
    """A new virtual environment whose site-packages reaches the project's torch and this checkout."""

    def __init__(self, root: Path, with_package: bool = True) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.python = str(root / "bin" / "python")
        self.site_packages = Path(
            run([self.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
        )
        reach = [sysconfig.get_path("purelib")] + ([str(REPO_ROOT)] if with_package else [])
        # NOTE: sorts before torch_overlay_startup.pth, so the hook finds the package on sys.path.
        (self.site_packages / "00_reach_project.pth").write_text("\n".join(reach) + "\n")

    @property
    def hook(self) -> Path:
        return self.site_packages / "torch_overlay_startup.pth"


def torch_tree(root: Path, editable: tuple[str, ...] = ()) -> Path:
    """A copy of the installed torch under ``root`` made of symlinks; put ``root`` first on PYTHONPATH to use it.

    Only the directories leading to the ``editable`` files (paths relative to the torch package) are real, so
    that editing one of those files (see :func:`tamper`) never reaches the installed original.
    """
    installed = Path(sysconfig.get_path("purelib")) / "torch"
    wanted = [Path(e) for e in editable] + [Path("version.py")]

    def mirror(src: Path, dst: Path) -> None:
        dst.mkdir(parents=True)
        for entry in src.iterdir():
            relative = entry.relative_to(installed)
            if entry.is_dir() and any(w.is_relative_to(relative) for w in wanted):
                mirror(entry, dst / entry.name)
            else:
                (dst / entry.name).symlink_to(entry)

    mirror(installed, root / "torch")
    return root / "torch"


def tamper(path: Path, old: str, new: str) -> None:
    """Replace the link at ``path`` with an edited copy of the file it points to."""
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.unlink()
    path.write_text(text.replace(old, new))
