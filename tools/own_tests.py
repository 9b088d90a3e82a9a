"""A patch's own tests: the test functions (and test classes) its diff adds or changes, as pytest node ids.

``make check-stack CHECK_STACK_ARGS=--own-tests`` runs, at each prefix of the series, only the tests of the
prefix's last patch (:mod:`tools.check_stack`): a test file the patch adds whole (its ``tests``) runs whole;
in any other test file it edits (an upstream test file, ``upstream_test_edits``), :func:`changed_tests` reads
the file as the prefix leaves it and picks, by the lines the patch's diff adds or removes:

- a test function (``test*``) or test method the lines fall in: that test;
- a test class whose header, decorators, attributes or set-up the lines fall in: the whole class;
- a helper the lines fall in (a module-level function, class or assignment, or a method of a test class that
  is not a test): the tests that use it, directly or through other helpers (by name); a method no test names
  (``setUp``, a property the harness reads): the whole class;
- imports and other module-level lines: no test (the lint reads them).

The pytest plugin :mod:`tools._own_tests_plugin` runs only the tests the node ids select (:func:`matches`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from tools.stack_rules import Hunk

SELECT_ENV = "OWN_TESTS_SELECT"
REPORT_ENV = "OWN_TESTS_REPORT"


def changed_lines(hunks: Iterable[Hunk]) -> tuple[set[int], set[int]]:
    """(the new-side numbers of the lines the hunks add, the new-side positions of their removals): a line
    removed between new lines p - 1 and p is at position p."""
    added, removed = set(), set()
    for hunk in hunks:
        new = hunk.new_first
        for tag, _ in hunk.lines:
            if tag == "+":
                added.add(new)
            elif tag == "-":
                removed.add(new)
            new += tag != "-"
    return added, removed


def _span(node: ast.AST) -> tuple[int, int]:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators]), node.end_lineno or node.lineno


def _touched(node: ast.AST, added: set[int], removed: set[int]) -> bool:
    """Whether an added line falls in the node, or a removal strictly inside it."""
    start, end = _span(node)
    return any(start <= n <= end for n in added) or any(start < p <= end for p in removed)


def _is_test(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")


def _is_test_class(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and (node.name.startswith("Test") or any(map(_is_test, node.body)))


def _names(node: ast.AST) -> set[str]:
    """Every name a node reads: bare names, and attributes of ``self`` or ``cls`` (a helper method); not other
    attributes (``torch.full`` does not use a helper named ``full``)."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
            out.add(sub.attr)
    return out


def _defines(node: ast.AST) -> set[str]:
    """The names a module-level statement or class-body statement defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _spread(helpers: list[ast.AST], changed: set[str]) -> set[str]:
    """``changed`` with every helper that uses a changed name, until no more change."""
    changed = set(changed)
    while True:
        more = {name for h in helpers if _names(h) & changed for name in _defines(h)} - changed
        if not more:
            return changed
        changed |= more


def changed_tests(path: str, source: str | bytes, added: set[int], removed: set[int] = frozenset()) -> list[str]:
    """The node ids of the tests in ``source`` (test file ``path`` as the patch leaves it) that the lines the
    patch adds (``added``) or removes (``removed``, positions; :func:`changed_lines`) define or change."""
    module = ast.parse(source)
    tests = [n for n in module.body if _is_test(n) or _is_test_class(n)]
    helpers = [n for n in module.body if n not in tests and _defines(n)]
    changed = _spread(helpers, {name for h in helpers if _touched(h, added, removed) for name in _defines(h)})
    ids: list[str] = []
    for node in tests:
        if isinstance(node, ast.ClassDef):
            ids += _class_tests(path, node, added, removed, changed)
        elif _touched(node, added, removed) or _names(node) & changed:
            ids.append(f"{path}::{node.name}")
    return ids


def _class_tests(path: str, cls: ast.ClassDef, added: set[int], removed: set[int], changed: set[str]) -> list[str]:
    methods = [n for n in cls.body if _is_test(n)]
    helpers = [n for n in cls.body if n not in methods]
    whole = f"{path}::{cls.name}"
    first, body = _span(cls)[0], _span(cls.body[0])[0]  # the header: decorators, bases, up to the body
    header = {n for n in added if first <= n < body} | {p for p in removed if first < p <= body}
    if header or any(_names(b) & changed for b in (*cls.bases, *cls.decorator_list)):
        return [whole]
    if any(not _defines(h) and _touched(h, added, removed) for h in helpers):
        return [whole]  # a statement of the class body that defines nothing (its docstring)
    touched = {name for h in helpers if _touched(h, added, removed) for name in _defines(h)}
    local = _spread(helpers, touched | {name for h in helpers if _names(h) & changed for name in _defines(h)})
    used = {name for m in methods for name in _names(m)}  # what the tests name, directly or through helpers
    while more := {name for h in helpers if _defines(h) & used for name in _names(h)} - used:
        used |= more
    if not touched <= used:
        return [whole]  # a changed method that no test names (setUp, world_size): it runs for every test
    return [f"{whole}::{m.name}" for m in methods if _touched(m, added, removed) or _names(m) & (local | changed)]


def matches(item: object, node_id: str) -> bool:
    """Whether a collected pytest item is a test that ``node_id`` selects: ``path`` (the file),
    ``path::Class`` (its tests and its subclasses' tests), ``path::function`` or ``path::Class::method``
    (the test that function defines, in every class that runs it and every parametrized instance: matched by
    the function's ``__qualname__``, which torch's ``@parametrize`` keeps)."""
    path, *rest = node_id.split("::")
    if getattr(item, "nodeid", "").split("::", 1)[0] != path:
        return False
    if not rest:
        return True
    cls = getattr(item, "cls", None)
    if len(rest) == 1 and cls is not None:
        return rest[0] in {c.__name__ for c in cls.__mro__}
    return getattr(getattr(item, "obj", None), "__qualname__", None) == ".".join(rest)
