"""Benchmark: writing back an edit made on rank 0 inside ``FSDP.summon_full_params``, 4 ranks, CPU/gloo.

Side by side in one run, on the same FSDP model (FULL_SHARD, one FSDP unit per layer, >= 50M parameters):

(a) ours: ``summon_full_params(writeback=True, rank0_only=True)`` with the overlay active; rank 0 edits.
(b) a hand-written workaround on stock torch: ``summon_full_params(writeback=True)`` on every rank, rank 0
    edits, then every full parameter is broadcast from rank 0 by hand before the context writes back the shards.
(c) the floor: one bare ``dist.gather`` to rank 0, then one ``dist.scatter`` from it, of the same bytes
    (every rank's padded shards); the scatter is the floor of the writeback.
(g) the floor as in (c), with rank 0's receive buffer allocated in the call and freed at its end, as rank 0's
    unsharded parameters are in (a) (and in stock ``summon_full_params``): (c) plus the first touch of new memory;
    (h) is (f) likewise, for (e).
(d) what a user picks today without the overlay: ``torch.distributed.checkpoint.state_dict``'s
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (rank 0 gets the full state dict), rank 0
    edits it, then ``set_model_state_dict(..., broadcast_from_rank0=True)``. It runs FSDP's stock code paths
    (with the overlay active: on torch 2.13.0, stock fails to offload on a CPU compute device).

And for gradients, after a backward, rank 0 edits the full parameters and gradients:

(e) ours: ``summon_full_params(with_grads=True, writeback=True, rank0_only=True)``.
(f) its floor: as (c), of params plus grads (twice the bytes).

Peak extra memory is measured per rank as the peak resident set size (``VmHWM`` in ``/proc/self/status``,
after resetting it by writing ``5`` to ``/proc/self/clear_refs``) minus the resident set size just before.
Before each measurement, ``malloc_trim(0)`` hands the free heap pages back to the kernel: otherwise a buffer
could reuse pages already resident and go unseen. The allocator keeps its default settings, so that times
are what users see.

Times are the slowest rank's, median of ``--repeats``; (a) and its floors alternate within each repeat, and their ratio
is also given per repeat (median and range). "writeback" is the same interval for all three: from a
barrier that every rank passes once the body is done (rank 0 finished its edit) to a barrier after the context
exits; for (c), from a barrier to a barrier after the scatter. "total" starts at a barrier before entering the
context, so it includes unsharding on entry and rank 0's edit. "gather + writeback" leaves the edit out: from
that barrier to a barrier at the start of the body, plus the writeback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tools.ranks import reset_peak_rss, run_ranks, slowest, status_kib

WORLD_SIZE = 4
MIB = 1 << 20


@dataclass(frozen=True)
class Measurement:
    """One rank's figures for one method: seconds, and bytes above the resident set size at the start."""

    total_s: float
    writeback_s: float
    peak_extra_bytes: int
    entry_s: float


_body_start = 0.0


def _body_started() -> None:
    """Marks, after a barrier, that every rank finished unsharding on entry (the body starts)."""
    global _body_start
    dist.barrier()
    _body_start = time.perf_counter()


def _measure(run: Callable[[], float]) -> Measurement:
    """
    Run ``run`` between barriers; ``run`` calls :func:`_body_started` once unsharded, and returns when its
    writeback started. Seconds and peak memory.
    """
    dist.barrier()
    reset_peak_rss()
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    writeback_start = run()
    dist.barrier()
    end = time.perf_counter()
    peak_extra = (status_kib("VmHWM") - rss_before) * 1024
    return Measurement(end - start, end - writeback_start, peak_extra, _body_start - start)


def _build_model(layers: int, width: int) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    for i in range(layers):
        model[i] = FSDP(model[i], device_id=torch.device("cpu"))
    return FSDP(model, device_id=torch.device("cpu"))


def _edit(model: nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)


def _ours(model: nn.Module, rank: int) -> float:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
        _body_started()
        if rank == 0:
            _edit(model)
        dist.barrier()
        writeback_start = time.perf_counter()
    return writeback_start


def _ours_with_grads(model: nn.Module, rank: int) -> float:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=True, rank0_only=True, with_grads=True):
        _body_started()
        if rank == 0:
            _edit(model)
            with torch.no_grad():
                for param in model.parameters():
                    param.grad.mul_(0.5)
        dist.barrier()
        writeback_start = time.perf_counter()
    return writeback_start


def _dcp(model: nn.Module, rank: int) -> float:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _body_started()
    if rank == 0:
        with torch.no_grad():
            for value in state_dict.values():
                value.mul_(0.5)
    dist.barrier()
    writeback_start = time.perf_counter()
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return writeback_start


