"""Tensor parallel + DDP on a 2-D mesh: train with clip_grad_norm_, save a DCP checkpoint, resume from it.

    torchrun --nproc_per_node 4 examples/tp_ddp_train.py [--tp 2] [--steps 5] [--checkpoint-dir DIR] [--wrapper none]

The ranks form a (dp, tp) mesh. Each block's attention and MLP linears are split over "tp"; the embedding, the
norms and the head stay plain parameters; DDP replicates the model over "dp". After a few steps the model and
optimizer go to a DCP checkpoint and are loaded into fresh ones; the script exits 1 unless the resumed model
gives the saved model's loss and trains like it. NCCL when each local rank has a GPU, else gloo on CPU.
`--wrapper none` trains TP alone (no DDP; as many ranks as --tp): what TP + DDP on one dp rank must train like. On
stock torch (no overlay) it stops at once, in one line, at `torch_overlay.require_active()`; without that line it
would train, then `get_state_dict` raises `KeyError: 3` on every rank.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_overlay

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # Under TP each rank holds HEADS / tp of the heads (its columns of wq, wk, wv): -1 is that local count.
        q, k, v = (w(h).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(mesh, device: torch.device, wrapper: str = "ddp") -> tuple[nn.Module, torch.optim.Optimizer]:
    """TP over mesh["tp"], then DDP over mesh["dp"] (unless ``wrapper`` is "none"), then the optimizer, from the
    wrapped model's parameters."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model().to(device)
    plan = {}
    for i in range(LAYERS):
        plan |= {f"layers.{i}.{name}": ColwiseParallel() for name in ("wq", "wk", "wv", "w1")}
        plan |= {f"layers.{i}.{name}": RowwiseParallel() for name in ("wo", "w2")}
    parallelize_module(model, mesh["tp"], plan)
    if wrapper == "ddp":
        model = DDP(model, device_mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def batch(seed: int, dp_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of arithmetic sequences mod VOCAB and the next token of each (learnable). The tp ranks of one dp
    group must see the same batch; each dp group sees its own."""
    g = torch.Generator().manual_seed(1000 * seed + dp_rank)
    start, stride = torch.randint(VOCAB, (BATCH, 1), generator=g), torch.randint(1, 8, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def losses(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss, and its mean over all ranks (detached; the same number on every rank)."""
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # a sum: gloo has no AVG
    return loss, mean / dist.get_world_size()


@torch.no_grad()
def eval_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return losses(model, tokens, targets)[1]


def train_step(model, optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss, mean = losses(model, tokens, targets)
    loss.backward()
    # The norm of the whole model's gradient, TP shards and plain parameters together, the same on every rank.
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    return mean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel degree (divides the world size)")
    parser.add_argument("--steps", type=int, default=5, help="training steps before the checkpoint")
    parser.add_argument("--checkpoint-dir", help="where DCP writes (default: a temporary directory, removed after)")
    parser.add_argument("--wrapper", choices=("ddp", "none"), default="ddp", help="none: TP alone (dp must be 1)")
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
    alone = ", TP alone (no DDP)" if args.wrapper == "none" else ""
    say(f"{world} ranks on {device.type} ({backend}), mesh dp={world // args.tp} x tp={args.tp}{alone}")

    model, optimizer = build(mesh, device, args.wrapper)
    for step in range(args.steps):
        say(f"step {step}: loss {train_step(model, optimizer, *batch(step, dp_rank, device)):.4f}")

    # Every rank writes into rank 0's directory (a temporary one goes when rank 0 leaves main(); one node only).
    tmp = tempfile.TemporaryDirectory(prefix="tp_ddp_ckpt_") if rank == 0 and not args.checkpoint_dir else None
    path = [args.checkpoint_dir or (tmp and tmp.name)]
    dist.broadcast_object_list(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path[0])
    eval_batch = batch(10_000, dp_rank, device)
    saved_loss = eval_loss(model, *eval_batch)
    say(f"saved to {path[0]}: loss {saved_loss:.6f}")

    # Resume into a fresh model and optimizer: same seed, so only the checkpoint can carry the training over.
    resumed, resumed_optimizer = build(mesh, device, args.wrapper)
    model_sd, optim_sd = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_loss = eval_loss(resumed, *eval_batch)
    say(f"resumed: loss {resumed_loss:.6f}")

    # One more step of each on the same batch: equal losses after it need the optimizer state too.
    next_batch = batch(args.steps, dp_rank, device)
    train_step(model, optimizer, *next_batch)
    train_step(resumed, resumed_optimizer, *next_batch)
    next_saved, next_resumed = eval_loss(model, *eval_batch), eval_loss(resumed, *eval_batch)
    say(f"one more step: loss {next_saved:.6f} (saved model), {next_resumed:.6f} (resumed)")

    dist.barrier()  # every rank is done with the checkpoint before rank 0 removes a temporary one
    dist.destroy_process_group()  # after the barrier: no rank exits while another still talks
    # The losses are means over all ranks: every rank takes the same exit.
    if not torch.equal(resumed_loss, saved_loss):
        say(f"FAILED: the checkpoint did not restore the model: loss {resumed_loss:.6f}, not {saved_loss:.6f}")
        return 1
    if not torch.allclose(next_resumed, next_saved, rtol=1e-5, atol=0):  # GPUs may sum in another order
        say(f"FAILED: the checkpoint did not restore the optimizer: next loss {next_resumed:.6f}, not {next_saved:.6f}")
        return 1
    say("OK: the resumed model gives the saved model's loss, and trains like it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
