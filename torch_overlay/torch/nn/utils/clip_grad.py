# mypy: allow-untyped-decorators
# mypy: allow-untyped-defs
import functools
import sys
import types
import typing
import warnings
from collections.abc import Callable
from typing import cast, TypeAlias, TypeVar
from typing_extensions import deprecated, ParamSpec

import torch
from torch import Tensor
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)


__all__: list[str] = [
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
]


_tensor_or_tensors: TypeAlias = torch.Tensor | typing.Iterable[torch.Tensor]  # noqa: PYI042

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _no_grad(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """
    This wrapper is needed to avoid a circular import when using @torch.no_grad on the exposed functions
    clip_grad_norm_ and clip_grad_value_ themselves.
    """

    def _no_grad_wrapper(*args, **kwargs):
        with torch.no_grad():
            return func(*args, **kwargs)

    functools.update_wrapper(_no_grad_wrapper, func)
    # pyrefly: ignore [bad-return]
    return _no_grad_wrapper


def _dtensor_type() -> type | None:
    # DTensors exist only once their module is imported; plain tensors never import it.
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _spans_meshes(tensors: list[Tensor]) -> bool:
    r"""Whether ``tensors`` mix DTensors with plain tensors or span several meshes.

    DTensor ops compute the norm of DTensors on one mesh (the result is a DTensor),
    but they cannot stack norms from several meshes or mix DTensors with plain
    tensors: such tensors take :func:`_norms_over_meshes` instead.
    """
    DTensor = _dtensor_type()
    if DTensor is None:
        return False
    meshes = {t.device_mesh for t in tensors if isinstance(t, DTensor)}
    return len(meshes) > 1 or (
        len(meshes) == 1 and not all(isinstance(t, DTensor) for t in tensors)
    )


def _norms_over_meshes(
    tensors: list[Tensor], norm_type: float, foreach: bool | None
) -> list[Tensor]:
    r"""Compute the norms of plain tensors and DTensors on any meshes, one per set of
    process groups their local shards are reduced over: their norm is the total.

    NOTE: The norm of a DTensor is computed from its local shard. The local norms of
    all DTensors sharded over the same process groups are reduced together, in
    float32 or wider (a sum of p-th powers; the max for ``inf``, the min for
    ``-inf``), with one all-reduce per process group, whatever the number of
    tensors or meshes: no gradient is gathered, and FSDP2 + TP (the TP parameters on
    a 2-D mesh, the others on its data parallel mesh) takes two all-reduces.
    ``Replicate`` mesh dimensions and plain tensors count once, locally. As for any
    DTensor op, every rank must call this with tensors of the same layouts.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if norm_type == 0:
        raise ValueError(
            "norm_type=0 counts the tensors with a nonzero element, which the local "
            "shards of DTensors on several meshes or with plain tensors cannot count."
        )
    # An empty shard (uneven sharding) contributes the reduction's identity.
    identity = float("inf") if norm_type < 0 else 0.0
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[Tensor]] = {}
    for t in tensors:
        groups = []
        if isinstance(t, DTensor):
            for dim, placement in enumerate(t.placements):
                if isinstance(placement, (Shard, _StridedShard)):
                    groups.append(t.device_mesh.get_group(dim))
                elif not isinstance(placement, Replicate):
                    raise ValueError(
                        f"Cannot compute the norm of a DTensor with placement "
                        f"{placement!r} from its local shard; redistribute it to "
                        "Shard or Replicate first."
                    )
            t = t.to_local()
            if t.numel() == 0:
                t = t.new_full((1,), identity)
        by_groups.setdefault(tuple(groups), []).append(t)
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
    for group in dict.fromkeys(group for groups in norms for group in groups):
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


@_no_grad
def _get_total_norm(
    tensors: _tensor_or_tensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    r"""Compute the norm of an iterable of tensors.

    The norm is computed over the norms of the individual tensors, as if the norms of
    the individual tensors were concatenated into a single vector.

    Args:
        tensors (Iterable[Tensor] or Tensor): an iterable of Tensors or a
            single Tensor that will be normalized
        norm_type (float): type of the used p-norm. Can be ``'inf'`` for
            infinity norm.
        error_if_nonfinite (bool): if True, an error is thrown if the total
            norm of :attr:`tensors` is ``nan``, ``inf``, or ``-inf``.
            Default: ``False``
        foreach (bool): use the faster foreach-based implementation.
            If ``None``, use the foreach implementation for CUDA and CPU native tensors and silently
            fall back to the slow implementation for other device types.
            Default: ``None``

    Returns:
        Total norm of the tensors (viewed as a single vector).

    DTensors count as the tensors they are shards of. On several device meshes or
    with plain tensors, the norms of their local shards are reduced over the process
    groups they are sharded over (so every rank of those must call this), and the
    result is a plain tensor; DTensors on one mesh give a DTensor.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    else:
        tensors = list(tensors)
    norm_type = float(norm_type)
    if len(tensors) == 0:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    if _spans_meshes(tensors):
        # The norms of the local shards, reduced over their meshes, stand for them
        tensors = _norms_over_meshes(tensors, norm_type, foreach)
    grouped_tensors: dict[
        tuple[torch.device, torch.dtype], tuple[list[list[Tensor]], list[int]]
    ] = _group_tensors_by_device_and_dtype(  # pyrefly: ignore [bad-assignment]
        [tensors]  # type: ignore[list-item]
    )  # type: ignore[assignment]

    norms: list[Tensor] = []
    for (device, _), ([device_tensors], _) in grouped_tensors.items():
        if (foreach is None and _has_foreach_support(device_tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            norms.extend(torch._foreach_norm(device_tensors, norm_type))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            norms.extend(
                [torch.linalg.vector_norm(g, norm_type) for g in device_tensors]
            )

    total_norm = torch.linalg.vector_norm(
        torch.stack([norm.to(first_device) for norm in norms]), norm_type
    )

    if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return total_norm


@_no_grad
def _clip_grads_with_norm_(
    parameters: _tensor_or_tensors,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    r"""Scale the gradients of an iterable of parameters given a pre-calculated total norm and desired max norm.

    The gradients will be scaled by the following calculation

    .. math::
        grad = grad * \min(\frac{max\_norm}{total\_norm + 1e-6}, 1)

    Gradients are modified in-place.

    Note: The scale coefficient is clamped to a maximum of 1.0 to prevent gradient amplification.
    This ensures that gradients are only scaled down when the total norm exceeds max_norm.

    This function is equivalent to :func:`torch.nn.utils.clip_grad_norm_` with a pre-calculated
    total norm.

    Args:
        parameters (Iterable[Tensor] or Tensor): an iterable of Tensors or a
            single Tensor that will have gradients normalized
        max_norm (float): max norm of the gradients
        total_norm (Tensor): total norm of the gradients to use for clipping
        foreach (bool): use the faster foreach-based implementation.
            If ``None``, use the foreach implementation for CUDA and CPU native tensors and silently
            fall back to the slow implementation for other device types.
            Default: ``None``

    Returns:
        None
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    if len(grads) == 0:
        return
    if _spans_meshes([*grads, total_norm]):
        # DTensor ops cannot scale gradients on several meshes, or with plain ones,
        # by one coefficient: scale the local shards by a plain one, the same on
        # every rank.
        DTensor = _dtensor_type()
        if isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    grouped_grads: dict[
        tuple[torch.device, torch.dtype], tuple[list[list[Tensor]], list[int]]
    ] = _group_tensors_by_device_and_dtype([grads])  # type: ignore[assignment]

    clip_coef = max_norm / (total_norm + 1e-6)
    # Note: multiplying by the clamped coef is redundant when the coef is clamped to 1, but doing so
    # avoids a `if clip_coef < 1:` conditional which can require a CPU <=> device synchronization
    # when the gradients do not reside in CPU memory.
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for (device, _), ([device_grads], _) in grouped_grads.items():
        if (foreach is None and _has_foreach_support(device_grads, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            torch._foreach_mul_(device_grads, clip_coef_clamped.to(device))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            clip_coef_clamped_device = clip_coef_clamped.to(device)
            for g in device_grads:
                g.mul_(clip_coef_clamped_device)


def _grad_as_dtensor(param: Tensor) -> Tensor:
    r"""Return ``param.grad``, as a DTensor if ``param`` is the local shard of one.

    ``DistributedDataParallel`` and ``replicate`` with a ``device_mesh`` train each
    DTensor parameter of a tensor parallel model as a plain parameter, its local
    shard, which carries the DTensor's spec as ``_st_info``. Its gradient counts as
    the DTensor gradient it is a shard of (a norm of the local shards alone differs
    from rank to rank); the view is zero-copy.
    """
    spec = getattr(param, "_st_info", None)
    if spec is None:
        return param.grad
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        param.grad,
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=spec.shape,
        stride=spec.stride,
    )


@_no_grad
def clip_grad_norm_(
    parameters: _tensor_or_tensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    r"""Clip the gradient norm of an iterable of parameters.

    The norm is computed over the norms of the individual gradients of all parameters,
    as if the norms of the individual gradients were concatenated into a single vector.
    Gradients are modified in-place.

    This function is equivalent to :func:`torch.nn.utils.get_total_norm` followed by
    :func:`torch.nn.utils.clip_grads_with_norm_` with the ``total_norm`` returned by ``get_total_norm``.
    The local shards of tensor parallel parameters that ``DistributedDataParallel``
    or ``replicate`` with a ``device_mesh`` train carry their DTensor's spec as
    ``_st_info``; their gradients count as the DTensor gradients they are shards of.
    (Pass ``get_total_norm`` DTensor views of them, ``DTensor.from_local``.)

    Args:
        parameters (Iterable[Tensor] or Tensor): an iterable of Tensors or a
            single Tensor that will have gradients normalized
        max_norm (float): max norm of the gradients
        norm_type (float, optional): type of the used p-norm. Can be ``'inf'`` for
            infinity norm. Default: 2.0
        error_if_nonfinite (bool, optional): if True, an error is thrown if the total
            norm of the gradients from :attr:`parameters` is ``nan``,
            ``inf``, or ``-inf``. Default: False
        foreach (bool, optional): use the faster foreach-based implementation.
            If ``None``, use the foreach implementation for CUDA and CPU native tensors and silently
            fall back to the slow implementation for other device types.
            Default: ``None``

    Returns:
        Total norm of the parameter gradients (viewed as a single vector).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        # prevent generators from being exhausted
        parameters = list(parameters)
        if is_generator and len(parameters) == 0:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=3,
            )
    grads = [_grad_as_dtensor(p) for p in parameters if p.grad is not None]
    total_norm = _get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


@deprecated(
    "`torch.nn.utils.clip_grad_norm` is now deprecated "
    "in favor of `torch.nn.utils.clip_grad_norm_`.",
    category=FutureWarning,
)
def clip_grad_norm(
    parameters: _tensor_or_tensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    r"""Clip the gradient norm of an iterable of parameters.

    .. warning::
        This method is now deprecated in favor of
        :func:`torch.nn.utils.clip_grad_norm_`.
    """
    return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


@_no_grad
def clip_grad_value_(
    parameters: _tensor_or_tensors,
    clip_value: float,
    foreach: bool | None = None,
) -> None:
    r"""Clip the gradients of an iterable of parameters at specified value.

    Gradients are modified in-place.

    Args:
        parameters (Iterable[Tensor] or Tensor): an iterable of Tensors or a
            single Tensor that will have gradients normalized
        clip_value (float): maximum allowed value of the gradients.
            The gradients are clipped in the range
            :math:`\left[\text{-clip\_value}, \text{clip\_value}\right]`
        foreach (bool, optional): use the faster foreach-based implementation
            If ``None``, use the foreach implementation for CUDA and CPU native tensors and
            silently fall back to the slow implementation for other device types.
            Default: ``None``
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_value = float(clip_value)

    grads = [p.grad for p in parameters if p.grad is not None]
    # pyrefly: ignore [bad-argument-type]
    grouped_grads = _group_tensors_by_device_and_dtype([grads])

    for (device, _), ([grads], _) in grouped_grads.items():
        if (
            foreach is None
            and _has_foreach_support(cast(list[Tensor], grads), device=device)
        ) or (foreach and _device_has_foreach_support(device)):
            torch._foreach_clamp_min_(cast(list[Tensor], grads), -clip_value)
            torch._foreach_clamp_max_(cast(list[Tensor], grads), clip_value)
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            for grad in grads:
                cast(Tensor, grad).clamp_(min=-clip_value, max=clip_value)
