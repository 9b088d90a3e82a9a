"""Benchmark: the cost of the foreach grouping that keeps DTensors apart from plain tensors, side by side with stock.

One process, CPU, 1 thread. Stock's and the overlay's ``_group_tensors_by_device_and_dtype`` are loaded from their
files under private names, so both run in the same process on the same tensors, interleaved: each of ``--repeats``
repeats times ``--calls`` calls of stock's, the overlay's and stock's again, in an order rotated from one repeat to
the next, and a row gives the fastest timings and the median (and quartiles) over the repeats of overlay / stock
in the same repeat; stock again / stock is the noise floor of that ratio on the machine as loaded. Timings are
the CPU time of the benchmark's thread (``time.thread_time``; torch runs one thread), so that the time other
processes of a loaded machine take does not count:

- the grouping alone, on AdamW's five lists (parameters, gradients, two moments, steps) of a plain model, and on
  four lists of 1000 plain tensors (the review's case);
- ``optimizer.step()`` of AdamW and of SGD with momentum (``foreach=True``) on that model, with
  ``torch.optim.optimizer`` calling one grouping or the other;
- all of it first with no subclass that takes foreach calls (``torch.distributed.tensor`` not imported: the overlay's
  grouping is then the C++ grouping after one length check), then again with DTensor registered (imported), where
  the overlay looks at the type of each tensor of the first list, in C, until the first DTensor;
- what the overlay adds there, its check of the first list, timed alone (less an empty call);
- the overlay's grouping on the same lists where half the tensors are DTensors (a one-rank mesh): the split path,
  which stock cannot run (its foreach call fails).

The model: ``--layers`` linear layers of ``--dim`` (weight and bias: 200 parameters by default); an optimizer's
timing is ``--step-calls`` steps.
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


def paired(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, list[float]]:
    """Each function's timings (CPU time of this thread, us per call, ``calls`` calls a timing), interleaved:
    every repeat times each function once, in an order rotated from one repeat to the next, so that the timings
    of one repeat share the machine's load (:func:`ratios`)."""
    names, times = list(fns), {name: [] for name in fns}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            start = time.thread_time()
            for _ in range(calls):
                fn()
            times[name].append((time.thread_time() - start) / calls * 1e6)
    return times


def ratios(times: dict[str, list[float]], name: str, against: str = "stock") -> tuple[float, float, float]:
    """The median and quartiles of ``name``'s timing over ``against``'s of the same repeat."""
    q1, median, q3 = statistics.quantiles([a / b for a, b in zip(times[name], times[against], strict=True)], n=4)
    return median, q1, q3


def adamw_lists(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params],
            [torch.zeros_like(p) for p in params], [torch.tensor(0.0) for _ in params]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--step-calls", type=int, default=10, help="optimizer steps a timing")
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
    print(f"torch {torch.__version__}, {len(params)} parameters, 1 thread; us per call, the fastest of {args.repeats}")
    print("repeats; ratio: the median over the repeats of overlay / stock timed in the same repeat [quartiles];")
    print("stock again / stock: the same for stock's grouping against itself, the noise floor of the ratio")
    print(f"{'':50} {'stock':>9} {'overlay':>9} {'overlay / stock':>22} {'stock again / stock':>22}")
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
            for label, times in compare(group, optimizers, cases, args).items():
                ratio, control = ratios(times, "overlay"), ratios(times, "stock again")
                cells = [f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]" for r in (ratio, control)]
                fastest = f"{min(times['stock']):9.1f} {min(times['overlay']):9.1f}"
                print(f"  {label:48} {fastest} {cells[0]:>22} {cells[1]:>22}")
        check_alone(params, review[0], args)
        split_path(group, params, args)
        dist.destroy_process_group()


def compare(
    group: dict[str, Callable], optimizers: dict, groupings_of: dict, args
) -> dict[str, dict[str, list[float]]]:
    """Each case's timings with stock's grouping, the overlay's, and stock's again (:func:`paired`)."""
    impls = {"stock": group["stock"], "overlay": group["overlay"], "stock again": group["stock"]}
    rows = {}
    for label, lists in groupings_of.items():
        rows[label] = paired({n: functools.partial(fn, lists) for n, fn in impls.items()}, args.calls, args.repeats)

    def step(opt: torch.optim.Optimizer, fn: Callable) -> Callable[[], None]:
        def run() -> None:
            optimizer_module._group_tensors_by_device_and_dtype = fn  # what Optimizer's grouping calls
            opt.step()

        return run

    for label, opt in optimizers.items():
        fns = {n: step(opt, fn) for n, fn in impls.items()}
        rows[label] = paired(fns, args.step_calls, args.repeats)
    optimizer_module._group_tensors_by_device_and_dtype = group["stock"]
    return rows


def check_alone(params: list[torch.Tensor], plain: list[torch.Tensor], args) -> None:
    """What the overlay adds to stock's grouping for a list without DTensors, DTensor registered: its check of
    the first list, timed alone (the same two lines as in the overlay), against an empty call."""
    from torch.utils._foreach_utils import _foreach_supported_types
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

    def check(first: list[torch.Tensor]) -> bool:
        wrappers = set(filter(is_traceable_wrapper_subclass_type, _foreach_supported_types))
        return wrappers.isdisjoint(map(type, first))

    for first in (params, plain):
        fns = {"empty": functools.partial(len, first), "check": functools.partial(check, first)}
        times = paired(fns, args.calls * 10, args.repeats)
        label = f"the overlay's check alone, {len(first)} tensors"
        print(f"  {label:48} {min(times['check']) - min(times['empty']):9.2f} us")


def split_path(group: dict[str, Callable], params: list[torch.Tensor], args) -> None:
    """The overlay's grouping where half the tensors are DTensors on a one-rank mesh, against all plain."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    mixed = [distribute_tensor(p.detach(), mesh, [Replicate()]) if i % 2 else p for i, p in enumerate(params)]
    mixed_lists, plain_lists = [mixed] * 5, [params] * 5
    fns = {"plain": functools.partial(group["overlay"], plain_lists)}
    fns["split"] = functools.partial(group["overlay"], mixed_lists)
    times = paired(fns, args.calls, args.repeats)
    median, q1, q3 = ratios(times, "split", "plain")
    fastest = f"{min(times['plain']):9.1f} {min(times['split']):9.1f}"
    print(f"  {'overlay grouping, half DTensors (split path)':48} {fastest} {median:.3f} [{q1:.3f}, {q3:.3f}]")
    print("  (this row: the overlay's grouping of the same 5 lists all plain, then half DTensors)")


if __name__ == "__main__":
    sys.exit(main())