def _workaround(model: nn.Module, rank: int) -> float:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=True):
        _body_started()
        if rank == 0:
            _edit(model)
        dist.barrier()
        writeback_start = time.perf_counter()
        for param in model.parameters():
            dist.broadcast(param.data, src=0)
    return writeback_start


def _floor(shard_numel: int, rank: int, gather: bool = False, fresh: bool = False) -> Callable[[], float]:
    """One scatter of every rank's shard (after one gather of them, with ``gather``). Both buffers exist
    beforehand: the floor moves the bytes and nothing else. With ``fresh``, rank 0 allocates the buffer it
    gathers into in the call, as it does its unsharded parameters in (a)."""
    full = torch.zeros(shard_numel * WORLD_SIZE) if rank == 0 and not fresh else None
    shard = torch.zeros(shard_numel)

    def run() -> float:
        nonlocal full
        if fresh and rank == 0:
            full = torch.empty(shard_numel * WORLD_SIZE)
        if gather:
            dist.gather(shard, list(full.chunk(WORLD_SIZE)) if full is not None else None, dst=0)
        _body_started()
        dist.barrier()
        writeback_start = time.perf_counter()
        dist.scatter(shard, list(full.chunk(WORLD_SIZE)) if full is not None else None, src=0)
        if fresh:
            full = None  # freed, as (a) frees rank 0's unsharded parameters
        return writeback_start

    return run


def _check_edit_everywhere(
    model: nn.Module, reference: list[torch.Tensor], grads: list[torch.Tensor] | None = None
) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False, with_grads=grads is not None):
        for i, (param, expected) in enumerate(zip(model.parameters(), reference, strict=True)):
            if not torch.equal(param, expected):
                raise AssertionError(f"rank {dist.get_rank()}: rank 0's edit was not written back")
            if grads is not None and not torch.equal(param.grad, grads[i]):
                raise AssertionError(f"rank {dist.get_rank()}: rank 0's gradient edit was not written back")


def _backward(model: nn.Module, width: int) -> None:
    model(torch.ones(2, width)).sum().backward()


def _alternate(runs: dict[str, Callable[[], float]], results: dict, repeats: int, check: Callable[[], None]) -> None:
    """Each repeat runs every method once, the first one shifting, so that the machine's load hits them alike."""
    keys = list(runs)
    for i in range(repeats):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            results[key].append(_measure(runs[key]))
        if i == 0:
            check()


