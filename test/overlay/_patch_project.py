"""A synthetic project for the patch tools' tests: fake manifest, bases, overlay, series.toml and tests.

Two fake upstream files (``torch/fake/alpha.py``, ``torch/fake/beta.py``) in two fake releases, 9.8.0 (whose
alpha.py differs in its last line, away from our changes) and 9.9.0 (the newest, the payload's base), and a
three-patch series whose last patch is a backport that 9.9.0 no longer needs: the tools are tested on these,
so the tests do not depend on the state of the real overlay.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import textwrap
from pathlib import Path

from tools.project import Project

ALPHA = "".join(f"line {n}\n" for n in range(1, 21))
BETA = "def beta():\n    return 1\n"
OVERLAY = {
    "torch/fake/alpha.py": ALPHA.replace("line 3\n", "line 3 fixed\n")
    .replace("line 15\n", "line 15 extended\n")
    .replace("line 12\n", "line 12 backported\n"),
    "torch/fake/beta.py": BETA.replace("return 1", "return 2  # extended"),
}
BASE = {"torch/fake/alpha.py": ALPHA, "torch/fake/beta.py": BETA}
"""The newest base, 9.9.0: the payload is its files plus our change."""
OLD_BASE = {"torch/fake/alpha.py": ALPHA.replace("line 20\n", "line 20 old\n"), "torch/fake/beta.py": BETA}
"""The older base, 9.8.0."""

SERIES = '''
author = "Pat Maintainer <pat@example.com>"

[[patch]]
name = "fix-alpha"
title = "[FSDP] Fix line 3"
summary = """
Line 3 was wrong.
"""
test_plan = """
python test/fake/test_one.py
"""
fixes = [12345]
claims = [{ file = "torch/fake/alpha.py", match = "fixed" }]
tests = ["test/fake/test_one.py"]
upstream_test_edits = []

[[patch]]
name = "extend"
title = "[2D] Extend alpha and beta"
summary = """
Extends two things.
"""
test_plan = """
python test/fake/test_two.py
"""
fixes = []
claims = [
  { file = "torch/fake/alpha.py", match = "extended" },
  { file = "torch/fake/beta.py", match = "extended" },
]
tests = ["test/fake/test_two.py"]
upstream_test_edits = ["test/fake/test_upstream.py"]

[[patch]]
name = "backport"
title = "[FSDP] Backport line 12"
fixed_upstream_in = "9.9.0"
summary = """
Line 12, as upstream fixed it in 9.9.0.
"""
test_plan = """
python test/fake/test_three.py
"""
claims = [{ file = "torch/fake/alpha.py", match = "backported" }]
tests = ["test/fake/test_three.py"]
'''

UPSTREAM_TEST_OLD = "import torch\n\n\ndef test_a():\n    assert 1\n"
UPSTREAM_TEST_NEW = "import torch\n\n\ndef test_a():\n    assert 2\n"


def git_diff(old: str, new: str, path: str, tmp: Path) -> str:
    """``git diff`` of two versions of ``path`` with a/ and b/ paths, as test/upstream_edits holds it."""
    repo = tmp / "diffrepo"
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / path).write_text(old)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    (repo / path).write_text(new)
    return subprocess.run(["git", "diff"], cwd=repo, check=True, capture_output=True, text=True).stdout


def write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def manifest_text(
    bases: dict[str, dict[str, str]],
    code_sha256: dict[str, str] | None = None,
    runtime: tuple[str, ...] = ("torch/fake/beta.py",),
    base_payloads: dict[str, list[str]] | None = None,
) -> str:
    """manifest.json for the fake modules and these bases (version -> files), oldest first; ``code_sha256``:
    path -> the module's ``code_sha256``, for the modules that have one; ``runtime``: the paths served at run
    time; ``base_payloads``: path -> the bases with their own payload of it."""
    manifest = {
        "package": "torch",
        "bases": [
            {"version": v, "sha256": {p: hashlib.sha256(t.encode()).hexdigest() for p, t in files.items()}}
            for v, files in bases.items()
        ],
        # By default alpha.py differs between the bases in code, so it cannot be served at run time (one
        # payload): like the real fully_sharded_data_parallel.py, it is patched by fork mode and the series only.
        "modules": [
            {"name": p.removesuffix(".py").replace("/", "."), "path": p, "runtime": p in runtime} for p in BASE
        ],
    }
    for module in manifest["modules"]:
        if module["path"] in (code_sha256 or {}):
            module["code_sha256"] = code_sha256[module["path"]]
        if module["path"] in (base_payloads or {}):
            module["base_payloads"] = base_payloads[module["path"]]
    return json.dumps(manifest, indent=2) + "\n"


def make_project(tmp: Path) -> tuple[Project, list[Path]]:
    """(the project, site-packages-like directories holding its pristine bases: 9.9.0's, then 9.8.0's)."""
    base_dir, old_dir, root = tmp / "base", tmp / "base-9.8.0", tmp / "project"
    write(base_dir, BASE)
    write(old_dir, OLD_BASE)
    write(root, {"torch_overlay/manifest.json": manifest_text({"9.8.0": OLD_BASE, "9.9.0": BASE})})
    write(root, {"pyproject.toml": '[project]\nname = "fake"\ndependencies = []\n'})
    write(root, {f"torch_overlay/{p}": t for p, t in OVERLAY.items()})
    write(root, {"patches/series.toml": textwrap.dedent(SERIES).lstrip()})
    write(
        root,
        {
            "test/fake/test_one.py": "def test_one():\n    pass\n",
            "test/fake/test_two.py": "def test_two():\n    pass\n",
            "test/fake/test_three.py": "def test_three():\n    pass\n",
        },
    )
    diff = git_diff(UPSTREAM_TEST_OLD, UPSTREAM_TEST_NEW, "test/fake/test_upstream.py", tmp)
    write(root, {
        "test/upstream_edits/test/fake/test_upstream.py.diff": "Upstream-Base: pytorch/pytorch@abc123\n" + diff,
        "test/fake/test_upstream.py": UPSTREAM_TEST_NEW,
    })  # fmt: skip
    return Project(root), [base_dir, old_dir]


SHARED_OLD = UPSTREAM_TEST_OLD + "".join(f"\n\ndef test_{c}():\n    assert 1\n" for c in "bcdefz")
"""An upstream test file that both patches of the upstream series edit (:func:`share_upstream_edit`)."""
SHARED_MID = SHARED_OLD.replace("def test_a():\n    assert 1", "def test_a():\n    assert 2")
"""After fix-alpha's diff."""
SHARED_NEW = SHARED_MID.replace("def test_z():\n    assert 1", "def test_z():\n    assert 3")
"""After extend's diff: test_z is far enough from test_a that no line of the first diff shows it."""


