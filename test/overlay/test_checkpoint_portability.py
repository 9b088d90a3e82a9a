"""A DCP checkpoint written by TP + DDP with the overlay loads on stock torch, in one process, into the plain model.

The save: examples/tp_ddp_train.py's model with its TP plan on a 2 x 2 (dp, tp) mesh, 4 CPU ranks under torchrun,
wrapped by ``DDP(device_mesh=mesh["dp"])`` and, in a second checkpoint, by ``replicate(device_mesh=mesh["dp"])``,
3 AdamW steps, then ``dcp.save`` of ``get_state_dict(model, optimizer)``, as the example writes it. Rank 0 also
writes the saved model's full tensors (``full_tensor()`` of its own ``state_dict()``) beside it.

The load: one process on stock torch (``TORCH_OVERLAY=0``, no boot directory on the path; the test checks that no
module of the overlay was served), no process group, the plain model (no TP, no wrapper), two ways: DCP's
``dcp_to_torch_save`` then ``torch.load``, and ``dcp.load(..., no_dist=True)`` into the model's own state dict.
Each ends in ``load_state_dict(strict=True)`` and must give the saved full tensors exactly; the optimizer state is
there for every parameter, in its full shape.

On stock torch (``pytest --stock``) the save itself fails: the TP parameters left the model at its first forward,
and ``get_state_dict`` cannot name their optimizer state (``KeyError``) on every rank.

This file is also the rank script: ``python test_checkpoint_portability.py save DIR`` under torchrun, ``load DIR``.
"""

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WRAPPERS = ("ddp", "replicate")
STEPS = 3

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_example import said, torchrun  # noqa: E402


def save(directory: Path) -> None:
    """Under torchrun, 4 ranks: train each wrapper's model a few steps and write its DCP checkpoint and full tensors."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import tp_ddp_train as example
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, device = mesh["dp"].get_local_rank(), torch.device("cpu")
    plan = {}
    for i in range(example.LAYERS):  # the example's plan
        plan |= {f"layers.{i}.{name}": ColwiseParallel() for name in ("wq", "wk", "wv", "w1")}
        plan |= {f"layers.{i}.{name}": RowwiseParallel() for name in ("wo", "w2")}
    for wrapper in WRAPPERS:
        torch.manual_seed(0)
        model = example.Model()
        parallelize_module(model, mesh["tp"], plan)
        if wrapper == "ddp":
            wrapped = DDP(model, device_mesh=mesh["dp"])
        else:
            wrapped = replicate(model, device_mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
        for step in range(STEPS):
            example.train_step(wrapped, optimizer, *example.batch(step, dp_rank, device))
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory / wrapper)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        tp = sorted(k for k, v in model.state_dict().items() if isinstance(v, DTensor))
        if dist.get_rank() == 0:
            torch.save({"full": full, "tp": tp}, directory / f"{wrapper}.saved.pt")
            print(f"saved {wrapper}: {len(full)} tensors, {len(tp)} of them TP shards", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def load(directory: Path) -> None:
    """One process, stock torch, no process group: each checkpoint into the plain model, strictly, two ways."""
    import torch
    import torch.distributed.checkpoint as dcp
    import tp_ddp_train as example
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    overlay = str(ROOT / "torch_overlay")
    served = [
        n
        for n, m in sys.modules.items()
        if n.split(".")[0] == "torch" and (getattr(m, "__file__", None) or "").startswith(overlay)
    ]
    assert not served, f"the overlay served {sorted(served)}: this process must run stock torch"
    for wrapper in WRAPPERS:
        saved = torch.load(directory / f"{wrapper}.saved.pt")
        full, tp = saved["full"], saved["tp"]
        assert tp, "the saved model holds no TP parameter"

        dcp_to_torch_save(directory / wrapper, directory / f"{wrapper}.pt")
        checkpoint = torch.load(directory / f"{wrapper}.pt")
        plain = example.Model()
        plain.load_state_dict(checkpoint["model"], strict=True)
        state = {k: v.detach() for k, v in plain.state_dict().items()}
        assert list(state) == list(full), f"{wrapper}: keys {list(state)} != {list(full)}"
        for key, value in full.items():
            assert torch.equal(state[key], value), f"{wrapper} (dcp_to_torch_save): {key} differs from the saved"
        optim_state = checkpoint["optim"]["state"]
        assert sorted(optim_state) == sorted(full), f"{wrapper}: optimizer state for {sorted(optim_state)}"
        for key, value in full.items():
            assert optim_state[key]["exp_avg"].shape == value.shape, f"{wrapper}: {key}'s exp_avg is not full"

        plain = example.Model()
        no_dist = {"model": plain.state_dict()}
        dcp.load(no_dist, checkpoint_id=directory / wrapper, no_dist=True)
        plain.load_state_dict(no_dist["model"], strict=True)
        for key, value in plain.state_dict().items():
            assert torch.equal(value, full[key]), f"{wrapper} (dcp.load no_dist): {key} differs from the saved"
        print(f"loaded {wrapper} on stock: {len(full)} tensors equal ({len(tp)} were TP shards), both ways", flush=True)


class TestCheckpointPortability(unittest.TestCase):
    def test_tp_ddp_checkpoint_loads_on_stock_into_the_plain_model(self):
        with tempfile.TemporaryDirectory(prefix="portability_") as directory:
            # The ranks get the overlay (or stock, with --stock) from the environment conftest sets.
            saved = torchrun(__file__, "save", directory)
            self.assertEqual(saved.returncode, 0, said(saved))
            for wrapper in WRAPPERS:
                self.assertRegex(saved.stdout, rf"saved {wrapper}: \d+ tensors, [1-9]\d* of them TP shards")

            stock = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            stock["TORCH_OVERLAY"] = "0"
            loaded = subprocess.run(
                [sys.executable, __file__, "load", directory],
                env=stock,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=300,
            )
            self.assertEqual(loaded.returncode, 0, loaded.stdout[-3000:])
            for wrapper in WRAPPERS:
                self.assertRegex(loaded.stdout, rf"loaded {wrapper} on stock: \d+ tensors equal")


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"]:
        save(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["load"]:
        load(Path(sys.argv[2]))
    else:
        unittest.main()
