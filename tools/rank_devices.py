"""Where the test suite's multi-rank tests run: on CPU with gloo wherever there are fewer GPUs than ranks.

A multi-rank test (a ``MultiProcContinuousTest`` or a ``MultiProcessTestCase``: one process per rank) uses one GPU
per rank with NCCL. On a machine with some GPUs but fewer than the test's ranks (one GPU, 2 or 4 ranks), torch
2.13's and 2.14's ``DTensorContinuousTestBase`` skips the test (2.15's falls back to CPU), and the suite's
red/green harness (test/conftest.py) counts a skipped red test as a failure. So while such a test spawns its
ranks, the suite hides the GPUs from them (``CUDA_VISIBLE_DEVICES=''``): each rank sees a machine without a GPU
and runs on CPU with gloo, through the test's own device selection (``self.device_type``, the backend that goes
with it), which every test of the suite supports. With as many GPUs as ranks, or none, nothing changes: the tests
pick CUDA and NCCL, or CPU and gloo, themselves, as in upstream's CI. Upstream test files are not touched.
"""

from __future__ import annotations

import inspect

_MULTI_RANK_BASES = ("MultiProcContinuousTest", "MultiProcessTestCase")
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
"""What the ranks of a test with more ranks than GPUs get (ROCm's HIP runtime reads it too)."""


def world_size(cls: type | None) -> int | None:
    """The ranks a multi-rank test class spawns; None for any other class, or where it takes one rank per GPU
    (``world_size`` unset)."""
    if cls is None or not any(base.__name__ in _MULTI_RANK_BASES for base in cls.__mro__):
        return None
    attr = inspect.getattr_static(cls, "world_size", None)
    # NOTE: DTensorTestBase's world_size is a property of the instance (upstream's harness reads it the same way)
    size = attr.fget(object.__new__(cls)) if isinstance(attr, property) else getattr(cls, "world_size", None)
    return size if isinstance(size, int) and size > 0 else None


def rank_env(ranks: int | None, accelerator: str | None, count: int) -> dict[str, str]:
    """The environment a test's ranks get on a machine with ``count`` devices of ``accelerator`` (None: none):
    :data:`HIDE_GPUS` for a test with more ranks than the machine has GPUs, at least one; else nothing."""
    if ranks is None or accelerator != "cuda" or not 0 < count < ranks:
        return {}
    return dict(HIDE_GPUS)


def rank_env_here(cls: type | None) -> dict[str, str]:
    """:func:`rank_env` for test class ``cls`` on this machine."""
    ranks = world_size(cls)
    if ranks is None:
        return {}
    import torch  # NOTE: only for a multi-rank test, which imports torch anyway

    current = torch.accelerator.current_accelerator()
    return rank_env(ranks, None if current is None else current.type, torch.accelerator.device_count())
