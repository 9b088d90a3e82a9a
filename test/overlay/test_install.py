"""Installing torch-overlay never installs, upgrades or downgrades torch, on any torch or none; the wheel carries
the patch series; uninstalling as docs/activation.md says leaves torch byte for byte, and `pip uninstall` alone
leaves nothing silent behind."""

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import unittest
import zipfile
from pathlib import Path

from scratch_env import REPO_ROOT, clean_env, run, torch_tree

import torch_overlay
from tools.quickstart import commands
from torch_overlay._guard import check_base
from torch_overlay._manifest import load_manifest
from torch_overlay._patchset import read_series


def build_wheel(into: Path) -> Path:
    """The package's wheel, built from a copy of the checkout (the build writes build/ and *.egg-info)."""
    source = into / "source"
    shutil.copytree(REPO_ROOT / "torch_overlay", source / "torch_overlay", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO_ROOT / name, source / name)
    # NOTE: copytree followed the link torch_overlay/patches, as the build of a checkout does.
    args = ["wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(into), str(source)]
    result = run([sys.executable, "-m", "pip", *args])
    if result.returncode != 0:
        raise AssertionError(f"building the wheel failed:\n{result.stdout}{result.stderr}")
    return next(into.glob("torch_overlay-*.whl"))


def fake_distribution(site_packages: Path, name: str, version: str) -> None:
    """What pip reads of an installed distribution: its metadata (the package itself is not needed)."""
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("")


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.wheel = build_wheel(cls.root)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def would_install(self, torch_version: str | None) -> list[tuple[str, str]]:
        """What `pip install 'torch-overlay[example]'` would install into an environment holding that torch
        (None: no torch) and numpy, as pip's own resolver decides it (`--dry-run --report`), offline."""
        venv = self.root / f"env-{torch_version}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = venv / "bin" / "python"
        site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
        fake_distribution(site, "numpy", "2.0.0")
        if torch_version is not None:
            fake_distribution(site, "torch", torch_version)
        # NOTE: --isolated: none of this machine's pip configuration (its torch cap, its local wheel directories);
        # --no-index: no registry, so a torch requirement could only fail, never download.
        args = ["--isolated", "--python", str(python), "install", "--dry-run", "--quiet", "--no-index"]
        result = run([sys.executable, "-m", "pip", *args, "--report", "-", f"{self.wheel}[example]"], env=clean_env())
        self.assertEqual(result.returncode, 0, f"pip could not install it next to torch {torch_version}:\n{result}")
        report = json.loads(result.stdout)
        return [(item["metadata"]["name"], item["metadata"]["version"]) for item in report["install"]]

    def test_pip_installs_nothing_but_the_package_on_any_torch(self):
        """A torch that is not a base (an older one, a newer one) or none at all: pip touches no torch. The guard
        refuses the release at activation instead (test_guard.py)."""
        for torch_version in ("2.12.1", "2.16.0", None, check_base().found_version):
            with self.subTest(torch=torch_version):
                self.assertEqual(self.would_install(torch_version), [("torch-overlay", torch_overlay.__version__)])

    def test_the_version_has_one_source(self):
        """pyproject.toml reads the version from the package; the wheel, both commands and the changelog agree."""
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["dynamic"], ["version"])
        self.assertNotIn("version", pyproject["project"])
        self.assertIn(f"torch_overlay-{torch_overlay.__version__}-", self.wheel.name)
        for command in (["-m", "torch_overlay", "--version"], ["-m", "torch_overlay.activate", "--version"]):
            result = run([sys.executable, *command])
            self.assertEqual((result.returncode, result.stdout), (0, f"torch-overlay {torch_overlay.__version__}\n"))
        changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
        self.assertIn(f"\n## {torch_overlay.__version__} ", changelog)
        # The version moves with the code: the changelog's newest section is this version's, and it is a .dev
        # version exactly while that section is unreleased (main after a release), a release's with its date.
        newest = re.search(r"^## (.*)$", changelog, re.MULTILINE)[1]
        self.assertEqual(newest.split()[0], torch_overlay.__version__, f"the newest section is {newest!r}")
        self.assertEqual(".dev" in torch_overlay.__version__, newest.endswith("(unreleased)"), newest)
        self.assertRegex(newest, r"^\S+ \((unreleased|\d{4}-\d{2}-\d{2})\)$")

    def test_the_licence_travels_with_the_package(self):
        """The payload is modified PyTorch source: BSD-3-Clause, PyTorch's notice kept, in the wheel too."""
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["license"], "BSD-3-Clause")
        licence = (REPO_ROOT / "LICENSE").read_text()
        self.assertIn("Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)", licence)
        self.assertIn("Redistributions of source code must retain the above copyright", licence)
        listing = run([sys.executable, "-m", "zipfile", "-l", str(self.wheel)]).stdout
        self.assertRegex(listing, r"torch_overlay-[^/]+\.dist-info/licenses/LICENSE")

    def test_the_quick_start_installs_what_the_example_needs(self):
        """The README's quick start (what `make quickstart` runs, in CI, in a venv with only torch) installs the
        `example` extra, which brings numpy: DCP's object collectives need it on every rank."""
        quick_start = commands(REPO_ROOT / "README.md")
        self.assertRegex(quick_start[0], r"^pip install '\.\[example\]' ")
        self.assertTrue(any(c.startswith("torchrun ") and "examples/tp_ddp_train.py" in c for c in quick_start))
        pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
        self.assertEqual(pyproject["project"]["optional-dependencies"]["example"], ["numpy"])
        self.assertEqual(pyproject["project"]["dependencies"], [], "installing torch-overlay must never touch torch")


