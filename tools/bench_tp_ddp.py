"""Benchmark: TP + DDP on a 2x2 (dp x tp) mesh, 4 ranks, CPU/gloo, stock and overlay side by side in one run.

1. Launch-bound step, one process (a 1 x 1 mesh, world size 1): a model of tiny layers, where the step is all
   Python and dispatch, as on a GPU: the same model without and with TP (DTensor parameters), each alone and under
   DDP (the overlay's; stock's DDP(TP) too), eager and compiled (inductor). DDP's added milliseconds over TP alone
   are printed next to its added milliseconds over the plain model: DDP should cost a TP model what it costs a
   plain one. ``--device cuda`` runs this part alone on the GPU (NCCL), ``--tiny-dim``/``--tiny-batch`` size it
   (``make gpu-check`` runs it at a launch-bound and at a compute-bound size, tools/gpu_check.py).
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

Each rank builds the stock DDP model from torch's own ``distributed.py`` executed as a private module
(:func:`_stock_ddp_class`: DDP's module is served onto its stock classes, so while the overlay is active the
package's class runs the overlay's methods), so both run in the same processes. Times are, per repeat, the slowest
rank's; the table shows the median over repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _timed(fn: Callable[[], object], iters: int, sync: Callable[[], object] = lambda: None) -> float:
    """Seconds per call of ``fn``, after a barrier, averaged over ``iters`` calls; ``sync`` waits for the device
    (``torch.cuda.synchronize``) before the clock starts and before it stops."""
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
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


class Tiny(nn.Module):
    """Tiny layers: the step is launch (dispatch) bound."""

    def __init__(self, blocks: int = 8, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, 2 * dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _launch_worker(rank: int, init_file: str, args: argparse.Namespace, queue) -> None:
    """One process: Tiny without and with TP, alone and under DDP, eager and compiled, on ``args.device``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torch_overlay

    torch_overlay.activate()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    # On a GPU: NCCL for DDP's and DTensor's CUDA tensors, gloo for the CPU flags the warm-up agrees on.
    backend = (
        "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:{dist.get_default_backend_for_device(device)}"
    )
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=1)
    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"))
    sync = torch.accelerator.synchronize if device.type != "cpu" else lambda: None

    def model(tp: bool, cls: type[nn.Module] = Tiny) -> nn.Module:
        torch.manual_seed(0)
        m = cls(dim=args.tiny_dim).to(device)
        if tp:
            plan = {
                f"blocks.{i}.{n}": s()
                for i in range(len(m.blocks))
                for n, s in (("w1", ColwiseParallel), ("w2", RowwiseParallel))
            }
            parallelize_module(m, mesh["tp"], plan)
        return m

    stock = _stock_ddp_class()(model(True), device_mesh=mesh["dp"])
    DDP = torch.nn.parallel.DistributedDataParallel
    configs = {
        "plain": model(False),
        "plain_ddp": DDP(model(False), device_mesh=mesh["dp"]),
        "tp": model(True),
        "tp_ddp": DDP(model(True), device_mesh=mesh["dp"]),
        "tp_ddp_stock": stock,
    }
    if not args.no_compile:  # each compiled model with its own code objects, see _own_code
        for key in ("plain", "plain_ddp", "tp", "tp_ddp"):
            m = model(key.startswith("tp"), _own_code(Tiny))
            configs[f"{key}_compiled"] = torch.compile(DDP(m, device_mesh=mesh["dp"]) if "ddp" in key else m)
    x = torch.randn(args.tiny_batch, args.tiny_dim, device=device)
    runs = {}
    for key, m in configs.items():
        optim = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step(m=m, optim=optim) -> None:
            m(x).sum().backward()
            optim.step()
            optim.zero_grad()

        runs[key] = step
    figures: dict[str, list[float]] = {key: [] for key in runs}
    for step in runs.values():
        _warm_up(step)
    keys = list(runs)
    for repeat in range(args.repeats):
        shift = repeat % len(keys)
        for key in keys[shift:] + keys[:shift]:
            figures[key].append(_timed(runs[key], args.launch_iters, sync))
    queue.put(figures)
    dist.destroy_process_group()