def share_upstream_edit(project: Project, tmp: Path) -> None:
    """Make fix-alpha and extend both edit test/fake/test_upstream.py, each with its own diff, in series order."""
    path, root = "test/fake/test_upstream.py", project.root
    project.series_toml.write_text(
        project.series_toml.read_text().replace("upstream_test_edits = []", f'upstream_test_edits = ["{path}"]', 1)
    )
    (root / f"test/upstream_edits/{path}.diff").unlink()
    for name, old, new in (("fix-alpha", SHARED_OLD, SHARED_MID), ("extend", SHARED_MID, SHARED_NEW)):
        diff = git_diff(old, new, path, tmp / f"diff-{name}")
        write(root, {f"test/upstream_edits/{path}.{name}.diff": "Upstream-Base: pytorch/pytorch@abc123\n" + diff})
    write(root, {path: SHARED_NEW})


GAMMA = "def gamma():\n    return 3  # extended\n"
"""A new module (no release ships it) that the second patch, extend, adds whole."""


def add_new_module(project: Project) -> None:
    """Make ``torch/fake/gamma.py`` a new module of the project: null on every base, added by extend."""
    path = "torch/fake/gamma.py"
    raw = json.loads(project.manifest_path.read_text())
    raw["modules"].append({"name": "torch.fake.gamma", "path": path, "new": True})
    for base in raw["bases"]:
        base["sha256"][path] = None
    project.manifest_path.write_text(json.dumps(raw, indent=2) + "\n")
    write(project.root, {f"torch_overlay/{path}": GAMMA})
    claim = '  { file = "torch/fake/beta.py", match = "extended" },\n'
    series = project.series_toml.read_text()
    assert claim in series
    project.series_toml.write_text(series.replace(claim, claim + f'  {{ file = "{path}", match = "extended" }},\n'))
