"""Benchmark: the cost of the foreach grouping that keeps DTensors apart from plain tensors, side by side with stock.

One process, CPU, 1 thread. Stock's and the overlay's ``_group_tensors_by_device_and_dtype`` are loaded from their
files under private names, so both run in the same process on the same tensors, in rotated order:

- the grouping alone, on AdamW's five lists (parameters, gradients, two moments, steps) of a plain model, and on
  four lists of 1000 plain tensors (the review's case);
- ``optimizer.step()`` of AdamW and of SGD with momentum (``foreach=True``) on that model, with
  ``torch.optim.optimizer`` calling one grouping or the other;
- all of it first with no subclass that takes foreach calls (``torch.distributed.tensor`` not imported: the overlay's
  grouping is then the C++ grouping after one length check), then again with DTensor registered (imported), where
  the overlay looks at the type of every tensor of the first list;
- the overlay's grouping on the same lists where half the tensors are DTensors (a one-rank mesh): the split path,
  which stock cannot run (its foreach call fails).

The model: ``--layers`` linear layers of ``--dim`` (weight and bias: 200 parameters by default). Median of
``--repeats`` timings of ``--calls`` calls each.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim.optimizer as optimizer_module

from torch_overlay._manifest import load_manifest

MODULE = "torch.utils._foreach_utils"


def load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def groupings() -> dict[str, Callable]:
    stock = load("_stock_foreach_utils", os.path.join(os.path.dirname(torch.__file__), "utils", "_foreach_utils.py"))
    manifest = load_manifest()
    overlay = load("_overlay_foreach_utils", manifest.overlay_files(manifest.payload_base)[MODULE])
    return {"stock": stock._group_tensors_by_device_and_dtype, "overlay": overlay._group_tensors_by_device_and_dtype}


def median_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def adamw_lists(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params],
            [torch.zeros_like(p) for p in params], [torch.tensor(0.0) for _ in params]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = groupings()
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim) for _ in range(args.layers)))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    lists = adamw_lists(params)
    optimizers = {
        "AdamW(foreach=True).step()": torch.optim.AdamW(params, lr=1e-6, foreach=True),
        "SGD(momentum=0.9, foreach=True).step()": torch.optim.SGD(params, lr=1e-6, momentum=0.9, foreach=True),
    }
    review = [[torch.randn(4) for _ in range(1000)] for _ in range(4)]
    print(f"torch {torch.__version__}, {len(params)} parameters, 1 thread; median us per call (best of 2 rounds)")
    print(f"{'':56} {'stock':>10} {'overlay':>10} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as store:  # the file store removes its file when done
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        cases = {
            f"grouping, {len(params)} plain tensors x 5 lists": lists,
            "grouping, 1000 plain tensors x 4 lists": review,
        }
        for registered in (False, True):
            if registered:
                importlib.import_module("torch.distributed.tensor")  # DTensor adds itself to _foreach_supported_types
            print(
                "DTensor registered:"
                if registered
                else "DTensor not registered (torch.distributed.tensor not imported):"
            )
            rows = compare(group, optimizers, cases, args)
            for label, row in rows.items():
                print(f"  {label:54} {row['stock']:10.1f} {row['overlay']:10.1f} {row['overlay'] / row['stock']:7.3f}")
        split_path(group, params, args)
        dist.destroy_process_group()


def compare(group: dict[str, Callable], optimizers: dict, groupings_of: dict, args) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    order = ["stock", "overlay"]
    for round_ in range(2):  # rotated order
        for name in order if round_ == 0 else order[::-1]:
            fn = group[name]
            for label, lists in groupings_of.items():
                row = rows.setdefault(label, {})
                call = functools.partial(fn, lists)
                row[name] = min(row.get(name, float("inf")), median_us(call, args.calls, args.repeats))
            optimizer_module._group_tensors_by_device_and_dtype = fn  # what Optimizer's grouping calls
            for label, opt in optimizers.items():
                row = rows.setdefault(label, {})
                row[name] = min(row.get(name, float("inf")), median_us(opt.step, args.calls, args.repeats))
    optimizer_module._group_tensors_by_device_and_dtype = group["stock"]
    return rows


def split_path(group: dict[str, Callable], params: list[torch.Tensor], args) -> None:
    """The overlay's grouping where half the tensors are DTensors on a one-rank mesh, against all plain."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    mixed = [distribute_tensor(p.detach(), mesh, [Replicate()]) if i % 2 else p for i, p in enumerate(params)]
    mixed_lists, plain_lists = [mixed] * 5, [params] * 5
    split = median_us(functools.partial(group["overlay"], mixed_lists), args.calls, args.repeats)
    plain = median_us(functools.partial(group["overlay"], plain_lists), args.calls, args.repeats)
    print(f"{'overlay grouping, half DTensors (split path)':58} {plain:10.1f} {split:10.1f} {split / plain:7.3f}")
    print("  (this row: the overlay's grouping of the same 5 lists all plain, then half DTensors)")


if __name__ == "__main__":
    sys.exit(main())
