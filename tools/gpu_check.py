"""``make gpu-check``: what one lent GPU can show, as one table: the overlay served on the machine's torch, TP + DDP
on CUDA with NCCL, the suite's TP + DDP and FSDP tests, and the step cost.

    PYTHONPATH=. python -m tools.gpu_check [--dry-run] [--only STEP,...] [--out FILE] [--device cpu]

For a copy of the working tree on a machine with its own torch, pytest, numpy and lightning (nothing installed):
the pure-Python wheels the suite needs beyond them (expecttest) go in ``.whl/`` (docs/testing.md, "On a GPU") and on
every child's PYTHONPATH. Every step and every child has a time limit (the whole run: under 8 minutes), so nothing
can hang it; a child past its limit is killed with its process group and reported as a timeout.

1. ``status``: ``python -m torch_overlay.activate --status``'s table, in a process that imported every module the
   overlay serves: the base must match and each module be the overlay's.
2. ``scripts``: the example and the two recipes under torchrun, one rank on the GPU (NCCL, a 1 x 1 mesh: DDP's
   reducer, the DTensor hooks and the comm path all run), each as it ships (TP + DDP, or TP + ``replicate()``) and
   with ``--wrapper none`` (TP alone). Each run must pass the script's own resume check, and the data-parallel run
   must give TP alone's losses, step for step. Beside them, the example's model on a 2 x 2 mesh, 4 ranks sharing
   the GPU over gloo with CUDA tensors, against the plain model trained on the whole batch.
3. ``tests``: the suite's TP + DDP and FSDP test classes, each its own pytest under the step's time limit, several
   at once. With one GPU the classes of 2 or 4 ranks run them on CPU with gloo (the suite hides the GPU from them,
   tools/rank_devices.py); those that take one rank per GPU run it on the GPU with NCCL, upstream's too (the CPU
   suite deselects them, pyproject.toml); a test that needs more GPUs skips, saying why.
4. ``bench``: part 1 of tools/bench_tp_ddp.py (one process, a 1 x 1 mesh, NCCL) on the GPU, eager and compiled, at
   a launch-bound size and a compute-bound one: TP + DDP over TP alone next to DDP over the plain model, and the
   overlay's DDP(TP) over stock's.

The table goes to stdout and to ``--out`` (default ``$OUT/gpu_check.md`` when ``OUT`` is set, else
``build/gpu_check.md``); the exit code is 1 if a row failed or timed out. Without a GPU (or with ``--dry-run``) it
checks that everything it would run is found (the scripts and their options, the test classes, collected, and the
tools), says so in one line and exits 0: what CI runs. ``--device cpu`` runs the steps on CPU, to try them here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOT = ROOT / "test" / "overlay" / "boot"
WHEELS = ROOT / ".whl"
"""Pure-Python wheels the suite needs and the machine lacks (expecttest: torch's test harness imports it)."""

LIMITS = {"status": 45, "scripts": 120, "tests": 170, "bench": 130}
"""Seconds per step: 8 minutes in all, at most."""

# Each script, and its options for one rank on ``{device}``.
SCRIPTS = {
    "examples/tp_ddp_train.py": ("--tp", "1"),
    "examples/titan_style_tp_replicate.py": ("--tp", "1"),
    "examples/fabric_tp_ddp.py": ("--tp", "1", "--accelerator", "{device}"),
}

# The suite's TP + DDP and FSDP tests, run by class, as `make test` runs them (pyproject.toml's deselections apply).
TESTS = (
    "test/distributed/tensor/parallel/test_ddp_2d_parallel.py",
    "test/distributed/tensor/test_dtensor_clip_grad_norm.py",
    "test/distributed/tensor/test_optimizers.py",
    "test/distributed/test_dynamo_distributed.py::TestDDPOptimizerDTensor",
    "test/distributed/fsdp/test_fsdp_tp_integration.py::TestTPFSDPFrozenParams",
    "test/distributed/fsdp/test_fsdp_unshard_params.py",
    "test/distributed/fsdp/test_fsdp_unshard_cpu_offload.py",
)
# Upstream's DDP and FSDP classes that the CPU suite deselects (pyproject.toml) and that run on one GPU with NCCL,
# one rank (their tests that need 2 or 4 GPUs are left out: each would spawn its ranks only to skip).
ONE_GPU = (
    "test/distributed/fsdp/test_fsdp_unshard_params.py::TestUnshardParamsNoShard",
    "test/distributed/test_dynamo_distributed.py::TestSingleProc",
    *(
        f"test/distributed/test_dynamo_distributed.py::TestMultiProc::test_fsdp_{name}"
        for name in (
            "aot_eager",
            "setattr",
            "unspecialized_forced_getattr_no_inline",
            "unspecialized_forced_getattr_inline",
            "inductor",
            "activation_checkpointing",
        )
    ),
)
NO_DESELECT = ("-o", "addopts=-p no:cacheprovider")

# Part 1 of bench_tp_ddp at two sizes: 8 blocks of Linear(dim, 2 dim) and back, and its iterations per repeat.
BENCH_SIZES = {
    "launch-bound": ("--tiny-dim", "16", "--tiny-batch", "8", "--launch-iters", "20"),
    "compute-bound": ("--tiny-dim", "2048", "--tiny-batch", "4096", "--launch-iters", "3"),
}


@dataclass
class Row:
    step: str
    check: str
    result: str
    """ok, FAILED, timeout, or measured (figures)."""
    detail: str
    seconds: float


@dataclass
class Ran:
    returncode: int | None
    output: str
    seconds: float
    timed_out: bool


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child: the overlay on in every interpreter (the suite's boot directory, strict), this
    checkout and the wheels of ``.whl/`` on PYTHONPATH."""
    wheels = [str(w) for w in sorted(WHEELS.glob("*.whl"))]
    path = [str(BOOT), str(ROOT), *wheels, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "TORCH_OVERLAY": "require", **extra}


def run(command: list[str], limit: float, env: dict[str, str] | None = None) -> Ran:
    """``command`` in its own process group, killed with all its children (ranks) past ``limit`` seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=max(limit, 1))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    return Ran(proc.returncode, output, time.monotonic() - start, timed_out)


def tail(text: str, lines: int = 3) -> str:
    """The last non-empty lines of ``text``, on one line."""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])[-400:]


