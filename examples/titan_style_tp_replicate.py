"""A torchtitan-style training script: meta device, TP plan, replicate() over dp, to_empty() and init, DCP resume.

    torchrun --nproc_per_node 4 examples/titan_style_tp_replicate.py [--tp 2] [--steps 5] [--save-at 3] [--wrapper none]

In torchtitan's order: a Llama-like model (RMSNorm, rotary embeddings, SwiGLU) is built on the meta device; its
TP plan is torchtitan's Llama plan without loss parallel (a vocabulary-parallel embedding with a sequence-sharded
output, sequence-parallel norms, `PrepareModuleInput` before attention and feed-forward, Colwise/Rowwise
projections, a Colwise output projection with replicated logits); `replicate(model, device_mesh=mesh["dp"])`
wraps it; then `to_empty(device=...)` and the model's own `init_weights()` materialize it (the rotary table too,
a non-persistent buffer), and AdamW is built from its parameters. Each step clips by the whole model's norm
(`clip_grad_norm_`). At `--save-at` the model, optimizer and step go to a DCP checkpoint through a `Stateful`
(`get_state_dict`/`set_state_dict` of `torch.distributed.checkpoint.state_dict`), and training goes on to `--steps`.
Then a fresh model, built the same way with other initial weights, resumes from the checkpoint and trains the same
steps on the same batches: the script exits 1 unless the resumed run gives the first run's losses, step for step.
NCCL when each local rank has a GPU, else gloo on CPU. `--wrapper none` leaves `replicate()` out: TP alone (as many
ranks as --tp), what TP + `replicate()` on one dp rank must train like.

On stock torch (no overlay) the script stops at once, in one line, at `torch_overlay.require_active()`. Without
that line, DDP inside `replicate()` swaps the TP parameters for plain local tensors at the first
forward: training goes on without error but not as TP alone would (other losses from step 1), and the checkpoint
cannot be written: `get_state_dict` raises `KeyError: 0` in `_get_optim_state_dict` on every rank, since the
optimizer's parameters are no longer the model's.
"""

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.replicate import replicate
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import torch_overlay


@dataclass
class Args:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 8
    rope_theta: float = 10_000.0


ARGS = Args()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim), in halves (real arithmetic, no complex tensors)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: Args) -> None:
        super().__init__()
        self.head_dim = a.dim // a.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(a.dim, a.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Under TP each rank holds heads / tp of the heads (its columns of wq, wk, wv, as local tensors): -1.
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_table[:s].chunk(2, dim=-1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=std)


class FeedForward(nn.Module):
    def __init__(self, a: Args) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(a.dim, a.hidden, bias=False), nn.Linear(a.dim, a.hidden, bias=False)
        self.w2 = nn.Linear(a.hidden, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, std=std)


class Block(nn.Module):
    def __init__(self, a: Args, layer: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(a.dim), nn.RMSNorm(a.dim)
        self.attention, self.feed_forward = Attention(a), FeedForward(a)
        self.std = 0.02 / (2 * (layer + 1)) ** 0.5  # torchtitan's depth-scaled init

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_table)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)


