"""git, run so that neither the caller's environment nor the user's configuration can steer it.

Git exports ``GIT_DIR``, ``GIT_INDEX_FILE``, ``GIT_WORK_TREE``... to the hooks it runs: a ``make patches``
or ``make check`` started from a pre-commit hook would otherwise commit into, and rewrite the index of, the
user's repository instead of the scratch one. The user's config (``apply.whitespace=fix``,
``merge.conflictStyle``, ``core.autocrlf``...) would change the bytes that the patch tools and fork mode write.
So every git this project runs gets an environment without any inherited ``GIT_*`` variable, the repository
named explicitly (``git -C``), and, unless the command acts for the user in their own checkout
(``git am`` and ``ghstack submit`` in a PyTorch checkout), no system or global config and a fixed identity.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

AUTHOR = ("torch-overlay", "torch-overlay@users.noreply.github.com")
DATE = "2026-01-01T00:00:00+0000"


class GitError(RuntimeError):
    """A git command failed; the message names the command, the directory and git's error."""


def git_env(user_config: bool = False, identity: tuple[str, str] = AUTHOR) -> dict[str, str]:
    """``os.environ`` without any ``GIT_*`` variable; isolated from the user's config unless ``user_config``.

    Isolated, commits are made by ``identity`` (name, email) at the fixed :data:`DATE`.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    if not user_config:
        env.update(
            GIT_CONFIG_NOSYSTEM="1",
            GIT_CONFIG_GLOBAL=os.devnull,
            GIT_AUTHOR_NAME=identity[0],
            GIT_AUTHOR_EMAIL=identity[1],
            GIT_COMMITTER_NAME=identity[0],
            GIT_COMMITTER_EMAIL=identity[1],
            GIT_AUTHOR_DATE=DATE,
            GIT_COMMITTER_DATE=DATE,
        )
    return env


def run(
    repo: Path, *args: str, input: bytes | None = None, user_config: bool = False, identity: tuple[str, str] = AUTHOR
) -> subprocess.CompletedProcess[bytes]:
    """``git -C repo args...`` (bytes in and out, no check): see the module docstring for the environment."""
    env = git_env(user_config, identity)
    return subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, env=env)


def git(
    repo: Path, *args: str, input: str | None = None, user_config: bool = False, identity: tuple[str, str] = AUTHOR
) -> str:
    """``git -C repo args...``, text out; raises :class:`GitError` when it fails."""
    data = None if input is None else input.encode("utf-8")
    proc = run(repo, *args, input=data, user_config=user_config, identity=identity)
    if proc.returncode != 0:
        stderr = proc.stderr.decode("utf-8", "replace").strip()
        raise GitError(f"git {' '.join(args)} failed in {repo}:\n{stderr}")
    return proc.stdout.decode("utf-8")


def merge_file(ours: bytes, base: bytes, theirs: bytes, labels: tuple[str, str, str]) -> tuple[int, bytes]:
    """``git merge-file -p``: (number of conflicting hunks, the merge with conflict markers where they are)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="torch-overlay-merge-") as tmp:
        files = []
        for name, content in zip(("ours", "base", "theirs"), (ours, base, theirs), strict=True):
            (Path(tmp) / name).write_bytes(content)
            files.append(str(Path(tmp) / name))
        named = [arg for label in labels for arg in ("-L", label)]
        proc = run(Path(tmp), "merge-file", "-p", *named, *files)
    if proc.returncode < 0 or proc.returncode > 127:
        raise GitError(f"git merge-file failed on {labels[0]}:\n{proc.stderr.decode('utf-8', 'replace')}")
    return proc.returncode, proc.stdout
