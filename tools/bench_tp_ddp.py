"""Benchmark: TP + DDP on a 2x2 (dp x tp) mesh, 4 ranks, CPU/gloo, stock and overlay side by side in one run.

1. Swap hooks: the per-forward cost of the hooks ``DDP(device_mesh=...)`` registers, for a model with >= 256
   DTensor parameters: the overlay's (each owner's forward pre-hook puts its cached DTensor view of each TP
   parameter in place, after checking it is still valid; its forward hook drops it) and
   stock's (the root's two hooks, once the first forward has turned the TP parameters into plain DTensor
   attributes), against a bare loop of ``DTensor.from_local`` over the same local parameters (what building a
   view per parameter and forward costs). Hooks are called directly, so the figure is the hooks alone,
   without any forward compute.
2. Training step (forward, backward, SGD step) of a 16-block TP MLP (ColwiseParallel/RowwiseParallel):
   (a) overlay ``DDP(device_mesh=mesh["dp"])``; (b) stock ``DDP(device_mesh=mesh["dp"])``; (c) FSDP2
   ``fully_shard(mesh=mesh["dp"])`` per block and at the root, over the same TP model (overlay active; FSDP2 is
   not overlaid); (f) upstream's FSDP2-based ``replicate_with_fsdp.replicate(model, mesh=mesh["dp"])`` over the
   same TP model, where the base has it. Each repeat times them in turn, in an order rotated from repeat to
   repeat, so load on the machine and order effects hit all of them alike; overlay/stock is also given per
   repeat (paired), as the median and the range of those ratios.
3. Compiled training step (``torch.compile``, default backend and settings, so with DDP's graph splitting,
   ``optimize_ddp``): (d) compiled overlay DDP, (a) eager overlay DDP, (e) compiled FSDP2 over the same TP
   model, timed in turn as in 2. Every configuration warms up until a whole step compiles no new graph (on
   every rank); the output says how many graphs each compiled one took, and warns where anything compiled
   during the timed repeats (those times then include compilation).

Each rank builds the stock model with the overlay deactivated and the others with it activated
(``torch_overlay.deactivate()`` / ``activate()`` before building), so both run in the same processes. Times are,
per repeat, the slowest rank's; the table shows the median over repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tools.ranks import run_ranks, slowest

WORLD_SIZE = 4
# Warm-up steps per configuration: at least the first (stock swaps its parameters on its first forward only;
# DDP rebuilds its buckets after the first step, and the compiled configurations compile once more when it
# does), then until a whole step compiles no new graph, at most the second.
MIN_WARM_UP, MAX_WARM_UP = 3, 20


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.relu(self.w1(x)))


class MLP(nn.Module):
    block = Block

    def __init__(self, blocks: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.block(dim, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _own_code(cls: type[nn.Module], **attrs: object) -> type[nn.Module]:
    """A subclass of ``cls`` whose ``forward`` runs a copy of ``cls.forward``'s code object.

    Dynamo keeps its compiled graphs, its recompile count and its decision to skip a function (run it eagerly
    from then on) per code object. Two compiled models of the same classes in one process share them: compiling
    FSDP2 over the MLP graph-breaks in ``MLP.forward``, dynamo skips that function, and the compiled DDP model,
    whose ``MLP.forward`` was already compiled whole, then runs it eagerly and compiles each block on its own
    (in the timed steps). With its own code the compiled FSDP2 model leaves the other as it would be alone.
    """
    forward = cls.forward
    code = forward.__code__.replace()  # an equal, distinct code object
    copy = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    return type(cls.__name__, (cls,), {"forward": copy, **attrs})


def _tp_model(mesh, blocks: int, dim: int, hidden: int, cls: type[MLP] = MLP) -> MLP:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = cls(blocks, dim, hidden)
    plan = {}
    for i in range(blocks):
        plan[f"blocks.{i}.w1"] = ColwiseParallel()
        plan[f"blocks.{i}.w2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    return model


def _timed(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn``, after a barrier, averaged over ``iters`` calls."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _compiled_graphs() -> tuple[int, int]:
    """Graphs compiled so far in this process: dynamo's (one per captured frame, recompiles included) and AOT
    autograd's (one per graph handed to the backend; with DDP's graph splitting, one per split graph)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (a collective: every rank must call it)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _warm_up(step: Callable[[], None]) -> tuple[int, tuple[int, int], bool]:
    """Run ``step`` until a whole step compiles no new graph on any rank (at least ``MIN_WARM_UP`` steps, at most
    ``MAX_WARM_UP``); the ranks decide together, so that they all run the same steps.

    Returns the steps run, the graphs (dynamo, AOT) they compiled, and whether the last step compiled none.
    """
    start = _compiled_graphs()
    for steps in range(1, MAX_WARM_UP + 1):
        before = _compiled_graphs()
        step()
        compiled = _any_rank(_compiled_graphs() != before)
        if steps >= MIN_WARM_UP and not compiled:
            break
    end = _compiled_graphs()
    return steps, (end[0] - start[0], end[1] - start[1]), not compiled