class Transformer(nn.Module):
    def __init__(self, a: Args) -> None:
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.layers))
        self.norm = nn.RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        # Not in the state dict: init_weights() computes it, after to_empty(), as torchtitan does.
        self.register_buffer("rope_table", torch.empty(a.seq, a.dim // a.heads), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_table)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        a = self.args
        half = a.dim // a.heads // 2
        freqs = 1.0 / a.rope_theta ** (torch.arange(half, device=self.rope_table.device) / half)
        angles = torch.outer(torch.arange(a.seq, device=freqs.device), freqs)
        self.rope_table.copy_(torch.cat((angles.cos(), angles.sin()), dim=-1))
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        bound = a.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=bound, a=-3 * bound, b=3 * bound)


def parallelize(model: Transformer, tp_mesh) -> None:
    """torchtitan's Llama TP plan (loss parallel off): the residual stream is sharded over the sequence between
    blocks; attention and feed-forward gather it, shard their heads / hidden units, and reduce-scatter back."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


def build(mesh, device: torch.device, seed: int, wrapper: str = "replicate") -> tuple[nn.Module, torch.optim.Optimizer]:
    """Meta, TP, replicate() (unless ``wrapper`` is "none"), to_empty() + init_weights(), then the optimizer:
    torchtitan's order."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize(model, mesh["tp"])
    if wrapper == "replicate":
        replicate(model, device_mesh=mesh["dp"], bucket_cap_mb=100)  # torchtitan's apply_ddp
    model.to_empty(device=device)
    torch.manual_seed(seed)  # the same on every rank: TP's ranks initialize one model
    model.init_weights()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


class TrainState(Stateful):
    """What the checkpoint holds, as torchtitan's CheckpointManager has it: model, optimizer, step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = state["step"]


def batch(step: int, dp_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod the vocabulary and their next tokens; one batch per dp rank and step."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    start = torch.randint(ARGS.vocab, (ARGS.batch, 1), generator=g)
    stride = torch.randint(1, 8, (ARGS.batch, 1), generator=g)
    seq = (start + stride * torch.arange(ARGS.seq + 1)) % ARGS.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def losses(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss, and its mean over all ranks (detached: the same number on every rank)."""
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # a sum: gloo has no AVG
    return loss, mean / dist.get_world_size()


def train_step(model, optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss, mean = losses(model, tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    return mean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel degree (divides the world size)")
    parser.add_argument("--steps", type=int, default=5, help="training steps in all")
    parser.add_argument("--save-at", type=int, default=3, help="the step the checkpoint is written at")
    parser.add_argument("--checkpoint-dir", help="where DCP writes (default: a temporary directory, removed after)")
    parser.add_argument("--wrapper", choices=("replicate", "none"), default="replicate", help="none: TP alone (dp 1)")
    args = parser.parse_args()

    # First, on every rank, in one line: on stock torch the TP weights would leave the model at the first forward.
    try:
        torch_overlay.require_active()
    except torch_overlay.NotActiveError as e:
        sys.exit(str(e))
    if "LOCAL_RANK" not in os.environ:
        sys.exit(f"{sys.argv[0]}: run it under torchrun: torchrun --nproc_per_node 4 {sys.argv[0]}")
    if args.wrapper == "none" and int(os.environ["WORLD_SIZE"]) != args.tp:
        parser.error(f"--wrapper none trains TP alone: run as many ranks as --tp ({args.tp})")

    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    say = print if rank == 0 else lambda *_: None
    alone = ", TP alone (no replicate())" if args.wrapper == "none" else ""
    say(f"{world} ranks on {device.type} ({backend}), mesh dp={world // args.tp} x tp={args.tp}{alone}")

    tmp = tempfile.TemporaryDirectory(prefix="titan_style_ckpt_") if rank == 0 and not args.checkpoint_dir else None
    path = [args.checkpoint_dir or (tmp and tmp.name)]
    dist.broadcast_object_list(path)  # every rank writes into rank 0's directory (one node)

    model, optimizer = build(mesh, device, seed=0, wrapper=args.wrapper)
    first_run = []
    for step in range(args.steps):
        if step == args.save_at:
            dcp.save({"train": TrainState(model, optimizer, step)}, checkpoint_id=path[0])
            say(f"saved at step {step} to {path[0]}")
        first_run.append(train_step(model, optimizer, *batch(step, dp_rank, device)))
        say(f"step {step}: loss {first_run[-1]:.6f}")

    # A fresh start, as after a restart: other initial weights, so only the checkpoint can carry the run over.
    resumed, resumed_optimizer = build(mesh, device, seed=1, wrapper=args.wrapper)
    state = TrainState(resumed, resumed_optimizer)
    dcp.load({"train": state}, checkpoint_id=path[0])
    say(f"resumed at step {state.step}")
    resumed_run = []
    for step in range(state.step, args.steps):
        resumed_run.append(train_step(resumed, resumed_optimizer, *batch(step, dp_rank, device)))
        say(f"resumed step {step}: loss {resumed_run[-1]:.6f}")

    dist.barrier()  # every rank is done with the checkpoint before rank 0 removes a temporary one
    dist.destroy_process_group()  # after the barrier: no rank exits while another still talks
    # The losses are means over all ranks: every rank takes the same exit.
    expected = first_run[args.save_at :]
    if state.step != args.save_at or len(resumed_run) != len(expected):
        say(f"FAILED: the checkpoint resumed at step {state.step}, not {args.save_at}")
        return 1
    # Exact on CPU; a GPU may sum in another order.
    exact = device.type == "cpu"
    for step, (got, want) in enumerate(zip(resumed_run, expected, strict=True), args.save_at):
        if not (torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5, atol=0)):
            say(f"FAILED: the resumed run's step {step} gives loss {got:.6f}, the first run's {want:.6f}")
            return 1
    say(f"OK: resumed at step {args.save_at}, it gives the first run's losses (steps {args.save_at}-{args.steps - 1}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
