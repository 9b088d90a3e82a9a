"""Benchmark: clip_grad_norm_ over FSDP2 + TP (two meshes), stock FSDP2 (one mesh) and a full_tensor() clip.

4 ranks, CPU/gloo, 1 thread per rank, one run, side by side. The same model size in each configuration: blocks of
two linear layers (48 TP parameters: weights and biases, ColwiseParallel / RowwiseParallel) between a plain
``embed`` and ``head``:

(a) overlay, FSDP2 + TP on a 2x2 (dp x tp) mesh: ``fully_shard(mesh=mesh["dp"])`` per block and at the root, so the
    TP parameters are DTensors on the 2-D mesh and ``embed``/``head`` on the dp mesh;
(b) overlay, the same with ``embed``/``head`` left plain (``fully_shard`` on the blocks only);
(c) stock, FSDP2 without TP on one 1-D mesh of the 4 ranks (what stock torch can clip): the baseline;
(d) a hand-written clip over (a)'s model that gathers each DTensor gradient with ``full_tensor()`` to take its norm
    (the first version of transformers' DTensor clip), then scales the local shards;
(e) the plain path: a model of 200 plain parameters (``--plain-layers`` linear layers of ``dim``) in one process,
    overlay against stock, alternating call by call, paired per repeat (``torch.distributed.tensor`` imported, so
    the overlay's check for DTensors runs in full).

Per configuration: the time of one ``clip_grad_norm_`` (median over repeats of the slowest rank; configurations in
rotated order), its ratio to (c), the collectives of one call (``CommDebugMode``), the bytes they gather, the
largest single gather (the transient extra memory of a clip that gathers one gradient at a time), and the peak
extra memory of one call: the largest over ranks of the peak resident set size (``VmHWM``, reset before the
call) above the size before it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tools.bench_tp_ddp import Block  # the same residual MLP block
from tools.ranks import reset_peak_rss, run_ranks, slowest, status_kib

WORLD_SIZE = 4
MAX_NORM = 1e9  # no clipping: repeated calls leave the gradients as they are
NAMES = {
    "mixed": "(a) overlay FSDP2+TP, 2 meshes",
    "mixed_plain": "(b) overlay FSDP2+TP + plain params",
    "stock": "(c) stock FSDP2, 1 mesh (baseline)",
    "full_tensor": "(d) full_tensor() clip over (a)",
}


class Model(nn.Module):
    def __init__(self, blocks: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(kind: str, mesh, blocks: int, dim: int, hidden: int) -> nn.Module:
    """The model of configuration ``kind`` after one backward (its gradients are what is clipped)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Model(blocks, dim, hidden)
    if kind == "stock":
        world = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model.blocks:
            fully_shard(block, mesh=world)
        fully_shard(model, mesh=world)
    else:
        plan = {}
        for i in range(blocks):
            plan[f"blocks.{i}.w1"] = ColwiseParallel()
            plan[f"blocks.{i}.w2"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        if kind != "mixed_plain":
            fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(1)
    model(torch.randn(8, dim)).sum().backward()
    return model


def full_tensor_clip(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The hand-written clip users have today: gather each DTensor gradient whole to take its norm."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.full_tensor() if isinstance(g, DTensor) else g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total


def comm_figures(clip: Callable[[], object]) -> dict[str, int]:
    """Collectives of one call (by op name), the bytes gathered (outputs of all-gathers), the largest gather, and
    the peak resident set size of another call above the size before it (``peak_extra``)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class GatheredBytes(TorchDispatchMode):
        gathered = largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "gather" in func.__name__:
                outs = out if isinstance(out, (list, tuple)) else [out]
                for t in outs:
                    for x in t if isinstance(t, list) else [t]:
                        if isinstance(x, torch.Tensor):
                            GatheredBytes.gathered += x.numel() * x.element_size()
                            GatheredBytes.largest = max(GatheredBytes.largest, x.numel() * x.element_size())
            return out

    with CommDebugMode() as comm, GatheredBytes():
        clip()
    dist.barrier()
    reset_peak_rss()
    rss_before = status_kib("VmRSS")
    clip()
    peak_extra = (status_kib("VmHWM") - rss_before) * 1024
    figures = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if n}
    figures["collectives"] = sum(comm.get_comm_counts().values())
    figures["gathered_bytes"] = GatheredBytes.gathered
    figures["largest_gather"] = GatheredBytes.largest
    figures["peak_extra"] = peak_extra
    return figures


def _worker(rank: int, init_file: str, args: argparse.Namespace, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import torch_overlay

    # (d)'s full_tensor() of FSDP2 + TP gradients warns at each call about its sequential all-gathers.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch_overlay.activate()
    models = {kind: build(kind, mesh, args.blocks, args.dim, args.hidden) for kind in ("mixed", "mixed_plain", "stock")}
    params = {kind: list(model.parameters()) for kind, model in models.items()}
    clips: dict[str, Callable[[], object]] = {
        "mixed": lambda: torch.nn.utils.clip_grad_norm_(params["mixed"], MAX_NORM),
        "mixed_plain": lambda: torch.nn.utils.clip_grad_norm_(params["mixed_plain"], MAX_NORM),
        "stock": lambda: torch.nn.utils.clip_grad_norm_(params["stock"], MAX_NORM),
        "full_tensor": lambda: full_tensor_clip(params["mixed"], MAX_NORM),
    }

    def overlay(kind: str) -> None:
        # The stock configuration runs stock torch's clip_grad.py, the others the overlay's.
        if kind == "stock":
            torch_overlay.deactivate()
        else:
            torch_overlay.activate()

    comms = {}
    for kind, clip in clips.items():
        overlay(kind)
        clip()  # warm-up
        comms[kind] = comm_figures(clip)
    times: dict[str, list[float]] = {kind: [] for kind in clips}
    keys = list(clips)
    for repeat in range(args.repeats):
        shift = repeat % len(keys)
        for kind in keys[shift:] + keys[:shift]:
            overlay(kind)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                clips[kind]()
            times[kind].append((time.perf_counter() - start) / args.iters)
    torch_overlay.activate()
    queue.put((rank, times, comms))
    dist.destroy_process_group()


def plain_ratios(args: argparse.Namespace) -> tuple[float, float, list[float], float]:
    """(e): (overlay ms, stock ms, overlay/stock per repeat, ms of the overlay's two checks for DTensors) per call
    for a plain model, in this process.

    NOTE: stock's and the overlay's ``clip_grad_norm_`` are both at hand (activation never changes the stock
    module object), so the two alternate call by call: a load that changes within a repeat hits both alike.
    """
    import torch.distributed.tensor  # noqa: F401  # loaded in any distributed script: the overlay's check runs
    import torch.nn.utils.clip_grad

    import torch_overlay

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim) for _ in range(args.plain_layers)))
    model(torch.randn(8, args.dim)).sum().backward()
    params = list(model.parameters())
    stock = torch.nn.utils.clip_grad
    torch_overlay.activate()
    overlay = sys.modules["torch.nn.utils.clip_grad"]
    assert overlay is not stock, "the overlay's clip_grad.py is not active"
    clips = {True: overlay.clip_grad_norm_, False: stock.clip_grad_norm_}
    for clip in clips.values():
        clip(params, MAX_NORM)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.plain_repeats):
        total = {True: 0.0, False: 0.0}
        for i in range(args.iters):
            for active in (True, False) if i % 2 == 0 else (False, True):
                start = time.perf_counter()
                clips[active](params, MAX_NORM)
                total[active] += time.perf_counter() - start
        for active, seconds in total.items():
            times[active].append(seconds / args.iters)
    grads = [p.grad for p in params]
    start = time.perf_counter()
    for _ in range(1000):
        overlay._spans_meshes(grads)  # the norm's check
        overlay._spans_meshes([*grads, grads[0]])  # the clip's (gradients and the norm)
    check_ms = time.perf_counter() - start
    torch_overlay.deactivate()
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3, ratios, check_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12, help="TP blocks (4 TP parameters each)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--plain-layers", type=int, default=100, help="(e): linear layers (2 parameters each)")
    parser.add_argument("--plain-repeats", type=int, default=101, help="(e): paired repeats")
    args = parser.parse_args(argv)
    print(
        f"{WORLD_SIZE} ranks, CPU/gloo, 1 thread per rank, torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"{args.blocks} blocks ({4 * args.blocks} TP parameters, dim {args.dim}, hidden {args.hidden}), "
        f"median of {args.repeats} x {args.iters} calls"
    )
    gathered = run_ranks(_worker, WORLD_SIZE, args)
    if gathered is None:
        return 1
    times = {rank: t for rank, t, _ in gathered}
    comms = {rank: c for rank, _, c in gathered}
    medians = {kind: statistics.median(slowest(t[kind] for t in times.values())) for kind in NAMES}
    print(
        f"\n{'':<38}{'ms/clip':>9}{'x stock':>9}{'collectives':>13}{'gathered bytes':>16}{'largest':>12}"
        f"{'peak extra':>12}  ops"
    )
    for kind, name in NAMES.items():
        worst = max(comms.values(), key=lambda c: c[kind]["gathered_bytes"])[kind]
        ops = ", ".join(
            f"{op} {n}"
            for op, n in worst.items()
            if op not in ("collectives", "gathered_bytes", "largest_gather", "peak_extra")
        )
        peak = max(c[kind]["peak_extra"] for c in comms.values())
        print(
            f"{name:<38}{medians[kind] * 1e3:>9.2f}{medians[kind] / medians['stock']:>9.2f}"
            f"{worst['collectives']:>13}{worst['gathered_bytes']:>16,}{worst['largest_gather']:>12,}"
            f"{peak / 2**20:>8.1f} MiB  {ops}"
        )
    overlay_ms, stock_ms, ratios, check_ms = plain_ratios(args)
    print(
        f"\n(e) plain model, {2 * args.plain_layers} parameters (dim {args.dim}), one process, median of "
        f"{args.plain_repeats} x {args.iters} calls: overlay {overlay_ms:.3f} ms, stock {stock_ms:.3f} ms per call; "
        f"overlay/stock paired per repeat: median {statistics.median(ratios):.3f} (range {min(ratios):.3f} .. "
        f"{max(ratios):.3f}; target <= 1.02); the overlay's checks for DTensors: {check_ms * 1e3:.1f} us per call "
        f"({check_ms / stock_ms:.2%} of stock's call)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
