"""Run a benchmark's ranks (spawned processes, a file rendezvous, one result each through a queue), and combine
their figures."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from queue import Empty

import torch.multiprocessing as mp


def _run_rank(worker: Callable[..., None], rank: int, init_file: str, args: tuple, queue) -> None:
    """One rank: ``worker``, then an exit that skips the interpreter's finalization.

    Stock FSDP keeps the gloo process group, and so its worker threads, alive past ``destroy_process_group()``.
    A worker thread that still holds a finished collective when the interpreter finalizes destroys the
    collective's tensors there, needs the GIL, and aborts the process ("terminate called without an active
    exception"; about 1 bench-unshard run in 20 here, after every result was in). The results are
    complete by then, so the rank flushes what it wrote and leaves with ``os._exit``.
    """
    worker(rank, init_file, *args, queue)
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Callable[..., None], world_size: int, *args: object) -> list | None:
    """Call ``worker(rank, init_file, *args, queue)`` in ``world_size`` spawned processes; each puts one result.

    Returns the results (in arrival order), or None, having said so and killed the others, when a rank died:
    a dead rank never puts its result, so waiting for it would hang the benchmark.
    """
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=_run_rank, args=(worker, rank, init_file, args, queue)) for rank in range(world_size)
        ]
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


def slowest(per_rank: Iterable[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's figure (what the whole group took); ``per_rank``: each rank's repeats."""
    return [max(figures) for figures in zip(*per_rank, strict=True)]


def status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ...)."""
    with open("/proc/self/status", encoding="ascii") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def reset_peak_rss() -> None:
    """Return freed memory to the system, then reset ``VmHWM`` (the peak resident set size) to the current size."""
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
        clear_refs.write("5")
