"""The documentation stays true: the `--status` sample and the served-file list in docs/activation.md against the tool
and the manifest, the README's size, every relative link and anchor, the docs sections that code cites, and no
internal tracker numbers or commit hashes in README.md and docs/*.md."""

import re
import sys
import unittest
from pathlib import Path

from scratch_env import REPO_ROOT, run

import torch_overlay
from torch_overlay._manifest import load_manifest

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
ACTIVATION = DOCS / "activation.md"
README_LIMIT = 15_000
STALE = re.compile(r"issue [0-9]+|[0-9a-f]{7,40}")
"""What ``grep -nE 'issue [0-9]+|[0-9a-f]{7,40}' README.md docs/*.md`` finds: this project's tracker numbers, commit
hashes (and any other hex run a reader could take for one)."""
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITATION = re.compile(r"""(docs/[\w.-]+\.md), ["']([^"']+)["']""")
"""A docs page and section cited by code, e.g. ``(docs/patches.md, 'Add a torch release')``."""
README_CITATION = re.compile(r"""\bREADME(?:\.md)?, ["']([^"']+)["']""")
"""A README section cited by code, e.g. ``(README, "Quick start")``."""
CITING = ["torch_overlay/*.py", "tools/*.py", "test/overlay/*.py", "Makefile", ".ci/run"]


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for _, line in prose(text) if re.match(r"#{1,6} ", line)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens, -1, -2 for
    repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of that level or above."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^##? |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise AssertionError(f"no section '## {heading}'")
    return match.group(1)


def status_rows(text: str) -> tuple[list[str], list[str]]:
    """The ``--status`` table's row names (``torch-overlay``, ``base``, ...) and its module rows, in order. The
    ``problem:`` and ``warning:`` lines depend on the environment and are left out."""
    names, modules = [], []
    for line in text.splitlines():
        if line.startswith("  "):
            modules.append(line.split()[0])
        elif ":" in line:
            name = line.split(":", 1)[0]
            if name not in ("problem", "warning"):
                names.append(name)
    return names, modules


def field(text: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}:\s+(.*)$", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"no '{name}:' row in\n{text}")
    return match.group(1)


class DocsTest(unittest.TestCase):
    def setUp(self) -> None:
        self.manifest = load_manifest()

    def status_sample(self) -> str:
        match = re.search(r"^```\n(torch-overlay: .*?)^```", section(ACTIVATION.read_text(), "`--status`"), re.M | re.S)
        self.assertIsNotNone(match, f"{ACTIVATION}: no --status sample block")
        return match.group(1)

    def test_status_sample_is_what_the_tool_prints(self):
        sample = self.status_sample()
        printed = run([sys.executable, "-m", "torch_overlay.activate", "--status"])
        self.assertIn(printed.returncode, (0, 1), printed.stderr)
        tool = printed.stdout
        runtime = [m.name for m in self.manifest.runtime_modules]
        sample_names, sample_modules = status_rows(sample)
        tool_names, tool_modules = status_rows(tool)
        self.assertEqual(sample_names, tool_names, f"the sample's rows are not the tool's:\n{tool}")
        self.assertEqual(sample_modules, runtime, "the sample's module rows are not the manifest's runtime modules")
        self.assertEqual(tool_modules, runtime)
        # The counts, the bases, what is not served and the version, as the manifest and the package say.
        files = re.search(r"(\d+) files", field(sample, "base"))
        self.assertEqual(int(files[1]) if files else None, len(self.manifest.modules), "the sample's 'N files'")
        modules = re.match(r"(\d+) modules", field(sample, "served"))
        self.assertEqual(int(modules[1]) if modules else None, len(runtime), "the sample's 'N modules'")
        for name in ("bases", "not served", "served"):
            self.assertEqual(field(sample, name), field(tool, name), name)
        self.assertEqual(field(sample, "torch-overlay").split()[0], torch_overlay.__version__)
        self.assertEqual(re.search(r"\d+ files", field(tool, "base"))[0], files[0])

    def test_served_file_list_is_the_manifest(self):
        rows = re.findall(r"^\| `(torch/[^`]+)` \| ([^|]+) \|", section(ACTIVATION.read_text(), "What is served"), re.M)
        served = [path for path, how in rows if how.startswith("at run time")]
        docstrings = [path for path, how in rows if how.startswith("no")]
        self.assertEqual(len(served) + len(docstrings), len(rows), f"a row neither served nor not: {rows}")
        runtime = [m.path for m in self.manifest.runtime_modules]
        self.assertEqual(served, runtime, "docs/activation.md, 'What is served'")
        self.assertEqual(docstrings, [m.path for m in self.manifest.modules if not m.runtime])
        new = [path for path, how in rows if "a new module" in how]
        self.assertEqual(new, [m.path for m in self.manifest.runtime_modules if m.new])

    def test_readme_is_a_map(self):
        size = len(README.read_bytes())
        self.assertLessEqual(size, README_LIMIT, f"README.md is {size} bytes: move detail to docs/")
        linked = {m.group(1).split("#")[0] for m in LINK.finditer(README.read_text())}
        for page in sorted(DOCS.glob("*.md")):
            self.assertIn(f"docs/{page.name}", linked, f"README.md does not link {page.name}")

    def test_relative_links_and_anchors_resolve(self):
        problems = []
        for page in pages():
            lines = prose(page.read_text())
            text = "\n".join(line for _, line in lines)  # a link's text may span lines
            for match in LINK.finditer(text):
                target, number = match.group(1), lines[text.count("\n", 0, match.start())][0]
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO_ROOT)}:{number}: {target}"
                if not file.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                    problems.append(f"{where}: no heading with that anchor in {file.name}")
        self.assertEqual(problems, [])

    def test_code_cites_existing_sections(self):
        problems, found = [], 0
        for pattern in CITING:
            for source in sorted(REPO_ROOT.glob(pattern)):
                for number, line in enumerate(source.read_text().splitlines(), 1):
                    cited = CITATION.findall(line) + [("README.md", h) for h in README_CITATION.findall(line)]
                    for page, heading in cited:
                        found += 1
                        target = REPO_ROOT / page
                        if not target.exists() or heading not in headings(target.read_text()):
                            problems.append(f"{source.relative_to(REPO_ROOT)}:{number}: {page}, {heading!r}")
        self.assertEqual(problems, [], "cited sections that do not exist")
        self.assertGreater(found, 0)

    def test_no_internal_issue_numbers_or_commit_hashes(self):
        found = [
            f"{page.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
            for page in pages()
            for number, line in enumerate(page.read_text().splitlines(), 1)
            if STALE.search(line)
        ]
        self.assertEqual(found, [], "name what changed instead")


if __name__ == "__main__":
    unittest.main()
