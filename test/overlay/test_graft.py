"""The ``keep_classes`` rule on synthetic modules: the overlay's class bodies on the stock class objects."""

import importlib.util
import sys
import textwrap
import unittest
from importlib.machinery import ModuleSpec
from pathlib import Path
from tempfile import TemporaryDirectory
from unittest import mock

from torch_overlay._graft import GraftError, execute_onto

STOCK = """
import enum
from typing import NamedTuple

class Base:
    def hello(self):
        return "base"

class A(Base):
    LIMIT = 1

    def hello(self):
        return "stock " + super().hello()

    def gone(self):
        return "gone"

class Kind(enum.Enum):
    ONE = 1

class Pair(NamedTuple):
    x: int
    y: int = 0

TABLE = {Kind.ONE: A}
"""

OVERLAY = STOCK.replace('"stock "', '"ours "').replace(
    "LIMIT = 1", "LIMIT = 2\n\n    def added(self):\n        return 1"
)
OVERLAY = OVERLAY.replace('    def gone(self):\n        return "gone"\n', "")


def load(tmp: str, name: str, source: str) -> ModuleSpec:
    path = Path(tmp, f"{name}_{abs(hash(source))}.py")
    path.write_text(textwrap.dedent(source))
    return importlib.util.spec_from_file_location(name, path)


class GraftTest(unittest.TestCase):
    def setUp(self):
        self.tmp = TemporaryDirectory()
        spec = load(self.tmp.name, "fake_stock", STOCK)
        self.stock = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.stock)
        self.namespace = dict(vars(self.stock.A))

    def tearDown(self):
        self.tmp.cleanup()
        sys.modules.pop("fake_stock", None)

    def serve(self, source: str):
        spec = load(self.tmp.name, "fake_stock", source)
        module = importlib.util.module_from_spec(spec)
        return module, execute_onto(self.stock, module, spec.loader.exec_module)

    def test_classes_stay_stock_with_our_bodies_and_undo_restores(self):
        stock = self.stock
        subclass = type("UserA", (stock.A,), {})
        module, graft = self.serve(OVERLAY)
        self.assertIs(module.A, stock.A)
        self.assertIs(module.Kind, stock.Kind)
        self.assertIs(module.Pair, stock.Pair)
        self.assertIs(module.TABLE[stock.Kind.ONE], stock.A)
        a = stock.A()
        self.assertEqual(a.hello(), "ours base")  # zero-argument super() on the stock class
        self.assertEqual(subclass().hello(), "ours base")
        self.assertEqual((stock.A.LIMIT, a.added()), (2, 1))
        self.assertFalse(hasattr(a, "gone"))
        graft.undo()
        self.assertEqual(a.hello(), "stock base")
        self.assertEqual(vars(stock.A).keys(), self.namespace.keys())
        self.assertTrue(all(vars(stock.A)[k] is v for k, v in self.namespace.items()))

    def test_undo_keeps_what_changed_since(self):
        """A ``mock.patch`` entered before the graft and left while it is installed has put back the stock
        method: undo leaves it, and does not put back the mock."""
        stock, stock_hello = self.stock, self.stock.A.hello
        with mock.patch.object(stock.A, "hello", lambda self: "mocked"):
            _, graft = self.serve(OVERLAY)
            self.assertEqual(stock.A().hello(), "ours base")
        self.assertIs(stock.A.hello, stock_hello)
        graft.undo()
        self.assertIs(stock.A.hello, stock_hello)
        self.assertEqual(stock.A.LIMIT, 1)

    def test_a_changed_enum_raises_and_changes_nothing(self):
        with self.assertRaisesRegex(GraftError, "fake_stock.Kind: the overlay changes an enum"):
            self.serve(OVERLAY.replace("ONE = 1", "ONE = 1\n    TWO = 2"))
        self.assertEqual(self.stock.A().hello(), "stock base")
        self.assertTrue(all(vars(self.stock.A)[k] is v for k, v in self.namespace.items()))

    def test_changed_bases_raise(self):
        with self.assertRaisesRegex(GraftError, "fake_stock.A: the overlay changes its bases"):
            self.serve(OVERLAY.replace("class A(Base):", "class A:"))


if __name__ == "__main__":
    unittest.main()