def _worker(rank: int, init_file: str, layers: int, width: int, repeats: int, only: str, queue) -> None:
    import torch_overlay

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    results: dict[str, list[Measurement]] = {key: [] for key in only}
    # (b) on stock torch, as users run it today
    torch_overlay.deactivate()
    model = _build_model(layers, width)
    shard_numel = sum(p.numel() for p in model.parameters())
    with FSDP.summon_full_params(model, writeback=False):
        expected = [p.detach().clone() * 0.5 for p in model.parameters()]
    for _ in range(repeats if "b" in only else 0):
        results["b"].append(_measure(lambda: _workaround(model, rank)))
    del model
    torch_overlay.activate()
    # (d) DCP runs FSDP's stock paths (`writeback=False, rank0_only=True, offload_to_cpu=True` to get the state
    # dict, a full-state-dict load to set it), which the overlay leaves as they are on every base but one: torch
    # 2.13.0 needs the overlay's backport there to offload to CPU on a CPU compute device at all
    model = _build_model(layers, width)
    for i in range(repeats if "d" in only else 0):
        results["d"].append(_measure(lambda: _dcp(model, rank)))
        if i == 0:
            _check_edit_everywhere(model, expected)
    del model
    # (a) ours, activated before the model is built, and the floors (c) and (g), alternating in each repeat
    model = _build_model(layers, width)
    runs = {
        "a": lambda: _ours(model, rank),
        "c": _floor(shard_numel, rank, gather=True),
        "g": _floor(shard_numel, rank, gather=True, fresh=True),
    }
    _alternate(runs, results, repeats, lambda: _check_edit_everywhere(model, expected))
    del model, runs
    if "e" not in only:
        queue.put((rank, shard_numel, results))
        dist.destroy_process_group()
        return
    # (e) ours with gradients and its floors (f) and (h), alternating likewise
    model = _build_model(layers, width)
    _backward(model, width)
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        expected_grads = [p.grad.clone() * 0.5 for p in model.parameters()]
    runs = {
        "e": lambda: _ours_with_grads(model, rank),
        "f": _floor(2 * shard_numel, rank, gather=True),
        "h": _floor(2 * shard_numel, rank, gather=True, fresh=True),
    }
    _alternate(runs, results, repeats, lambda: _check_edit_everywhere(model, expected, expected_grads))
    queue.put((rank, shard_numel, results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="FSDP units, one linear layer each")
    parser.add_argument("--width", type=int, default=2560, help="features of each linear layer")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--only", default="abcdef", help="the methods to run, e.g. ac (a prefix of the series without gradients)"
    )
    args = parser.parse_args(argv)
    only = "".join(sorted(set(args.only + "cg" + ("fh" if "e" in args.only else "")) & set("abcdefgh")))
    if "a" not in only:
        parser.error("--only must include a: the floors and (e) alternate with it")
    numel = args.layers * (args.width * args.width + args.width)
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}) = {numel / 1e6:.1f}M parameters "
        f"({numel * 4 / MIB:.0f} MiB fp32), FULL_SHARD, {WORLD_SIZE} ranks, CPU/gloo, torch {torch.__version__}"
    )
    gathered = run_ranks(_worker, WORLD_SIZE, args.layers, args.width, args.repeats, only)
    if gathered is None:
        return 1
    by_rank = {rank: results for rank, _, results in gathered}
    shard_bytes = gathered[0][1] * 4

    def slowest_s(key: str, field: str) -> list[float]:
        return slowest([getattr(m, field) for m in results[key]] for results in by_rank.values())

    def moved_s(key: str) -> list[float]:
        """Per repeat, the slowest rank's gather on entry plus writeback (the edit left out)."""
        return slowest([m.entry_s + m.writeback_s for m in results[key]] for results in by_rank.values())

    def row(key: str) -> tuple[float, float, float, int]:
        # Per repeat, the slowest rank; then the median over repeats
        peak = max(m.peak_extra_bytes for r in by_rank if r != 0 for m in by_rank[r][key])
        return (
            statistics.median(slowest_s(key, "total_s")),
            statistics.median(moved_s(key)),
            statistics.median(slowest_s(key, "writeback_s")),
            peak,
        )

    def paired(key: str, floor_key: str, per_repeat: Callable[[str], list[float]]) -> str:
        # Ran in the same repeats: the ratio within each repeat, less exposed to load than two medians
        ratios = sorted(a / c for a, c in zip(per_repeat(key), per_repeat(floor_key), strict=True))
        return (
            f"({key}) / ({floor_key}), paired per repeat: median {statistics.median(ratios):.2f} "
            f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}, {args.repeats} repeats)"
        )

    rows = {key: row(key) for key in only}
    names = {
        "a": "(a) rank-0 writeback (overlay)",
        "b": "(b) all ranks + broadcast by hand (stock)",
        "c": "(c) floor of (a)-(d): gather + scatter",
        "d": "(d) DCP get/set_model_state_dict (stock paths)",
        "e": "(e) rank-0 writeback + grads (overlay)",
        "f": "(f) floor of (e): gather + scatter, 2x",
        "g": "(g) (c), rank 0's buffer allocated in the call",
        "h": "(h) (f), rank 0's buffer allocated in the call",
    }
    print(f"one shard = {shard_bytes / MIB:.1f} MiB; peak extra = max over ranks 1-3 of VmHWM - VmRSS before")
    print("x floor: over (c) for (a)-(d) and (g), over (f) for (e), (f) and (h)")
    header = f"{'method':<50}{'total s':>9}{'gather+wb s':>13}{'x floor':>9}{'writeback s':>13}{'x floor':>9}"
    print(f"{header}{'peak extra MiB':>16}{'shards':>8}")
    for key, (total, moved, writeback, peak) in rows.items():
        floor_row = rows["f" if key in "efh" else "c"]
        print(
            f"{names[key]:<50}{total:>9.3f}{moved:>13.3f}{moved / floor_row[1]:>9.2f}{writeback:>13.3f}"
            f"{writeback / floor_row[2]:>9.2f}{peak / MIB:>16.1f}{peak / shard_bytes:>8.2f}"
        )
    print(f"writeback {paired('a', 'c', lambda key: slowest_s(key, 'writeback_s'))}")
    print(f"gather + writeback {paired('a', 'c', moved_s)}")
    print(f"gather + writeback {paired('a', 'g', moved_s)} (the floor that allocates, as (a) does)")
    if "e" in only:
        print(f"writeback {paired('e', 'f', lambda key: slowest_s(key, 'writeback_s'))}")
        print(f"gather + writeback {paired('e', 'f', moved_s)}")
        print(f"gather + writeback {paired('e', 'h', moved_s)} (the floor that allocates, as (e) does)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
