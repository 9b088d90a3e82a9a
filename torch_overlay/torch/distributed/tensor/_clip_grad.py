# mypy: allow-untyped-defs
r"""Gradient norms and clipping of DTensors on several device meshes, or mixed with
plain tensors, for :mod:`torch.nn.utils.clip_grad`.

DTensor ops compute the norm of DTensors on one mesh, but they cannot stack the
norms of DTensors on several meshes (FSDP2 + TP: the TP parameters on the 2-D mesh,
the others on its data parallel mesh) or mix them with plain tensors. Here the norms
of the local shards are reduced instead, with one all-reduce per process group: no
gradient is gathered (a ``Partial`` one is reduced first, as the DTensor norm does), and
the clip coefficient stays a tensor (no host sync).
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.clip_grad import _get_total_norm


__all__: list[str] = []


def _sharded_groups(t: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups over which ``t`` is sharded (its ``Replicate`` dims count
    once); a placement whose norm its local shard cannot give raises."""
    groups = []
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            groups.append(t.device_mesh.get_group(dim))
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"Cannot compute the norm of a DTensor with placement {placement!r} "
                "from its local shard; redistribute it to Shard or Replicate first."
            )
    return tuple(groups)


def _local_norms(
    tensors: list[Tensor], norm_type: float, foreach: bool | None
) -> list[Tensor]:
    r"""The norms of plain tensors and DTensors on any meshes, one per set of process
    groups: their norm is the total norm of ``tensors``, the same on every rank.

    NOTE: The local norms of all DTensors sharded over the same process groups are
    reduced together, in float32 or wider (a sum of p-th powers; the max for ``inf``,
    the min for ``-inf``; a NaN is kept), with one all-reduce per process group,
    whatever the number of tensors or meshes. Plain tensors count once, locally. As
    for any DTensor op, every rank must call this with tensors of the same layouts,
    so every rank raises the same errors before any collective.
    """
    if norm_type == 0:
        raise ValueError(
            "norm_type=0 counts the tensors with a nonzero element, which the local "
            "shards of DTensors on several meshes or with plain tensors cannot count."
        )
    # An empty shard (uneven sharding) contributes the reduction's identity.
    identity = float("inf") if norm_type < 0 else 0.0
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[Tensor]] = {}
    devices: dict[dist.ProcessGroup, set[torch.device]] = {}
    for t in tensors:
        groups: tuple[dist.ProcessGroup, ...] = ()
        if isinstance(t, DTensor):
            if any(p.is_partial() for p in t.placements):
                # A norm is not linear: reduce a Partial DTensor first, as the
                # DTensor norm does on one mesh (a sequence parallel norm's grad).
                t = t.redistribute(
                    placements=[
                        Replicate() if p.is_partial() else p for p in t.placements
                    ]
                )
            groups = _sharded_groups(t)
            t = t.to_local()
            if t.numel() == 0:
                t = t.new_full((1,), identity)
        by_groups.setdefault(groups, []).append(t)
        for group in groups:
            devices.setdefault(group, set()).add(t.device)
    for found in devices.values():
        if len(found) > 1:
            raise ValueError(
                "Cannot reduce the norms of DTensors sharded over one process group "
                f"whose local shards are on different devices "
                f"({', '.join(sorted(map(str, found)))}); move them to one device."
            )
    local = {
        groups: _get_total_norm(local_tensors, norm_type, False, foreach)
        for groups, local_tensors in by_groups.items()
    }
    # The p-th powers of the local norms, summed; or their max for inf, min for -inf.
    power, op = norm_type, dist.ReduceOp.SUM
    if norm_type in (float("inf"), -float("inf")):
        power = 1.0
        op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
    norms = {
        groups: norm.to(torch.promote_types(norm.dtype, torch.float32)).pow(power)
        for groups, norm in local.items()
    }
    # One all-reduce per process group, for the norms of all tensors sharded over it.
    for group in devices:
        keys = [groups for groups in norms if group in groups]
        flat = torch.stack([norms[groups] for groups in keys])
        if op != dist.ReduceOp.SUM:
            # MAX and MIN may drop a NaN: flag each NaN so that every rank keeps it.
            flag = 1.0 if op == dist.ReduceOp.MAX else -1.0
            flat = torch.cat([flat, flat.isnan().to(flat.dtype) * flag])
        dist.all_reduce(flat, op=op, group=group)
        if op != dist.ReduceOp.SUM:
            flat, nan = flat.chunk(2)
            flat = flat.masked_fill(nan != 0, float("nan"))
        norms.update(zip(keys, flat.unbind(), strict=True))
    return [
        norm.pow(1.0 / power).to(local[groups].dtype) for groups, norm in norms.items()
    ]


def _local_grads(
    grads: list[Tensor], total_norm: Tensor
) -> tuple[list[Tensor], Tensor]:
    r"""The local shards of ``grads`` and a plain ``total_norm``, to scale by one
    coefficient, the same on every rank: DTensor ops cannot scale gradients on several
    meshes, or with plain ones, by one coefficient."""
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads], total_norm
