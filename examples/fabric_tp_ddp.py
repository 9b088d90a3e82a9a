"""Tensor parallel + data parallel under Lightning Fabric's ModelParallelStrategy: TP plan, then replicate().

    torchrun --nproc_per_node 4 examples/fabric_tp_ddp.py [--steps 4] [--checkpoint-dir DIR]
    python examples/fabric_tp_ddp.py            # the same: Fabric starts the 4 processes itself

Needs lightning, which must not replace your torch: pin torch's installed version (`pip show torch`) in a constraint
file, `pip install -c torch-pin.txt lightning expecttest numpy` (docs/recipes.md shows how; expecttest: torch's
testing modules, where the model comes from, import it; numpy: DCP's object collectives).

The model is upstream's test Transformer (torch.testing._internal.distributed._tensor.common_dtensor), built on the
meta device by `fabric.init_module(empty_init=True)`. Fabric's strategy calls `parallelize_fn(model, mesh)` with a
("data_parallel", "tensor_parallel") mesh; the function applies the Transformer's own TP plan over
mesh["tensor_parallel"] (vocabulary-parallel embeddings, sequence-parallel norms, Colwise/Rowwise attention and
MLP, the output projection tied to the embedding), then `replicate(model, device_mesh=mesh["data_parallel"])`.
Fabric then materializes the model (`to_empty()` and each module's `reset_parameters()`, after wrapping). A few
AdamW steps, `fabric.save` (a DCP checkpoint: one file per rank), `fabric.load` into a fresh model and optimizer;
the script exits 1 unless the loaded model holds the saved values and gives the saved model's loss, and one more
step of each gives the same loss. CPU/gloo (accelerator="cpu"), or CUDA/NCCL with --accelerator cuda. `--wrapper
none` leaves the data-parallel wrapper out: TP alone (as many processes as --tp), what TP + `replicate()` on one
data-parallel rank must train like.

Why `replicate(model, device_mesh=...)` and not `DistributedDataParallel(model, device_mesh=...)` in
`parallelize_fn`: `fabric.load` of a DCP checkpoint (lightning 2.6.6, `ModelParallelStrategy.load_checkpoint`)
builds the model's state dict with `get_model_state_dict(module)`, which strips DDP's `module.` prefix, fills it from
the checkpoint, then calls `module.load_state_dict(state, strict=True)` on the module that `parallelize_fn` returned.
A DDP wrapper wants `module.`-prefixed keys, so the load fails on every rank with
"Missing key(s) in state_dict: "module.tok_embeddings.weight", ... Unexpected key(s) in state_dict:
"tok_embeddings.weight", ..." (run with `--wrapper ddp --no-empty-init` to see it; without `--no-empty-init` DDP
fails sooner, "Tensor.item() cannot be called on meta tensors": its constructor checks the parameters' shapes across
ranks, and Fabric materializes a meta model only after `parallelize_fn`). `replicate()` wraps in place and builds
its DDP at the first forward: the model keeps its own keys, so the same load works, and init after wrapping too.

On stock torch (no overlay) the script stops at once, in one line, at `torch_overlay.require_active()`. Without
that line, DDP inside `replicate()` swaps the TP parameters for plain local tensors at the first
forward, and the second step raises on every rank: "RuntimeError: Expected to have finished reduction in the prior
iteration before starting a new one" (a parameter that received no gradient).
"""

import argparse
import os
import sys
import tempfile
from functools import partial

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed._composable.replicate import replicate
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import torch_overlay

# dropout 0: the saved and the resumed model must compute the same numbers.
ARGS = ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=32, n_heads=4, dropout_p=0.0, weight_tying=True)
SEQ, BATCH = 16, 8


def parallelize(model: Transformer, mesh, wrapper: str) -> nn.Module:
    """Fabric's parallelize_fn: the Transformer's TP plan over mesh["tensor_parallel"], then data parallel."""
    # use_seq_parallel: embeddings sharded over the vocabulary, norms over the sequence. local_output_for_attn: q, k
    # and v as local tensors, since SDPA has no DTensor rule on CPU.
    Transformer.parallelize(model, mesh["tensor_parallel"], use_seq_parallel=True, local_output_for_attn=True)
    if wrapper == "ddp":
        return DDP(model, device_mesh=mesh["data_parallel"])  # see the docstring: fabric.load fails on it
    if wrapper == "replicate":
        replicate(model, device_mesh=mesh["data_parallel"])
    return model


def setup(fabric: L.Fabric, seed: int, empty_init: bool):
    """A model (on meta, materialized by Fabric after parallelize_fn) and its AdamW, both through Fabric."""
    # The same seed on every rank: TP's ranks must initialize one model (replicate() also broadcasts over dp).
    torch.manual_seed(seed)
    with fabric.init_module(empty_init=empty_init):
        model = Transformer(ARGS)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    return model, optimizer