def _print_launch(figures: dict[str, list[float]], args: argparse.Namespace) -> None:
    t = {key: statistics.median(v) * 1e3 for key, v in figures.items()}
    print(
        f"\n1. launch-bound step, one process, {args.device}, Tiny (8 blocks, dim {args.tiny_dim}, batch "
        f"{args.tiny_batch}), median of {args.repeats} repeats"
    )
    print(f"{'':<28}{'ms/step':>9}{'DDP adds ms':>13}{'DDP / alone':>13}")
    for mode in ("", "_compiled"):
        if f"tp{mode}" not in t:
            continue
        for key in ("plain", "tp"):
            alone, ddp = t[f"{key}{mode}"], t[f"{key}_ddp{mode}"]
            print(f"{key + mode:<28}{alone:>9.3f}")
            print(f"{key + '_ddp' + mode:<28}{ddp:>9.3f}{ddp - alone:>13.3f}{ddp / alone:>13.3f}")
        if not mode:  # stock's compiled DDP(TP) fails to compile (inductor: "unhashable type: non-nested SymInt")
            stock = t["tp_ddp_stock"]
            print(f"{'tp_ddp_stock':<28}{stock:>9.3f}{stock - t['tp']:>13.3f}{stock / t['tp']:>13.3f}")
    print("targets: TP + DDP / TP alone <= 1.05 eager, <= 1.2 compiled; DDP adds to TP what it adds to plain")


def _stock_ddp_class() -> type:
    """Stock DDP beside the served one: torch's ``nn/parallel/distributed.py`` executed as a private module of
    ``torch.nn.parallel`` (its relative imports resolve there; what it imports at call time is what torch has)."""
    path = os.path.join(os.path.dirname(torch.nn.parallel.__file__), "distributed.py")
    name = "torch.nn.parallel._bench_stock_distributed"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name].DistributedDataParallel


def _step_figures(
    mesh, blocks: int, dim: int, hidden: int, batch: int, iters: int, repeats: int, compiled: bool, foreach: bool
):
    from torch.distributed.fsdp import fully_shard

    stock_model = _tp_model(mesh, blocks, dim, hidden)
    stock = _stock_ddp_class()(stock_model, device_mesh=mesh["dp"])
    DDP = torch.nn.parallel.DistributedDataParallel
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
    queue.put((rank, steps, compiles))
    dist.destroy_process_group()


def _slowest(by_rank: dict[int, dict[str, list[float]]], key: str) -> list[float]:
    return slowest(figures[key] for figures in by_rank.values())


def _slowest_median(by_rank: dict[int, dict[str, list[float]]], key: str) -> float:
    return statistics.median(_slowest(by_rank, key))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="part 1's device; not cpu: part 1 alone (e.g. cuda)")
    parser.add_argument("--tiny-dim", type=int, default=16, help="part 1's layer width (hidden: twice that)")
    parser.add_argument("--tiny-batch", type=int, default=8, help="part 1's batch")
    parser.add_argument("--launch-iters", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-iters", type=int, default=3)
    parser.add_argument("--foreach", action="store_true", help="SGD(foreach=True), the default on CUDA")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configurations")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(
        f"{WORLD_SIZE} ranks, 2x2 (dp x tp) mesh, CPU/gloo, 1 thread per rank, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs (shared machine: figures are noisy when others run)"
    )
    launch = run_ranks(_launch_worker, 1, args)
    if launch is None:
        return 1
    _print_launch(launch[0], args)
    if args.device != "cpu":
        return 0
    gathered = run_ranks(_worker, WORLD_SIZE, args)
    if gathered is None:
        return 1
    steps = {rank: s for rank, s, _ in gathered}
    compiles = {rank: c for rank, _, c in gathered}

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