class UninstallTest(unittest.TestCase):
    """The README's install (a wheel of the checkout, as `pip install .` builds it) in a scratch venv whose torch is
    a symlink copy of the installed one (fork mode replaces links, never the installed files), then uninstalled."""

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.wheel = build_wheel(cls.root)
        # torch's dependencies, without any torch-overlay distribution: `pip uninstall` here must only ever find
        # the scratch one, never the dev venv's.
        cls.deps = cls.root / "deps"
        cls.deps.mkdir()
        for entry in Path(sysconfig.get_path("purelib")).iterdir():
            if not re.match(r"(torch|__editable__|_?torch_overlay)", entry.name, re.IGNORECASE):
                (cls.deps / entry.name).symlink_to(entry)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def setUp(self) -> None:
        self.venv = Path(tempfile.mkdtemp(dir=self.root, prefix="venv-"))
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True)
        self.python = str(self.venv / "bin" / "python")
        self.site = Path(self.run_here([self.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]))
        # Real directories only where fork mode writes (and their __pycache__, whose cached files it removes).
        paths = [m.path.removeprefix("torch/") for m in load_manifest().modules]
        torch = torch_tree(self.site, tuple(paths))
        for parent in {(torch / p).parent for p in paths}:
            if (parent / "__pycache__").is_symlink():
                (parent / "__pycache__").unlink()
                (parent / "__pycache__").mkdir()
        (self.site / "zz_torch_dependencies.pth").write_text(f"{self.deps}\n")
        self.pristine = self.hashes()
        self.pip("install", "--no-deps", "--no-index", str(self.wheel))

    def run_here(self, args: list[str]) -> str:
        """Run in the scratch venv, outside the checkout (whose torch_overlay the working directory would reach)."""
        result = run(args, cwd=self.root)
        self.assertEqual(result.returncode, 0, f"{args}:\n{result.stdout}{result.stderr}")
        return result.stdout.strip()

    def pip(self, *args: str) -> str:
        if args[0] == "uninstall":  # only ever the scratch venv's distribution
            self.assertTrue(list(self.site.glob("torch_overlay-*.dist-info")), "nothing of ours to uninstall here")
        return self.run_here([sys.executable, "-m", "pip", "--isolated", "--python", self.python, *args])

    def hashes(self) -> dict[str, str | None]:
        files = {m.path: self.site / m.path for m in load_manifest().modules}
        return {p: hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None for p, f in files.items()}

    def startup(self) -> subprocess.CompletedProcess:
        """What every Python process of the environment prints at start-up (none imports torch)."""
        return run([self.python, "-c", "print('ok')"], cwd=self.root)

    def documented_uninstall(self) -> None:
        """docs/activation.md's uninstall block, command by command, as written."""
        text = (REPO_ROOT / "docs" / "activation.md").read_text()
        block = re.search(r"^## Uninstall\n.*?```sh\n(.*?)```", text, re.MULTILINE | re.DOTALL)[1]
        lines = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
        self.assertEqual([line.split()[0] for line in lines], ["python", "torch-overlay", "pip"], block)
        for line in lines:
            program, *args = shlex.split(line)
            if program == "pip":
                self.pip(*args)
            else:
                self.run_here([self.python if program == "python" else str(self.venv / "bin" / program), *args])

    def left_behind(self) -> list[str]:
        return sorted(p.name for p in self.site.iterdir() if re.match(r"torch[-_]overlay", p.name))

    def test_fork_mode_from_the_wheel_then_uninstall(self):
        """Fork mode with the series the wheel carries (no --patches), --check passes; `pip uninstall` alone
        leaves torch patched and says so in one line; the documented sequence restores torch byte for byte."""
        version = check_base().matched.version
        series = read_series(REPO_ROOT / "patches", version)
        listing = zipfile.ZipFile(self.wheel).namelist()
        self.assertTrue({f"torch_overlay/patches/{p.name}" for p in series} <= set(listing), listing)
        applied = self.run_here([str(self.venv / "bin" / "torch-overlay"), "apply-patches"])
        self.assertIn(f"fork mode applied: {len(series)} patches to torch {version}", applied)
        self.assertNotEqual(self.hashes(), self.pristine)
        self.assertIn("check passed: fork mode serves", self.run_here([self.python, "-m", "torch_overlay", "check"]))
        self.assertEqual((self.startup().stdout, self.startup().stderr), ("ok\n", ""))

        self.pip("uninstall", "-y", "torch-overlay")
        said = self.startup()
        self.assertEqual(said.stdout, "ok\n")
        self.assertEqual(len(said.stderr.splitlines()), 1, said.stderr)
        self.assertIn(f"torch-overlay was uninstalled, but its fork mode still patches torch {version}", said.stderr)
        self.assertIn("`torch-overlay revert-patches`", said.stderr)
        self.assertIn(f"`pip install --force-reinstall --no-deps torch=={version}`", said.stderr)

        self.pip("install", "--no-deps", "--no-index", str(self.wheel))
        self.documented_uninstall()
        self.assertEqual(self.hashes(), self.pristine)
        self.assertEqual(self.left_behind(), [])
        self.assertEqual((self.startup().stdout, self.startup().stderr), ("ok\n", ""))

    def test_persistent_install_then_uninstall(self):
        """`pip uninstall` alone: the start-up hook goes silently at the next start-up; the documented sequence
        removes it first."""
        self.run_here([self.python, "-m", "torch_overlay.activate"])
        installed = [
            "torch_overlay",
            f"torch_overlay-{torch_overlay.__version__}.dist-info",
            "torch_overlay_startup.pth",
        ]
        self.assertEqual(self.left_behind(), installed)
        self.pip("uninstall", "-y", "torch-overlay")
        for _ in range(2):
            self.assertEqual((self.startup().stdout, self.startup().stderr), ("ok\n", ""))
        self.assertEqual(self.left_behind(), [])
        self.pip("install", "--no-deps", "--no-index", str(self.wheel))
        self.run_here([self.python, "-m", "torch_overlay.activate"])
        self.documented_uninstall()
        self.assertEqual(self.left_behind(), [])
        self.assertEqual(self.hashes(), self.pristine)


if __name__ == "__main__":
    unittest.main()