def batch(fabric: L.Fabric, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod the vocabulary and their next tokens: one batch per data-parallel rank (the TP ranks
    of a dp group see the same one)."""
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
    g = torch.Generator().manual_seed(1000 * seed + dp_rank)
    start = torch.randint(ARGS.vocab_size, (BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % ARGS.vocab_size
    return seq[:, :-1].to(fabric.device), seq[:, 1:].to(fabric.device)


def losses(fabric: L.Fabric, model, tokens, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss, and its mean over all ranks (detached: the same number on every rank)."""
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    return loss, fabric.all_reduce(loss.detach().clone(), reduce_op="sum") / fabric.world_size


def train_step(fabric: L.Fabric, model, optimizer, tokens, targets) -> torch.Tensor:
    loss, mean = losses(fabric, model, tokens, targets)
    fabric.backward(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # the whole model's norm, on every rank
    optimizer.step()
    optimizer.zero_grad()
    return mean


@torch.no_grad()
def eval_loss(fabric: L.Fabric, model, tokens, targets) -> torch.Tensor:
    return losses(fabric, model, tokens, targets)[1]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the model's state dict as a full tensor (a collective for the DTensors: call on every rank)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps before the checkpoint")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel degree (divides the 4 processes)")
    parser.add_argument("--checkpoint-dir", help="where fabric.save writes (default: a temporary directory)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo, the default) or cuda (NCCL)")
    parser.add_argument("--wrapper", choices=("replicate", "ddp", "none"), default="replicate", help="see the doc")
    parser.add_argument("--no-empty-init", dest="empty_init", action="store_false", help="build on the CPU, not meta")
    args = parser.parse_args()

    # First, on every rank, in one line: on stock torch the TP weights would leave the model at the first forward.
    try:
        torch_overlay.require_active()
    except torch_overlay.NotActiveError as e:
        sys.exit(str(e))

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 4))
    if args.wrapper == "none" and devices != args.tp:
        parser.error(f"--wrapper none trains TP alone: run as many processes as --tp ({args.tp})")
    strategy = ModelParallelStrategy(
        parallelize_fn=partial(parallelize, wrapper=args.wrapper),
        data_parallel_size=devices // args.tp,
        tensor_parallel_size=args.tp,
    )
    fabric = L.Fabric(accelerator=args.accelerator, devices=devices, strategy=strategy)
    fabric.launch()
    say = fabric.print  # rank 0 only
    mesh = dict(zip(fabric.strategy.device_mesh.mesh_dim_names, fabric.strategy.device_mesh.shape, strict=True))
    say(f"{fabric.world_size} ranks on {fabric.device.type}, mesh {mesh}")

    model, optimizer = setup(fabric, seed=0, empty_init=args.empty_init)
    for step in range(args.steps):
        say(f"step {step}: loss {train_step(fabric, model, optimizer, *batch(fabric, step)):.4f}")

    tmp = tempfile.TemporaryDirectory(prefix="fabric_tp_ckpt_") if fabric.global_rank == 0 else None
    path = args.checkpoint_dir or os.path.join(fabric.broadcast(tmp and tmp.name), "checkpoint")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": args.steps})
    eval_batch = batch(fabric, 10_000)
    saved_loss, saved_state = eval_loss(fabric, model, *eval_batch), full_state(model)
    say(f"saved to {path}: loss {saved_loss:.6f}")

    # Load into a fresh model and optimizer with other initial weights: only the checkpoint can carry them over.
    resumed, resumed_optimizer = setup(fabric, seed=1, empty_init=args.empty_init)
    state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
    fabric.load(path, state)
    resumed_state = full_state(resumed)
    resumed_loss = eval_loss(fabric, resumed, *eval_batch)
    say(f"resumed at step {state['step']}: loss {resumed_loss:.6f}")
    same_values = list(resumed_state) == list(saved_state) and all(
        torch.equal(resumed_state[k], v) for k, v in saved_state.items()
    )

    next_batch = batch(fabric, args.steps)
    train_step(fabric, model, optimizer, *next_batch)
    train_step(fabric, resumed, resumed_optimizer, *next_batch)
    next_saved, next_resumed = eval_loss(fabric, model, *eval_batch), eval_loss(fabric, resumed, *eval_batch)
    say(f"one more step: loss {next_saved:.6f} (saved model), {next_resumed:.6f} (resumed)")
    fabric.barrier()  # every rank is done with the checkpoint before rank 0 removes a temporary one
    torch.distributed.destroy_process_group()  # after the barrier: no rank exits while another still talks

    # The losses are means over all ranks and the values full tensors: every rank takes the same exit.
    if not same_values or state["step"] != args.steps:
        say("FAILED: fabric.load did not restore the saved values")
        return 1
    if not torch.equal(resumed_loss, saved_loss):
        say(f"FAILED: the loaded model's loss is {resumed_loss:.6f}, not {saved_loss:.6f}")
        return 1
    if not torch.allclose(next_resumed, next_saved, rtol=1e-5, atol=0):
        say(f"FAILED: the checkpoint did not restore the optimizer: next loss {next_resumed:.6f}, not {next_saved:.6f}")
        return 1
    say(f"OK: fabric.load restored all {len(saved_state)} tensors and the optimizer; the loss is the saved one.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