# 1. status

STATUS = """
import importlib, sys
from torch_overlay._manifest import load_manifest
from torch_overlay._status import status
for module in load_manifest().runtime_modules:
    importlib.import_module(module.name)
state = status()
print(state.format())
sys.exit(0 if state.ok else 1)
"""


def check_status(limit: float) -> list[Row]:
    ran = run([sys.executable, "-c", STATUS], limit)
    base = re.search(r"^base:\s+(.*)$", ran.output, re.MULTILINE)
    modules = re.findall(r"^  (\S+)\s+(overlay|stock|not imported)$", ran.output, re.MULTILINE)
    served = [name for name, state in modules if state == "overlay"]
    ok = ran.returncode == 0 and base and "matches" in base[1] and modules and len(served) == len(modules)
    detail = f"base: {base[1] if base else '?'}; served: {len(served)} of {len(modules)} modules"
    if not ok:
        detail += f"; {tail(ran.output)}"
    return [Row("1 status", "--status: the base matches, the overlay is served", result(ok, ran), detail, ran.seconds)]


def result(ok: object, ran: Ran | None = None) -> str:
    return "timeout" if ran is not None and ran.timed_out else "ok" if ok else "FAILED"


# 2. scripts


def torchrun(script: str, device: str, *extra: str) -> list[str]:
    """``script`` on one rank, as a user runs it (``--standalone``: a free port)."""
    options = [option.format(device=device) for option in SCRIPTS[script]]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        script,
        *options,
        *extra,
    ]


