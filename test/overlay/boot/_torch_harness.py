"""The test helpers of the newest bases' harness, on a base whose own harness lacks them (torch 2.11).

The tests use ``DTensorContinuousTestBase`` as torch 2.12 and later define it, with ``DTensorTestMixin``'s helpers:
``self.device_type`` a string, ``build_device_mesh()``, ``init_manual_seed_for_rank()``, ``run_subtests()``. torch
2.11's class has ``device_type`` as a classmethod and none of the others (its ``DTensorTestBase`` has them all). Where
the installed harness has no ``DTensorTestMixin``, :func:`install` makes importing
``torch.testing._internal.distributed._tensor.common_dtensor`` give a module whose ``DTensorContinuousTestBase`` is
a subclass of torch's own with those helpers, taken from torch's own ``DTensorTestBase``. Nothing in torch changes:
a base whose harness has the mixin gets its module as it is.

Installed in every interpreter of the suite (the boot directory's ``sitecustomize``, spawned ranks included) and
in the pytest process (``test/conftest.py``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
import time

MODULE = "torch.testing._internal.distributed._tensor.common_dtensor"
HELPERS = ("build_device_mesh", "init_manual_seed_for_rank", "run_subtests", "_test_op_on_dtensor", "_test_op")


class _DeviceType:
    """``device_type`` as both harnesses need it: ``cls.device_type()`` (torch 2.11's spawning calls it) and
    ``self.device_type``, a string (the tests, as on torch 2.12+)."""

    def __init__(self, function) -> None:
        self.function = function

    def __get__(self, obj, cls):
        if obj is None:
            return functools.partial(self.function, cls)
        return self.function(cls)


def add_helpers(module) -> None:
    """Give ``module`` (torch's ``common_dtensor``) a ``DTensorContinuousTestBase`` with the mixin's helpers,
    where it has no ``DTensorTestMixin``."""
    if hasattr(module, "DTensorTestMixin") or not hasattr(module, "DTensorContinuousTestBase"):
        return
    base, helpers = module.DTensorContinuousTestBase, module.DTensorTestBase
    namespace = {name: helpers.__dict__[name] for name in HELPERS if name in helpers.__dict__}
    namespace["device_type"] = _DeviceType(base.__dict__["device_type"].__func__)
    namespace["__module__"] = module.__name__
    namespace["__qualname__"] = base.__qualname__
    module.DTensorContinuousTestBase = type(base.__name__, (base,), namespace)


class _Loader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        add_helpers(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Add the helpers when the module is imported (or now, if it already is); idempotent."""
    if MODULE in sys.modules:
        add_helpers(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class RankWatch:
    """The dead-rank check of torch 2.12+'s ``MultiProcContinuousTest``, for a harness that has none (torch 2.11).

    torch 2.11's waits on each rank's completion queue without a timeout: a rank that dies (a red test aborting
    on stock torch, say) leaves the test, and the suite, waiting for ever. While a test runs, a thread in the
    pytest process answers for each dead rank that left no result, as torch 2.12's
    ``retrieve_result_from_completion_queue`` does, ``RuntimeError("Exited with <code>")``; a rank still silent
    after the test's timeout (``get_timeout``), or ``GRACE_S`` after another rank died (it waits for it in a
    collective), is killed, and so answered. In the teardown of a class (``teardown=True``), whose
    ``tearDownClass`` joins its ranks, one still alive after ``TEARDOWN_S`` is killed. On a harness that has the
    check, nothing is watched.
    """

    POLL_S = 1.0
    GRACE_S = 60.0
    TEARDOWN_S = 120.0

    @staticmethod
    def watches(cls) -> bool:
        """Whether ``cls`` (a test class, or None) runs its tests in a MultiProcContinuousTest's ranks."""
        module = sys.modules.get("torch.testing._internal.common_distributed")
        base = getattr(module, "MultiProcContinuousTest", None)
        return isinstance(cls, type) and base is not None and issubclass(cls, base)

    def __init__(self, cls) -> None:
        from torch.testing._internal import common_distributed

        self.cls = cls
        self.needed = not hasattr(common_distributed, "retrieve_result_from_completion_queue")
        self.get_timeout = common_distributed.get_timeout
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="rank-watch", daemon=True)

    def start(self, test_id: str, teardown: bool = False) -> RankWatch:
        self.test_id, self.teardown = test_id, teardown
        if self.needed:
            self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()

    def _watch(self) -> None:
        start, answered, died = time.monotonic(), set(), None
        timeout = self.TEARDOWN_S if self.teardown else self.get_timeout(self.test_id)
        while not self.done.wait(self.POLL_S):
            processes = getattr(self.cls, "processes", None) or []
            queues = getattr(self.cls, "completion_queues", None) or []
            now = time.monotonic()
            late = now - start > timeout or (died is not None and now - died > self.GRACE_S)
            # while the first test spawns them, the lists may be one apart
            for rank, (process, queue) in enumerate(zip(processes, queues, strict=False)):
                if rank in answered or (not self.teardown and not queue.empty()):
                    continue
                if not process.is_alive():
                    if not self.teardown:
                        queue.put(RuntimeError(f"Exited with {process.exitcode}"))
                    answered.add(rank)
                    died = now if died is None else died
                elif late:  # then answered as dead: a result put now could be read by the next test
                    print(f"rank-watch: {self.test_id}: rank {rank} still running, killed", file=sys.stderr)
                    process.kill()
