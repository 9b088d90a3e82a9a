"""Run in a fresh interpreter by the machinery tests: report, as one JSON line, what this process sees.

Usage: python probe.py [--activate] [--spawn] [--out DIR]
  --activate  call torch_overlay.activate() after importing torch.distributed.fsdp
  --spawn     also report what a multiprocessing ``spawn`` child sees
  --out DIR   also write the report to DIR/rank-$RANK.json (torchrun ranks share one stdout, where their lines
              can run together)
"""

import json
import os
import sys
import warnings
from types import SimpleNamespace


def observe() -> dict:
    """Whether the modules served are ours, judged by behaviour (the offload warning's text), and where DDP's
    class comes from."""
    torch_imported_at_start = "torch" in sys.modules
    from torch.distributed.fsdp import _unshard_param_utils

    state = SimpleNamespace(_use_orig_params=True, _handle=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _unshard_param_utils._validate_unshard_params_args(
            state, writeback=False, rank0_only=False, offload_to_cpu=True, with_grads=False
        )
    text = " ".join(str(w.message) for w in caught)
    parallel = sys.modules["torch.nn.parallel"]
    return {
        "ddp_file": parallel.distributed.__file__,
        "ddp_subclass_on_it": parallel.DistributedDataParallelCPU.__bases__ == (parallel.DistributedDataParallel,),
        "torch_imported_at_start": torch_imported_at_start,
        "warning_fixed": "may result in the unsharded" in text,
        "warning_stock": "may result in theunsharded" in text,
        "module_file": _unshard_param_utils.__file__,
    }


def _child(queue) -> None:
    queue.put(observe())


def main(argv: list[str]) -> None:
    report = {"at_start": {"torch_imported": "torch" in sys.modules}}
    if "--activate" in argv:
        import torch.distributed.fsdp  # noqa: F401

        import torch_overlay

        torch_overlay.activate()
    report["here"] = observe()
    if "--spawn" in argv:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(queue,))
        child.start()
        report["spawned_child"] = queue.get(timeout=120)
        child.join()
    print(json.dumps(report))
    if "--out" in argv:
        out = os.path.join(argv[argv.index("--out") + 1], f"rank-{os.environ.get('RANK', '0')}.json")
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1:])