def losses(output: str) -> list[float]:
    """The losses a script printed for its training steps (``step N: loss X``)."""
    return [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", output, re.MULTILINE)]


def compare_script(script: str, device: str, wrapped: Ran, alone: Ran) -> Row:
    """The script's data-parallel run against its TP-alone run."""
    name = Path(script).name
    check = f"{name}: TP + data parallel vs TP alone, 1 x 1 mesh"
    seconds = max(wrapped.seconds, alone.seconds)
    for label, ran in (("TP + DP", wrapped), ("TP alone", alone)):
        if ran.timed_out or ran.returncode != 0 or "\nOK: " not in f"\n{ran.output}":
            return Row(
                "2 scripts", check, result(False, ran), f"{label}: exit {ran.returncode}; {tail(ran.output)}", seconds
            )
    where = re.search(r"^1 ranks on (\w+)( \(\w+\))?", wrapped.output, re.MULTILINE)
    if where is None or where[1] != device:
        return Row("2 scripts", check, "FAILED", f"not on {device}: {tail(wrapped.output, 8)}", seconds)
    a, b = losses(wrapped.output), losses(alone.output)
    if not a or len(a) != len(b):
        return Row("2 scripts", check, "FAILED", f"step losses {a} vs {b}", seconds)
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    same = all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a, b, strict=True))
    detail = (
        f"on {where[0].removeprefix('1 ranks on ')}; {len(a)} steps, losses {a[0]:g} .. {a[-1]:g}, largest "
        f"difference from TP alone {diff:g}; both resume as saved"
    )
    return Row("2 scripts", check, result(same), detail, seconds)


def check_scripts(limit: float, device: str) -> list[Row]:
    """Each script as it ships and with ``--wrapper none``, and the example's model on 4 ranks sharing the device,
    all at once."""
    with ThreadPoolExecutor(2 * len(SCRIPTS) + 1) as pool:
        wrapped = {script: pool.submit(run, torchrun(script, device), limit) for script in SCRIPTS}
        alone = {script: pool.submit(run, torchrun(script, device, "--wrapper", "none"), limit) for script in SCRIPTS}
        shared = pool.submit(run, [sys.executable, "-c", SHARED, device], limit)
        rows = [compare_script(s, device, wrapped[s].result(), alone[s].result()) for s in SCRIPTS]
        return [*rows, shared_row(device, shared.result())]


# NCCL cannot put two ranks on one GPU; gloo can, with CUDA tensors (it stages them through the host).
SHARED = """
import json, sys
from tools.gpu_check import SHARED_RANKS, shared_device_worker
from tools.ranks import run_ranks
results = run_ranks(shared_device_worker, SHARED_RANKS, sys.argv[1])
print("SHARED", json.dumps(sorted(results) if results else None))
"""
SHARED_RANKS, SHARED_STEPS = 4, 5


