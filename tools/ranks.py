"""Run a benchmark's ranks: spawned processes, a file rendezvous, one result each through a queue."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from queue import Empty

import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], world_size: int, *args: object) -> list | None:
    """Call ``worker(rank, init_file, *args, queue)`` in ``world_size`` spawned processes; each puts one result.

    Returns the results (in arrival order), or None, having said so and killed the others, when a rank died:
    a dead rank never puts its result, so waiting for it would hang the benchmark.
    """
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [context.Process(target=worker, args=(rank, init_file, *args, queue)) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        gathered = []
        while len(gathered) < len(procs):
            try:
                gathered.append(queue.get(timeout=5))
            except Empty:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    for proc in procs:
                        proc.kill()
                    break
        for proc in procs:
            proc.join()
    failed = [f"rank {rank} exited with {proc.exitcode}" for rank, proc in enumerate(procs) if proc.exitcode]
    if len(gathered) < len(procs) or failed:
        print(f"a rank failed: {', '.join(failed) or 'no result'}", file=sys.stderr)
        return None
    return gathered
