"""``make quickstart``: the README's quick start, run literally as a new user runs it, in a fresh venv.

The venv holds only torch (``pip install torch==<version>``, pinned: the quick start starts "in the
environment of your torch"); then every command of the README's quick start block (the first ``sh`` block
after "**Quick start**") runs as written, in order, from the checkout, with the venv's ``bin`` first on PATH as
in an activated venv. It fails, naming the command, unless each one succeeds and the example prints its
``OK:`` line. The dev venvs hold numpy, pytest and the rest: only here does a missing requirement show.

Then a second venv holds a torch that is not a base (a stand-in wheel of the release after the newest base: its
``torch/version.py`` and metadata, all that pip and the guard read), and the quick start's install line runs in it
as written: it must leave that torch as it was, and the activation line must refuse, saying that the release is not
a base and that nothing was changed.

Standard library only, so that it runs with any ``python3``.

    python -m tools.quickstart [--torch VERSION] [--venv DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^\*\*Quick start\*\*.*?^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_OK = re.compile(r"^OK: .*$", re.MULTILINE)


class QuickstartError(RuntimeError):
    """The quick start did not work as written; the message names the command and what it printed."""


def commands(readme: Path) -> list[str]:
    """The quick start's commands, as the README gives them (each line of its block; comments stay: the shell
    reads them)."""
    match = _BLOCK.search(readme.read_text(encoding="utf-8"))
    if match is None:
        raise QuickstartError(f"{readme}: no ```sh block after '**Quick start**'")
    return [line for line in match.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def user_env(venv: Path) -> dict[str, str]:
    """A user's shell in the activated venv: its ``bin`` first on PATH, nothing of this project's test setup.

    NOTE: this project's machines cap torch with a pip constraint file; a user's pip has none.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_OVERLAY", "PYTHONHOME")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PIP_CONSTRAINT=os.devnull
    )
    return env


def run_quickstart(venv: Path, torch_version: str, say: Callable[[str], None] = print) -> str:
    """Make ``venv`` (it must not exist) with torch only, run the quick start in it; returns the example's OK line."""
    env = user_env(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    say(f"$ pip install torch=={torch_version}   # the environment of your torch")
    _run(f"pip install --quiet torch=={torch_version}", env)
    said = []
    for command in commands(REPO_ROOT / "README.md"):
        say(f"$ {command}")
        said.append(_run(command, env))
        if said[-1].strip():
            say(said[-1].rstrip("\n"))
    ok = _OK.search("".join(said))
    if ok is None:
        raise QuickstartError("no command printed the example's 'OK: ...' line")
    return ok.group(0)


def run_unsupported(venv: Path, say: Callable[[str], None] = print) -> str:
    """Make ``venv`` (it must not exist) with a torch that is not a base, run the quick start's install line in it;
    returns the activation's refusal. Fails unless torch is left as it was and activation refuses."""
    env = user_env(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    manifest = json.loads((REPO_ROOT / "torch_overlay" / "manifest.json").read_text())
    major, minor = manifest["bases"][-1]["version"].split(".")[:2]
    version = f"{major}.{int(minor) + 1}.0"
    wheel = stand_in_torch_wheel(venv.parent, version)
    say(f"$ pip install {wheel.name}   # a torch that is not a base: {version}")
    _run(f"pip install --quiet --no-index {wheel}", env)
    before = _run("pip show --files torch", env)
    install, activate = commands(REPO_ROOT / "README.md")[:2]
    say(f"$ {install}")
    _run(install, env)
    after = _run("pip show --files torch", env)
    if after != before:
        raise QuickstartError(f"`{install}` changed torch {version}:\nbefore:\n{before}\nafter:\n{after}")
    say(f"$ {activate}   # must refuse")
    proc = subprocess.run(activate, shell=True, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    said = proc.stdout + proc.stderr
    if proc.returncode != 1 or f"torch {version} at " not in said or "Nothing was changed." not in said:
        raise QuickstartError(f"`{activate}` on torch {version} exited {proc.returncode}, not refusing:\n{said}")
    return said.strip()


def stand_in_torch_wheel(directory: Path, version: str) -> Path:
    """A wheel named torch ``version`` holding only ``torch/version.py``: what pip and the guard read of a torch."""
    wheel = directory / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = {version!r}\n",
        "torch/version.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: quickstart\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return wheel


def _run(command: str, env: dict[str, str]) -> str:
    proc = subprocess.run(
        command, shell=True, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        lines = proc.stdout.splitlines()
        errors = list(dict.fromkeys(line.strip() for line in lines if re.search(r"\w(Error|Exception): ", line)))
        said = "\n".join(lines[-20:] + (["errors:"] + errors[:5] if errors else []))
        raise QuickstartError(f"`{command}` exited {proc.returncode}; its last lines, then its errors:\n{said}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quickstart", description=__doc__.splitlines()[0])
    oldest = json.loads((REPO_ROOT / "torch_overlay" / "manifest.json").read_text())["bases"][0]["version"]
    parser.add_argument("--torch", default=oldest, help=f"the torch release the venv gets (default {oldest})")
    parser.add_argument("--venv", type=Path, help="where to make the venv (default: a temporary one, removed after)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torch-overlay-quickstart-") as tmp:
        venv = args.venv or Path(tmp) / "venv"
        if args.venv is not None:
            shutil.rmtree(venv, ignore_errors=True)
        try:
            ok = run_quickstart(venv, args.torch)
            refused = run_unsupported(Path(tmp) / "unsupported" / "venv")
        except (QuickstartError, subprocess.CalledProcessError) as e:
            print(f"make quickstart: {e}", file=sys.stderr)
            return 1
    print(f"quickstart: the README's commands worked in a venv with only torch {args.torch} and the package, "
          f"and on a torch that is not a base its install line left torch alone and activation refused "
          f"({time.monotonic() - start:.0f} s); the example said:\n{ok}\nthe refusal said:\n{refused}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