def _hook_figures(mesh, params: int, iters: int, repeats: int) -> dict[str, list[float]]:
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_overlay

    def hooks_of(model: nn.Module, names: set[str]) -> Callable[[], None]:
        """Call the named forward pre-hooks and forward hooks of every module of ``model``, as one forward does."""

        def name(hook) -> str:  # the overlay registers functools.partial objects
            return getattr(hook, "func", hook).__name__

        pre = [(m, h) for m in model.modules() for h in m._forward_pre_hooks.values() if name(h) in names]
        post = [(m, h) for m in model.modules() for h in m._forward_hooks.values() if name(h) in names]
        assert pre and post, names

        def call() -> None:
            for module, hook in pre:
                hook(module, ())
            for module, hook in post:
                hook(module, (), None)

        return call

    # params / 2 linear layers (weight and bias), each its own owner module; tiny so that the swap dominates.
    blocks, x = params // 4, torch.randn(4, 8)
    torch_overlay.deactivate()
    stock_model = _tp_model(mesh, blocks, 8, 8)
    DDP(stock_model, device_mesh=mesh["dp"])(x).sum().backward()  # stock's steady state: after one forward
    torch_overlay.activate()
    model = _tp_model(mesh, blocks, 8, 8)
    DDP(model, device_mesh=mesh["dp"])
    locals_ = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert len(locals_) >= params, len(locals_)
    specs = [(p.to_local(), p._spec) for p in locals_]
    # The hooks DDP(device_mesh=...) registers (the root's and, in the overlay, each owner's), not the
    # input/output hooks of ColwiseParallel/RowwiseParallel.
    transform = {"_reconstruct_dtensor", "_localize_dtensor"}
    runs = {
        "stock": hooks_of(stock_model, transform),
        "hooks": hooks_of(model, transform | {"_enter_dtensor_views", "_exit_dtensor_views"}),
    }

    def floor() -> None:
        for p, spec in specs:
            DTensor.from_local(p, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)

    runs["floor"] = floor
    figures: dict[str, list[float]] = {key: [] for key in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for key, run in runs.items():
            figures[key].append(_timed(run, iters))
    figures["params"] = [float(len(locals_))]
    return figures


def _step_figures(
    mesh, blocks: int, dim: int, hidden: int, batch: int, iters: int, repeats: int, compiled: bool, foreach: bool
):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_overlay

    torch_overlay.deactivate()
    stock_model = _tp_model(mesh, blocks, dim, hidden)
    stock = DDP(stock_model, device_mesh=mesh["dp"])
    torch_overlay.activate()
    overlay_model = _tp_model(mesh, blocks, dim, hidden)
    overlay = DDP(overlay_model, device_mesh=mesh["dp"])
    fsdp = _tp_model(mesh, blocks, dim, hidden)
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(fsdp, mesh=mesh["dp"])

    torch.manual_seed(mesh["dp"].get_local_rank())
    x = torch.randn(batch, dim)
    runs = {}
    configs = [
        ("overlay", overlay, overlay_model.parameters()),
        ("stock", stock, stock_model.parameters()),
        ("fsdp2", fsdp, fsdp.parameters()),
    ]
    try:  # upstream's FSDP2-based replicate, the direction upstream takes for DP + TP
        from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_fsdp
    except ImportError:
        replicate_fsdp = None
    if replicate_fsdp is not None:
        replicated = _tp_model(mesh, blocks, dim, hidden)
        replicate_fsdp(replicated, mesh=mesh["dp"])
        configs.append(("replicate_fsdp", replicated, replicated.parameters()))
    if compiled:
        # The same models, compiled with the default backend (inductor) and settings, as a user would: DDP's
        # graph splitting (optimize_ddp) on for the DDP model (FSDP2 does not use it). Compiled in the warm-up.
        overlay_compiled = _tp_model(mesh, blocks, dim, hidden)
        fsdp_compiled = _tp_model(mesh, blocks, dim, hidden, _own_code(MLP, block=_own_code(Block)))
        for block in fsdp_compiled.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(fsdp_compiled, mesh=mesh["dp"])
        configs += [
            (
                "overlay_compiled",
                torch.compile(DDP(overlay_compiled, device_mesh=mesh["dp"])),
                overlay_compiled.parameters(),
            ),
            ("fsdp2_compiled", torch.compile(fsdp_compiled), fsdp_compiled.parameters()),
        ]
    for key, model, params in configs:
        # foreach=None: the for-loop on CPU, where each DTensor parameter's update goes through DTensor's dispatch.
        optim = torch.optim.SGD(list(params), lr=1e-3, foreach=foreach or None)

        def step(model=model, optim=optim) -> None:
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()

        runs[key] = step
    figures: dict[str, list[float]] = {key: [] for key in runs}
    # Per configuration: warm-up steps, graphs (dynamo, AOT) compiled in them, whether the warm-up settled, and
    # graphs compiled during the timed repeats (none, unless the warm-up did not settle or something recompiles).
    compiles: dict[str, dict[str, object]] = {}
    for key, step in runs.items():
        steps, graphs, settled = _warm_up(step)
        compiles[key] = {"warm_up": steps, "graphs": graphs, "settled": settled, "in_repeats": (0, 0)}
    keys = list(runs)
    for repeat in range(repeats):
        # Rotate the order so that no configuration always runs first (or right after another).
        shift = repeat % len(keys)
        for key in keys[shift:] + keys[:shift]:
            before = _compiled_graphs()
            figures[key].append(_timed(runs[key], iters))
            after = _compiled_graphs()
            seen = compiles[key]["in_repeats"]
            compiles[key]["in_repeats"] = (seen[0] + after[0] - before[0], seen[1] + after[1] - before[1])
    return figures, compiles


def _worker(rank: int, init_file: str, args: argparse.Namespace, queue) -> None:
    import torch_overlay

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch_overlay.activate()
    hooks = _hook_figures(mesh, args.params, args.hook_iters, args.repeats)
    steps, compiles = _step_figures(
        mesh,
        args.blocks,
        args.dim,
        args.hidden,
        args.batch,
        args.step_iters,
        args.repeats,
        not args.no_compile,
        args.foreach,
    )
    queue.put((rank, hooks, steps, compiles))
    dist.destroy_process_group()


def _slowest(by_rank: dict[int, dict[str, list[float]]], key: str) -> list[float]:
    return slowest(figures[key] for figures in by_rank.values())


def _slowest_median(by_rank: dict[int, dict[str, list[float]]], key: str) -> float:
    return statistics.median(_slowest(by_rank, key))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=256, help="DTensor parameters for the hook figure")
    parser.add_argument("--hook-iters", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-iters", type=int, default=3)
    parser.add_argument("--foreach", action="store_true", help="SGD(foreach=True), the default on CUDA")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configurations")
    args = parser.parse_args(argv)
    print(
        f"{WORLD_SIZE} ranks, 2x2 (dp x tp) mesh, CPU/gloo, 1 thread per rank, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs (shared machine: figures are noisy when others run)"
    )
    gathered = run_ranks(_worker, WORLD_SIZE, args)
    if gathered is None:
        return 1
    hooks = {rank: h for rank, h, _, _ in gathered}
    steps = {rank: s for rank, _, s, _ in gathered}
    compiles = {rank: c for rank, _, _, c in gathered}

    floor = _slowest_median(hooks, "floor")
    swap = _slowest_median(hooks, "hooks")
    stock_hooks = _slowest_median(hooks, "stock")
    n = int(hooks[0]["params"][0])
    print(f"\n1. swap hooks per forward, {n} DTensor parameters (median of {args.repeats} x {args.hook_iters})")
    print(f"{'':<50}{'ms':>9}{'x loop':>9}")
    print(f"{'bare DTensor.from_local loop (a view per param)':<50}{floor * 1e3:>9.3f}{1.0:>9.2f}")
    print(f"{'stock: root hooks, after the first forward':<50}{stock_hooks * 1e3:>9.3f}{stock_hooks / floor:>9.2f}")
    print(f"{'overlay: each owner hooks (cached views)':<50}{swap * 1e3:>9.3f}{swap / floor:>9.2f}")

    print(
        f"\n2. training step, {args.blocks}-block TP MLP (dim {args.dim}, hidden {args.hidden}, batch {args.batch}),"
        f" median of {args.repeats} x {args.step_iters} steps, SGD foreach={args.foreach or None}"
    )
    names = {
        "overlay": "(a) overlay DDP(device_mesh=dp)",
        "stock": "(b) stock DDP(device_mesh=dp)",
        "fsdp2": "(c) FSDP2 fully_shard(mesh=dp) over TP",
        "replicate_fsdp": "(f) replicate_with_fsdp(mesh=dp) over TP",
    }
    names = {key: name for key, name in names.items() if key in steps[0]}
    _print_steps(steps, names, "overlay", "overlay/x")
    _print_paired(steps, "overlay", "stock", "overlay/stock")
    _print_compile_warnings(compiles, names)
    if "overlay_compiled" in steps[0]:
        print(
            "\n3. compiled training step (torch.compile, default backend, DDP graph splitting "
            f"{'on' if torch._dynamo.config.optimize_ddp else 'OFF'}), same model"
        )
        names = {
            "overlay_compiled": "(d) compiled overlay DDP(device_mesh=dp)",
            "overlay": "(a) eager overlay DDP(device_mesh=dp)",
            "fsdp2_compiled": "(e) compiled FSDP2 over TP",
        }
        _print_steps(steps, names, "overlay_compiled", "compiled/x")
        for other in ("overlay", "fsdp2_compiled"):
            _print_paired(steps, "overlay_compiled", other, f"(d)/{names[other][:3]}")
        compiled = {key: names[key] for key in ("overlay_compiled", "fsdp2_compiled")}
        _print_compiles(compiles, compiled)
        _print_compile_warnings(compiles, compiled)
    return 0


def _print_steps(steps, names: dict[str, str], base: str, column: str) -> None:
    """Each configuration's step time, and ``base``'s time over it."""
    base_time = _slowest_median(steps, base)
    print(f"{'':<44}{'ms/step':>9}{column:>11}")
    for key, name in names.items():
        t = _slowest_median(steps, key)
        print(f"{name:<44}{t * 1e3:>9.2f}{base_time / t:>11.3f}")


def _print_paired(steps, key: str, other: str, label: str) -> None:
    """``key``'s step time over ``other``'s, paired per repeat (slowest rank of each)."""
    paired = [k / o for k, o in zip(_slowest(steps, key), _slowest(steps, other), strict=True)]
    print(
        f"{label} per repeat (paired): median {statistics.median(paired):.3f}, "
        f"range {min(paired):.3f} .. {max(paired):.3f}"
    )


def _print_compiles(compiles, names: dict[str, str]) -> None:
    """Each compiled configuration's warm-up: steps, and graphs compiled (most of any rank)."""
    for key, name in names.items():
        steps = max(c[key]["warm_up"] for c in compiles.values())
        dynamo = max(c[key]["graphs"][0] for c in compiles.values())
        aot = max(c[key]["graphs"][1] for c in compiles.values())
        print(f"{name[:3]} warm-up: {steps} steps, compiled {dynamo} dynamo graphs, {aot} AOT autograd graphs")


def _print_compile_warnings(compiles, names: dict[str, str]) -> None:
    """A warning for each configuration whose warm-up did not settle, or that compiled during the timed repeats
    (its step time then includes compilation)."""
    for key, name in names.items():
        if not all(c[key]["settled"] for c in compiles.values()):
            print(f"WARNING: {name}: still compiling after {MAX_WARM_UP} warm-up steps")
        dynamo = max(c[key]["in_repeats"][0] for c in compiles.values())
        aot = max(c[key]["in_repeats"][1] for c in compiles.values())
        if dynamo or aot:
            print(
                f"WARNING: {name}: compiled during the timed repeats ({dynamo} dynamo graphs, {aot} AOT autograd"
                " graphs on the worst rank); its time includes compilation"
            )


if __name__ == "__main__":
    sys.exit(main())