def shared_device_worker(rank: int, init_file: str, device_type: str, queue) -> None:
    """One of 4 ranks on one device (cuda:0, or the CPU), gloo, a 2 x 2 (dp x tp) mesh: the example's model, its
    TP plan and DDP (``build``), trained a few steps as the example trains, and its plain model trained on the whole
    batch (both dp ranks' batches) as the reference. Puts (rank, TP + DDP's losses, the reference's, its DTensor
    parameters after training and TP alone's)."""
    import importlib.util

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    spec = importlib.util.spec_from_file_location("tp_ddp_train", ROOT / "examples" / "tp_ddp_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        torch.accelerator.set_device_index(0)  # every rank: before the mesh, which would pick a device by rank
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SHARED_RANKS)
    mesh = init_device_mesh(device.type, (SHARED_RANKS // 2, 2), mesh_dim_names=("dp", "tp"))
    model, optimizer = example.build(mesh, device)
    torch.manual_seed(0)  # build()'s seed: the reference starts from the TP model's full weights
    reference = example.Model().to(device)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    got, want = [], []
    for step in range(SHARED_STEPS):
        tokens, targets = example.batch(step, mesh["dp"].get_local_rank(), device)
        got.append(example.train_step(model, optimizer, tokens, targets).item())
        batches = [example.batch(step, dp, device) for dp in range(mesh["dp"].size())]
        loss = sum(F.cross_entropy(reference(t).flatten(0, 1), y.flatten()) for t, y in batches) / len(batches)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        want.append(loss.item())
    tp_alone = sum(isinstance(p, DTensor) for p in example.build(mesh, device, "none")[0].parameters())
    queue.put((rank, got, want, sum(isinstance(p, DTensor) for p in model.parameters()), tp_alone))
    dist.destroy_process_group()


def shared_row(device: str, ran: Ran) -> Row:
    check = f"tp_ddp_train.py's model: TP + DDP, 2 x 2 mesh, {SHARED_RANKS} ranks on one {device}, gloo"
    found = re.search(r"^SHARED (.*)$", ran.output, re.MULTILINE)
    results = json.loads(found[1]) if found else None
    if ran.timed_out or not results:
        return Row("2 scripts", check, result(False, ran), f"exit {ran.returncode}; {tail(ran.output)}", ran.seconds)
    _, got, want, kept, made = results[0]
    same = all(r[1:] == results[0][1:] for r in results) and all(
        math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5) for x, y in zip(got, want, strict=True)
    )
    diff = max(abs(x - y) for x, y in zip(got, want, strict=True))
    detail = (
        f"{len(got)} steps, losses {got[0]:.6f} .. {got[-1]:.6f}; largest difference from the plain model on the "
        f"whole batch {diff:.2g}; DTensor parameters under DDP: {kept} of TP's {made}"
    )
    same = same and kept == made
    return Row("2 scripts", check, result(same), detail, ran.seconds)


# 3. tests

PYTEST = """
import json, sys, pytest
from tools.gpu_check import Select
sys.exit(pytest.main(sys.argv[2:], plugins=[Select(json.loads(sys.argv[1]))]))
"""


class Select:
    """pytest plugin: keeps the tests ``prefixes`` name (node ids, or their classes), after the suite's own selection
    (test/conftest.py refuses a run that leaves out a red test of a file it collects), and with ``--collect-only``
    prints each and where its ranks run on this machine."""

    def __init__(self, prefixes: list[str]) -> None:
        self.prefixes = prefixes

    def selected(self, node: str) -> bool:
        return any(node == p or node.startswith(f"{p}::") for p in self.prefixes)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        config.hook.pytest_deselected(items=[item for item in items if not self.selected(item.nodeid)])
        items[:] = [item for item in items if self.selected(item.nodeid)]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.config.option.collectonly:
            return
        import torch

        from tools.rank_devices import _MULTI_RANK_BASES, rank_env_here, world_size

        accelerator = torch.accelerator.current_accelerator()
        gpus = torch.accelerator.device_count() if accelerator else 0
        device = accelerator.type if accelerator else "CPU"
        for item in session.items:
            cls = getattr(item, "cls", None)
            ranks = world_size(cls)
            if rank_env_here(cls):
                where = f"{ranks} ranks on CPU, gloo (the GPU hidden: {gpus} GPU)"
            elif ranks is not None:
                where = f"{ranks} ranks on {device if gpus >= ranks else 'CPU'}"
            elif cls is not None and any(b.__name__ in _MULTI_RANK_BASES for b in cls.__mro__):
                where = f"one rank per GPU ({gpus}), {device}" if accelerator else "ranks on CPU"
            else:
                where = f"one process, {device}"
            print(f"COLLECTED {item.nodeid} :: {where}")


def pytest_command(selection: tuple[str, ...], *options: str) -> list[str]:
    """pytest on the files of ``selection``, keeping the tests it names (:class:`Select`)."""
    files = dict.fromkeys(s.split("::")[0] for s in selection)
    return [sys.executable, "-c", PYTEST, json.dumps(selection), *options, *files]


def collect(selection: tuple[str, ...], *options: str, limit: float = 120) -> tuple[dict[str, str], str]:
    """Node id -> where it runs, for the tests ``selection`` names, and what went wrong (empty if nothing)."""
    ran = run(pytest_command(selection, "--collect-only", "-q", *options), limit)
    found = dict(re.findall(r"^COLLECTED (\S+) :: (.*)$", ran.output, re.MULTILINE))
    missing = [s for s in selection if not any(Select([s]).selected(n) for n in found)]
    problem = ""
    if ran.returncode != 0 or missing:
        problem = f"collection: exit {ran.returncode}, nothing collected for {missing}; {tail(ran.output)}"
    return found, problem


def units(tests: dict[str, str], one_gpu: dict[str, str]) -> list[tuple[str, tuple[str, ...], str, tuple[str, ...]]]:
    """What to run, one pytest each: (class, node ids, where, pytest options), the largest first."""
    grouped: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for found, options in ((tests, ()), (one_gpu, NO_DESELECT)):
        for node in found:
            grouped.setdefault(("::".join(node.split("::")[:2]), options), []).append(node)
    todo = [(name, tuple(nodes), (tests | one_gpu)[nodes[0]], options) for (name, options), nodes in grouped.items()]
    return sorted(todo, key=lambda unit: -len(unit[1]))


def run_unit(name: str, nodes: tuple[str, ...], where: str, options: tuple[str, ...], deadline: float) -> Row:
    """One pytest for ``nodes`` (a class, or some of its tests), killed at ``deadline``."""
    check = name.removeprefix("test/distributed/")
    if deadline - time.monotonic() < 10:
        return Row("3 tests", check, "timeout", f"{where}: not run, the step's time was up", 0.0)
    # A test past 2 minutes dumps every thread's stack (pytest's faulthandler), before the step's limit kills it.
    command = pytest_command(nodes, "-v", "-rs", *options, "-o", "faulthandler_timeout=120")
    ran = run(command, deadline - time.monotonic())
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", ran.output, re.MULTILINE)
    counts = {o: sum(1 for _, x in outcomes if x == o) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    summary = ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n) or "nothing ran"
    reasons = sorted(set(re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", ran.output, re.MULTILINE)))
    detail = f"{where}: {summary}"
    if reasons:
        detail += f"; skipped: {'; '.join(r[:80] for r in reasons[:2])}"
    if ran.timed_out:
        started = re.findall(r"^(\S+::\S+) ", ran.output, re.MULTILINE)
        running = [n for n in started if n not in dict(outcomes)]
        detail += f"; killed at {ran.seconds:.0f} s, in {running[-1] if running else 'set-up or teardown'}"
    ok = ran.returncode == 0 and not counts["FAILED"] and not counts["ERROR"]
    if not ok and not ran.timed_out:
        failed = [n for n, o in outcomes if o in ("FAILED", "ERROR")]
        detail += f"; {', '.join(n.split('::')[-1] for n in failed[:3]) or tail(ran.output)}"
    return Row("3 tests", check, result(ok, ran), detail, ran.seconds)


def check_tests(limit: float) -> list[Row]:
    deadline = time.monotonic() + limit
    with ThreadPoolExecutor(2) as pool:
        tests = pool.submit(collect, TESTS, limit=limit / 3)
        one_gpu = pool.submit(collect, ONE_GPU, *NO_DESELECT, limit=limit / 3)
        (tests, problem), (one_gpu, one_gpu_problem) = tests.result(), one_gpu.result()
    rows = [Row("3 tests", "collect", "FAILED", p, 0.0) for p in (problem, one_gpu_problem) if p]
    # Several at once: a 4-rank class is 5 processes, mostly waiting on each other.
    with ThreadPoolExecutor(max(2, min(6, (os.cpu_count() or 2) // 3))) as pool:
        futures = [pool.submit(run_unit, *unit, deadline) for unit in units(tests, one_gpu)]
        rows += [future.result() for future in futures]
    return rows


# 4. bench


def check_bench(limit: float, device: str) -> list[Row]:
    """bench_tp_ddp's part 1 on ``device``, at each size, in its own process (its spawned rank)."""
    rows = []
    deadline = time.monotonic() + limit
    for size, options in BENCH_SIZES.items():
        code = (
            "import json, sys; from tools import bench_tp_ddp as b; from tools.ranks import run_ranks\n"
            "args = b.parser().parse_args(sys.argv[1:])\n"
            "figures = run_ranks(b._launch_worker, 1, args)\n"
            "print('FIGURES', json.dumps(figures[0]) if figures else 'none')\n"
        )
        ran = run(
            [sys.executable, "-c", code, "--device", device, "--repeats", "5", *options], deadline - time.monotonic()
        )
        found = re.search(r"^FIGURES (\{.*\})$", ran.output, re.MULTILINE)
        if found is None:
            rows.append(Row("4 bench", size, result(False, ran), tail(ran.output), ran.seconds))
            continue
        medians = {key: statistics.median(times) * 1e3 for key, times in json.loads(found[1]).items()}
        rows += bench_rows(size, medians, ran.seconds)
    return rows


def bench_rows(size: str, t: dict[str, float], seconds: float) -> list[Row]:
    rows = []
    for mode, target in (("", 1.05), ("_compiled", 1.2)):
        if f"tp{mode}" not in t:
            continue
        plain, tp = t[f"plain_ddp{mode}"] / t[f"plain{mode}"], t[f"tp_ddp{mode}"] / t[f"tp{mode}"]
        detail = (
            f"TP {t[f'tp{mode}']:.3f} ms, TP + DDP {t[f'tp_ddp{mode}']:.3f} ms: x{tp:.3f} "
            f"({t[f'tp_ddp{mode}'] - t[f'tp{mode}']:+.3f} ms; target <= {target}); plain model + DDP: x{plain:.3f} "
            f"({t[f'plain_ddp{mode}'] - t[f'plain{mode}']:+.3f} ms)"
        )
        if not mode:
            detail += f"; overlay / stock DDP(TP) {t['tp_ddp'] / t['tp_ddp_stock']:.3f}"
        check = f"{size}, {'compiled' if mode else 'eager'}"
        rows.append(Row("4 bench", check, "measured", detail, seconds))
    return rows


# The run


def dry_run(device_found: str) -> int:
    """Everything the check would run is found: one line, exit 0; else what is missing, exit 1."""
    start = time.monotonic()
    problems = [f"no {script}" for script in SCRIPTS if not (ROOT / script).is_file()]
    with ThreadPoolExecutor(4) as pool:
        helps = {s: pool.submit(run, [sys.executable, s, "--help"], 120) for s in SCRIPTS if (ROOT / s).is_file()}
        tests = pool.submit(collect, TESTS)
        one_gpu = pool.submit(collect, ONE_GPU, *NO_DESELECT)
        for script, future in helps.items():
            ran = future.result()
            if ran.returncode != 0 or "--wrapper" not in ran.output or "--tp" not in ran.output:
                problems.append(f"{script} --help: exit {ran.returncode}; {tail(ran.output)}")
        (found, problem), (found_one, problem_one) = tests.result(), one_gpu.result()
    problems += [p for p in (problem, problem_one) if p]
    try:
        from tools import bench_tp_ddp, rank_devices, ranks  # noqa: F401

        bench_tp_ddp.parser().parse_args(["--device", "cuda", *BENCH_SIZES["compute-bound"]])
    except (ImportError, SystemExit) as e:
        problems.append(f"tools: {e!r}")
    if problems:
        print("gpu-check dry run: not ready:\n" + "\n".join(problems))
        return 1
    classes = len(units(found, found_one))
    print(
        f"gpu-check: {device_found}: dry run only; found {len(SCRIPTS)} scripts (--wrapper, --tp), "
        f"{len(found) + len(found_one)} tests in {classes} classes (collected), the tools "
        f"({time.monotonic() - start:.0f} s)"
    )
    return 0


def table(rows: list[Row], header: list[str]) -> str:
    lines = [*header, "", "| step | check | result | detail | s |", "|---|---|---|---|---|"]
    lines += [f"| {r.step} | {r.check} | {r.result} | {r.detail.replace('|', '/')} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines) + "\n"


def machine(device: str) -> list[str]:
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return [
        f"gpu-check, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on {device}: {gpu}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}, NCCL {nccl}), Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="only check that everything it would run is found")
    parser.add_argument("--only", default=",".join(LIMITS), help=f"steps to run, of {','.join(LIMITS)}")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the steps without a GPU")
    parser.add_argument("--out", type=Path, help="the table's file (default: $OUT/gpu_check.md, else build/)")
    args = parser.parse_args(argv)
    steps = args.only.split(",")
    if unknown := set(steps) - set(LIMITS):
        parser.error(f"unknown steps {sorted(unknown)}: pick from {list(LIMITS)}")

    import torch

    if args.dry_run or (args.device == "cuda" and not torch.cuda.is_available()):
        found = f"torch {torch.__version__}, " + ("CUDA available" if torch.cuda.is_available() else "no GPU here")
        return dry_run(found)

    out = args.out or Path(os.environ.get("OUT") or ROOT / "build") / "gpu_check.md"
    rows: list[Row] = []
    checks = {
        "status": lambda limit: check_status(limit),
        "scripts": lambda limit: check_scripts(limit, args.device),
        "tests": lambda limit: check_tests(limit),
        "bench": lambda limit: check_bench(limit, args.device),
    }
    for step in steps:
        print(f"gpu-check: {step} (at most {LIMITS[step]} s) ...", flush=True)
        rows += checks[step](LIMITS[step])
    text = table(rows, machine(args.device))
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"written to {out}")
    return 1 if any(r.result in ("FAILED", "timeout") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
