# mypy: allow-untyped-defs
import contextlib
import functools
import warnings
from collections.abc import Callable, Generator
from typing import cast, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.fsdp._traversal_utils as traversal_utils
import torch.nn as nn
from torch.distributed.fsdp._common_utils import (
    _FSDPState,
    _get_module_fsdp_state,
    _has_fsdp_params,
    _module_handle,
    HandleTrainingState,
    TrainingState,
)
from torch.distributed.fsdp._init_utils import HYBRID_SHARDING_STRATEGIES
from torch.distributed.fsdp._runtime_utils import (
    _lazy_init,
    _reset_flat_param_grad_info_if_needed,
    _reshard,
    _reshard_grads,
    _unshard,
    _unshard_grads,
)
from torch.distributed.utils import _p_assert

from ._flat_param import FlatParamHandle


FLAT_PARAM = "_flat_param"


@torch.no_grad()
def _writeback_to_local_shard(
    handle: FlatParamHandle,
    writeback_grad: bool,
):
    """
    For the handle, writes back this rank's shard of the unsharded
    flattened parameter to the sharded flattened parameter. If
    ``writeback_grad=True``, then writes back to the sharded gradient as
    well.

    Precondition: The handle's ``FlatParameter`` 's data points to the
    padded unsharded flattened parameter.
    """

    def _get_shard(flat_param_or_grad: torch.Tensor) -> torch.Tensor:
        if handle.uses_sharded_strategy:
            # For sharded strategies, get the *unpadded* shard instead of
            # the *padded* shard to persist user changes to the padding
            # (though FSDP does not explicitly support this)
            shard, _ = FlatParamHandle._get_unpadded_shard(
                flat_param_or_grad,
                handle.rank,
                handle.world_size,
            )
            return shard
        # For `NO_SHARD`, the `flat_param` or its gradient may be modified,
        # so we write it back directly
        return flat_param_or_grad

    param_shard = _get_shard(handle.flat_param)
    handle.flat_param._local_shard[: param_shard.numel()].copy_(param_shard)  # type: ignore[attr-defined]
    if writeback_grad:
        existing_grad = handle.sharded_grad
        if existing_grad is not None:
            if handle.flat_param.grad is None:
                raise AssertionError("Expected handle.flat_param.grad to not be None")
            grad_shard = _get_shard(handle.flat_param.grad)
            existing_grad[: grad_shard.numel()].copy_(grad_shard)


# NOTE: Writeback from rank 0 (``writeback=True, rank0_only=True``).
#
# Only the source holds full parameters (and gradients, with
# ``with_grads=True``): global rank 0, that is rank 0 of the shard group and,
# for hybrid sharding, of the replicate group. For each handle, every rank
# runs the same collectives in the same order:
#
# 1. Entry. Sharded strategies gather the shards into the source's padded
#    unsharded flat parameter (within the source's replica for hybrid
#    sharding); the other ranks keep their shards and never allocate the
#    unsharded one. With ``with_grads=True``, the ranks all-reduce whether any
#    of them has a gradient; if one has, the gradient shards are gathered the
#    same way (a rank without one sends zeros, as ``unshard_grad()`` does, in
#    the gradients' dtype, low precision with ``keep_low_precision_grads``).
#    ``NO_SHARD`` moves nothing: rank 0 edits its parameter in place and a
#    copy of its gradient.
# 2. Exit. The ranks all-reduce whether the body succeeded everywhere, once
#    per ``summon_full_params()`` call and set of groups: a rank whose body
#    raised reaches this point too, so no rank blocks in a collective that
#    another skips. If the body failed anywhere, no data moves, except that
#    ``NO_SHARD`` rank 1 broadcasts its parameter to undo rank 0's in-place
#    changes. Otherwise the source scatters each rank its padded shard of the
#    parameter, then of the gradient (``NO_SHARD`` broadcasts), and for
#    hybrid sharding the source's replica broadcasts each shard to the other
#    replicas. The source zeros the padding first: it lands in the last
#    rank's shard, which must keep zeros there as after sharding. A rank
#    receives into its own shard, in place; a rank without a gradient
#    receives into a new one on its sharded parameter's device, set as its
#    gradient only once that collective finished. A shard off the compute
#    device (``CPUOffload``) receives into a staging shard, copied once
#    received.
# 3. Frees. The collectives of all handles run concurrently
#    (``async_op=True``). Only once all of them finished does the source free
#    its unsharded flat parameter and gradient (which it is sending) and
#    every rank return to ``IDLE`` (``_Rank0DeferredFrees.wait()``); if one
#    failed, nothing is freed, as a failed collective may still read its
#    buffers. With ``offload_to_cpu=True`` on an accelerator, each handle
#    copies its unsharded parameter back to the device upon exit, so it
#    waits and frees it before the next handle exits: what the writeback
#    needs on the device grows with the largest handle, not with the model.
#    The unsharded parameter is freed
#    even if it was allocated before the context (e.g. the root's after a
#    forward), so that no rank keeps a copy that disagrees with its shard.
#
# Limits: (a) as elsewhere in FSDP, a failure on one rank on entry (e.g. out
# of memory allocating the source's unsharded parameter) is not agreed on, so
# the other ranks may block in the next collective. (b) With ``NO_SHARD``, if
# the body raises, the rollback broadcasts rank 1's parameter, including
# whatever rank 1's body changed in it.


class _Rank0WritebackGroups(NamedTuple):
    """The process groups of one FSDP state's writeback from rank 0."""

    # Within a replica: the state's process group
    shard: dist.ProcessGroup
    # Across replicas for hybrid sharding, else `None`
    replicate: dist.ProcessGroup | None
    # Whether this rank is in the source's replica (rank 0 of `replicate`)
    in_src_replica: bool
    # Whether this rank is the source: rank 0 of the source's replica
    is_src: bool

    @property
    def all(self) -> tuple[dist.ProcessGroup, ...]:
        if self.replicate is None:
            return (self.shard,)
        return (self.shard, self.replicate)


def _get_rank0_writeback_groups(state: _FSDPState) -> _Rank0WritebackGroups:
    replicate = (
        state._inter_node_pg
        if state.sharding_strategy in HYBRID_SHARDING_STRATEGIES
        else None
    )
    in_src_replica = replicate is None or dist.get_rank(replicate) == 0
    return _Rank0WritebackGroups(
        shard=state.process_group,
        replicate=replicate,
        in_src_replica=in_src_replica,
        is_src=in_src_replica and state.rank == 0,
    )


def _all_ranks_agree(
    groups: _Rank0WritebackGroups, value: bool, device: torch.device
) -> bool:
    """Returns whether ``value`` is ``True`` on every rank of ``groups``."""
    result = torch.tensor([int(value)], dtype=torch.int32, device=device)
    # After the first all-reduce, every rank of a replica holds the same
    # value, so for hybrid sharding the second gives the minimum over all
    # replicas.
    for group in groups.all:
        dist.all_reduce(result, op=dist.ReduceOp.MIN, group=group)
    return bool(result.item())


class _Rank0BodyAgreement:
    """
    Whether the body succeeded on every rank, agreed on once per
    ``summon_full_params()`` call and set of groups instead of once per
    state: the innermost state exits first and sees whether the body raised,
    and the states exit in the same order on every rank.
    """

    def __init__(self) -> None:
        self._succeeded: dict[tuple[dist.ProcessGroup, ...], bool] = {}

    def agree(
        self,
        groups: _Rank0WritebackGroups,
        body_succeeded: bool,
        device: torch.device,
    ) -> bool:
        if groups.all not in self._succeeded:
            self._succeeded[groups.all] = _all_ranks_agree(
                groups, body_succeeded, device
            )
        return self._succeeded[groups.all]


class _Rank0WritebackWork:
    """
    The collectives in flight that write one tensor back from rank 0, and
    what completes them once they finished: copying a staging shard to its
    destination, setting a gradient that was ``None``.
    """

    def __init__(self) -> None:
        self.works: list[dist.Work] = []
        self.on_done: list[Callable[[], None]] = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for on_done in self.on_done:
            on_done()


def _staging_for(
    handle: FlatParamHandle, local: torch.Tensor, result: _Rank0WritebackWork
) -> torch.Tensor:
    """
    Returns the tensor to receive ``local`` in: itself on the compute device,
    where collectives run, else a staging copy copied to it once received.
    """
    if local.device == handle.device:
        return local
    buffer = torch.empty_like(local, device=handle.device)
    result.on_done.append(lambda: local.copy_(buffer))
    return buffer


@torch.no_grad()
def _scatter_from_rank0(
    groups: _Rank0WritebackGroups,
    handle: FlatParamHandle,
    padded_unsharded: torch.Tensor | None,
    local_shard: torch.Tensor,
) -> _Rank0WritebackWork:
    """
    Starts writing the source's padded unsharded flat tensor (``None`` on the
    other ranks) to ``local_shard`` on every rank of a sharded strategy: a
    scatter within the source's replica, then for hybrid sharding a
    broadcast of each shard to the other replicas.
    """
    result = _Rank0WritebackWork()
    buffer = _staging_for(handle, local_shard, result)
    if groups.in_src_replica:
        scatter_list = None
        if padded_unsharded is not None:
            # The padding goes into the last rank's shard, and must be zeros as
            # after sharding: it is uninitialized after `to_cpu()`, which
            # re-allocates the padded unsharded flat parameter upon exit
            numel = handle.flat_param._unpadded_unsharded_size.numel()  # type: ignore[attr-defined]
            padded_unsharded[numel:].zero_()
            scatter_list = list(padded_unsharded.chunk(handle.world_size))
        work = dist.scatter(
            buffer, scatter_list, group=groups.shard, group_src=0, async_op=True
        )
        if groups.replicate is None:
            result.works.append(work)
            return result
        # The source's replica must hold the shards before sending them on
        work.wait()
    result.works.append(
        dist.broadcast(buffer, group=groups.replicate, group_src=0, async_op=True)
    )
    return result


@torch.no_grad()
def _broadcast_no_shard(
    groups: _Rank0WritebackGroups,
    handle: FlatParamHandle,
    tensor: torch.Tensor,
    src: int,
) -> _Rank0WritebackWork:
    """Starts broadcasting ``NO_SHARD``'s ``tensor`` from rank ``src``."""
    result = _Rank0WritebackWork()
    buffer = _staging_for(handle, tensor, result)
    if buffer is not tensor and handle.rank == src:
        buffer.copy_(tensor)
    result.works.append(
        dist.broadcast(buffer, group=groups.shard, group_src=src, async_op=True)
    )
    return result


class _Rank0DeferredFrees:
    """
    The writebacks in flight of one ``summon_full_params()`` call, and what
    must wait for all of them: freeing the source's unsharded flat
    parameters, which it is sending, and returning to ``IDLE``.
    """

    def __init__(self) -> None:
        self._works: list[_Rank0WritebackWork] = []
        self._frees: list[Callable[[], None]] = []

    def add(self, works: list[_Rank0WritebackWork], free: Callable[[], None]) -> None:
        self._works.extend(works)
        self._frees.append(free)

    def wait(self) -> None:
        """
        Waits for all writebacks, then runs the frees in the order they were
        added, each even if an earlier one raised, and raises the first
        error. If a writeback fails, the others are still waited for, then
        its error propagates and nothing is freed: the failed collective's
        buffers may still be in use (e.g. by an NCCL kernel), as when a
        collective fails elsewhere in FSDP.
        """
        works, self._works = self._works, []
        frees, self._frees = self._frees, []
        error: Exception | None = None
        for work in works:
            try:
                work.wait()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        for free in frees:
            try:
                free()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error


class _Rank0WritebackCall(NamedTuple):
    """What the FSDP states of one ``summon_full_params()`` call share."""

    agreement: _Rank0BodyAgreement
    frees: _Rank0DeferredFrees

    @staticmethod
    def create() -> "_Rank0WritebackCall":
        return _Rank0WritebackCall(_Rank0BodyAgreement(), _Rank0DeferredFrees())


class _Rank0Grads(NamedTuple):
    """The gradient of a handle written back from rank 0, on the source."""

    # Sharded strategies: the padded unsharded gradient gathered on entry
    padded: torch.Tensor | None
    # `NO_SHARD`: the gradient from before the context (the source edits a
    # copy, so that nothing is lost if the body raises)
    saved: torch.Tensor | None


@torch.no_grad()
def _gather_to_rank0(
    state: _FSDPState,
    groups: _Rank0WritebackGroups,
    handle: FlatParamHandle,
    stream: torch.Stream,
) -> None:
    """
    The rank-0 counterpart of ``_unshard()`` for sharded strategies: gathers
    the flat parameter into the source's padded unsharded flat parameter
    instead of all-gathering it.

    Postcondition: The source's handle uses the unsharded flat parameter,
    the other ranks' their sharded one on the compute device.
    """
    with state._device_handle.stream(stream):
        handle.pre_unshard()
    # As in `_unshard()`, so that the free events that `_reshard()` records
    # keep being consumed
    if state.limit_all_gathers:
        event = state._free_event_queue.dequeue_if_needed()
        if event:
            with torch.profiler.record_function(
                "FullyShardedDataParallel.rate_limiter"
            ):
                event.synchronize()
    with state._device_handle.stream(stream):
        if handle.needs_unshard() and groups.in_src_replica:
            gather_list = None
            if groups.is_src:
                padded = handle._alloc_padded_unsharded_flat_param()
                gather_list = list(padded.chunk(handle.world_size))
            dist.gather(
                handle.flat_param.data, gather_list, group=groups.shard, group_dst=0
            )
        if groups.is_src:
            # The padded unsharded flat parameter is complete, so this only
            # switches to using it.
            handle.unshard()
        handle.post_unshard()


@torch.no_grad()
def _gather_grad_to_rank0(
    groups: _Rank0WritebackGroups, handle: FlatParamHandle
) -> _Rank0Grads:
    """
    The rank-0 counterpart of ``unshard_grad()``: for sharded strategies,
    gathers the gradient shards (zeros for a rank without one) into the
    source's padded unsharded gradient. The source's flat parameter's
    gradient is then the unsharded one (``NO_SHARD``: a copy), and its
    sharded gradient is saved for ``reshard_grad()``.

    Precondition: Some rank has a gradient.
    """
    flat_param = handle.flat_param
    grad = flat_param.grad
    if not handle.uses_sharded_strategy:
        if groups.is_src:
            _set_grad(
                flat_param,
                torch.zeros_like(flat_param, dtype=_grad_dtype(handle))
                if grad is None
                else grad.clone(),
            )
            _unshard_grads_for_summon(handle)
        return _Rank0Grads(padded=None, saved=grad)
    padded = None
    if groups.in_src_replica:
        send = grad
        if send is None:
            send = torch.zeros(
                flat_param._sharded_size,  # type: ignore[attr-defined]
                dtype=_grad_dtype(handle),
                device=handle.device,
            )
        gather_list = None
        if groups.is_src:
            padded = torch.empty(
                flat_param._padded_unsharded_size,  # type: ignore[attr-defined]
                dtype=send.dtype,
                device=handle.device,
            )
            gather_list = list(padded.chunk(handle.world_size))
        dist.gather(
            send.to(handle.device), gather_list, group=groups.shard, group_dst=0
        )
    if padded is not None:
        flat_param._saved_grad_shard = grad  # type: ignore[attr-defined]
        unsharded_size = flat_param._unpadded_unsharded_size  # type: ignore[attr-defined]
        flat_param.grad = padded[: unsharded_size.numel()].view(unsharded_size)
        if handle._use_orig_params:
            handle._use_unsharded_grad_views()
    return _Rank0Grads(padded=padded, saved=None)


def _start_rank0_writeback(
    groups: _Rank0WritebackGroups,
    handle: FlatParamHandle,
    succeeded: bool,
    grads: _Rank0Grads | None,
) -> list[_Rank0WritebackWork]:
    """
    Starts writing back the source's parameter, and gradient if ``grads``,
    to every rank (see the NOTE on writeback from rank 0).
    """
    flat_param = handle.flat_param
    if not handle.uses_sharded_strategy:
        if handle.world_size == 1:
            return []
        works = [
            _broadcast_no_shard(groups, handle, flat_param.data, 0 if succeeded else 1)
        ]
        if grads is not None and succeeded:
            grad, on_received = _grad_to_receive(handle, grads)
            works.append(_broadcast_no_shard(groups, handle, grad, 0))
            if on_received is not None:
                works[-1].on_done.append(on_received)
        return works
    if not succeeded:
        # Only the source's unsharded copies changed, and they are freed
        return []
    works = [
        _scatter_from_rank0(
            groups,
            handle,
            handle._get_padded_unsharded_flat_param() if groups.is_src else None,
            flat_param._local_shard,  # type: ignore[attr-defined]
        )
    ]
    if grads is not None:
        grad, on_received = _grad_to_receive(handle, grads)
        works.append(_scatter_from_rank0(groups, handle, grads.padded, grad))
        if on_received is not None:
            # After the staging copy, and only if the gradient's own
            # collective finished
            works[-1].on_done.append(on_received)
    return works


def _grad_dtype(handle: FlatParamHandle) -> torch.dtype:
    """
    The dtype of the handle's sharded gradient after a backward: the low
    precision one with ``keep_low_precision_grads=True``, as
    ``prepare_gradient_for_optim()`` leaves it, else the parameter's.
    """
    if handle._keep_low_precision_grads:
        return handle._fwd_bwd_param_dtype
    return handle.flat_param.dtype


def _grad_to_receive(
    handle: FlatParamHandle, grads: _Rank0Grads
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """
    Returns the gradient that receives the source's: the sharded one (for
    the source, the one saved on entry; ``NO_SHARD``: the edited copy), or if
    there is none, a new one, with what sets it as the gradient once it was
    received. The new one is on the device of the sharded parameter (CPU with
    ``CPUOffload(offload_params=True)``), which a gradient must share.
    """
    flat_param = handle.flat_param
    if grads.padded is not None:
        grad = flat_param._saved_grad_shard  # type: ignore[attr-defined]
    else:
        grad = flat_param.grad
    if grad is not None:
        return grad, None
    grad = torch.zeros(
        flat_param._sharded_size,  # type: ignore[attr-defined]
        dtype=_grad_dtype(handle),
        device=getattr(flat_param, "_cpu_grad", flat_param._local_shard).device,  # type: ignore[attr-defined]
    )
    if grads.padded is None:
        return grad, lambda: _set_grad(flat_param, grad)
    return grad, lambda: setattr(flat_param, "_saved_grad_shard", grad)


def _set_grad(flat_param: torch.Tensor, grad: torch.Tensor) -> None:
    """
    Sets ``grad`` as the gradient of ``flat_param``, in low precision too:
    ``.grad`` refuses another dtype, so this bypasses the check with ``.data``
    as ``prepare_gradient_for_optim()`` does.
    """
    if grad.dtype == flat_param.dtype:
        flat_param.grad = grad
        return
    flat_param.grad = torch.empty_like(grad, dtype=flat_param.dtype)
    flat_param.grad.data = grad


def _finish_rank0_writeback(
    state: _FSDPState,
    groups: _Rank0WritebackGroups,
    handle: FlatParamHandle,
    succeeded: bool,
    grads: _Rank0Grads | None,
) -> None:
    """
    Once every writeback of the call finished: the source frees its
    unsharded flat parameter and gradient, and every rank is ``IDLE`` again.
    """
    flat_param = handle.flat_param
    if groups.is_src:
        if grads is not None and not handle.uses_sharded_strategy:
            # Keep the gradient's identity: the written-back values go into
            # the gradient from before the context, if there was one
            if succeeded and grads.saved is not None:
                grads.saved.copy_(flat_param.grad)  # type: ignore[arg-type]
            if grads.saved is not None or not succeeded:
                flat_param.grad = grads.saved
        _reshard(state, handle, handle.uses_sharded_strategy)
        if grads is not None and handle.uses_sharded_strategy:
            _reshard_grads(handle)
    handle._training_state = HandleTrainingState.IDLE
    if grads is not None and handle._use_orig_params:
        # Point the original parameters' gradients at the written-back one
        handle._use_sharded_grad_views()


@contextlib.contextmanager
def _unflatten_on_rank0(
    state: _FSDPState,
    module: nn.Module,
    handle: FlatParamHandle,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Generator:
    """
    On the source, shows the unsharded parameters (and gradients) as the
    other ``summon_full_params()`` paths do; upon exit, their changes are in
    the unsharded flat parameter (and gradient) on the compute device.
    """
    with contextlib.ExitStack() as stack:
        if offload_to_cpu and not handle.flat_param.is_cpu:
            if handle.uses_sharded_strategy:
                stack.enter_context(handle.to_cpu())
            else:
                stack.enter_context(_no_shard_to_cpu(handle))
        if not state._use_orig_params:
            stack.enter_context(_unflatten_as_params(state, module))
        if with_grads:
            stack.enter_context(_unsharded_grad_views(handle, writeback=True))
        yield


@contextlib.contextmanager
def _unshard_fsdp_state_params_from_rank0(
    module: nn.Module,
    state: _FSDPState,
    handle: FlatParamHandle,
    offload_to_cpu: bool,
    with_grads: bool,
    call: _Rank0WritebackCall | None,
) -> Generator:
    """
    ``_unshard_fsdp_state_params()`` for ``writeback=True, rank0_only=True``
    (see the NOTE on writeback from rank 0). Without a ``call`` shared with
    other states, this state waits for its own writeback upon exit.
    """
    groups = _get_rank0_writeback_groups(state)
    owns_call = call is None
    if call is None:
        call = _Rank0WritebackCall.create()
    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS
    _reset_flat_param_grad_info_if_needed(handle)
    computation_stream = state._device_handle.current_stream()
    if handle.uses_sharded_strategy:
        _gather_to_rank0(state, groups, handle, computation_stream)
    else:
        _unshard(state, handle, computation_stream, computation_stream)
    grads = None
    if with_grads and not _all_ranks_agree(
        groups, handle.flat_param.grad is None, handle.device
    ):
        grads = _gather_grad_to_rank0(groups, handle)

    body_succeeded = False
    try:
        if groups.is_src:
            with _unflatten_on_rank0(
                state, module, handle, offload_to_cpu, grads is not None
            ):
                yield
        else:
            # Free early: this rank's changes are discarded
            _reshard(state, handle, handle.uses_sharded_strategy)
            yield
        body_succeeded = True
    finally:
        succeeded = call.agreement.agree(groups, body_succeeded, handle.device)
        call.frees.add(
            _start_rank0_writeback(groups, handle, succeeded, grads),
            functools.partial(
                _finish_rank0_writeback, state, groups, handle, succeeded, grads
            ),
        )
        if owns_call or (offload_to_cpu and handle.device.type != "cpu"):
            call.frees.wait()


def _deregister_flat_param(state: _FSDPState, module: nn.Module) -> None:
    """
    De-registers the flattened parameter from the wrapped module, hiding it
    from ``nn.Module`` methods.

    We do not use ``del`` because we want ``FLAT_PARAM`` to always be an
    attribute but dynamically change whether it is visible to ``nn.Module``
    methods.
    """
    if _has_fsdp_params(state, module):
        # TODO: figure out the case for the composable APIs.
        cast(nn.Module, module.module)._parameters.pop(FLAT_PARAM, None)


def _register_flat_param(state: _FSDPState, module: nn.Module) -> None:
    """
    Registers the flattened parameter to the wrapped module, making it
    visible to ``nn.Module`` methods.

    We do not use :meth:`nn.Module.register_parameter` because we want
    ``FLAT_PARAM`` to always be an attribute but dynamically change whether
    it is visible to ``nn.Module`` methods.
    """
    handle = _module_handle(state, module)
    if _has_fsdp_params(state, module):
        # TODO: figure out the case for the composable APIs.
        cast(nn.Module, module.module)._parameters[FLAT_PARAM] = handle.flat_param


@contextlib.contextmanager
def _unflatten_as_params(state: _FSDPState, module: nn.Module) -> Generator:
    """
    Assumes that the flattened parameter is unsharded. When in the context,
    de-registers the flattened parameter and unflattens the original
    parameters as ``nn.Parameter`` views into the flattened parameter.
    After the context, re-registers the flattened parameter and restores
    the original parameters as ``Tensor`` views into the flattened
    parameter.
    """
    handle = _module_handle(state, module)
    if not handle:
        yield
    else:
        _deregister_flat_param(state, module)
        try:
            with handle.unflatten_as_params():
                yield
        finally:
            if not handle._use_orig_params:
                _register_flat_param(state, module)


def _unshard_grads_for_summon(handle: FlatParamHandle) -> None:
    """
    Unshards the handle's gradient like ``_unshard_grads()``. Without
    ``use_orig_params``, the original parameters only exist while
    ``_unflatten_as_params()`` registers them, so ``_unsharded_grad_views()``
    sets their gradients then.
    """
    if handle._use_orig_params:
        _unshard_grads(handle)
        return
    # NOTE: `unshard_grad()` ends by setting the gradients of the original
    # parameters, which are not registered yet: without `use_orig_params`,
    # they are plain views into the flat parameter, whose `grad` cannot be
    # set once the flat parameter changed in place (e.g. an optimizer step;
    # "a view and its base ... has been modified inplace"), and if all ranks
    # have a `None` gradient it clears them via `_params`, which is `None`
    # (a `TypeError`). Skipping that step for the call is the least bad
    # option here: the fix belongs in `FlatParamHandle.unshard_grad()`, and
    # working around it otherwise means duplicating its collectives.
    handle._use_unsharded_grad_views = lambda: None  # type: ignore[method-assign]
    try:
        _unshard_grads(handle)
    finally:
        del handle._use_unsharded_grad_views


@contextlib.contextmanager
def _unsharded_grad_views(handle: FlatParamHandle, writeback: bool) -> Generator:
    """
    Assumes that the gradient is unsharded. When in the context, sets the
    original parameters' gradients to views into the unsharded gradient, on
    CPU if the parameters were offloaded to CPU: then the gradient is copied
    to CPU, and back to the compute device upon exit if ``writeback=True`` or
    for ``NO_SHARD`` (whose changes persist regardless of ``writeback``).
    """
    flat_param = handle.flat_param
    grad = flat_param.grad
    if grad is None:
        # No rank has a gradient, and neither has any original parameter
        yield
        return
    offloaded = grad.device != flat_param.device
    if offloaded:
        flat_param.grad = grad.to(flat_param.device)
    if offloaded or not handle._use_orig_params:
        handle._use_unsharded_grad_views()
    try:
        yield
    finally:
        if offloaded:
            if writeback or not handle.uses_sharded_strategy:
                grad.copy_(flat_param.grad)
            # NOTE: The parameter moves back to the compute device after this
            # context, so point its gradient back there already (using `.data`
            # like `_use_unsharded_grad_views()` to bypass the device check).
            flat_param.grad.data = grad


@contextlib.contextmanager
def _no_shard_to_cpu(handle: FlatParamHandle) -> Generator:
    """
    The ``NO_SHARD`` counterpart of ``FlatParamHandle.to_cpu()``: when in the
    context, the flattened parameter is a CPU copy of the one on the compute
    device, which gets the CPU copy's values upon exit (with ``NO_SHARD``,
    changes persist regardless of ``writeback``).
    """
    flat_param = handle.flat_param
    device_flat_param = flat_param.data
    handle.flat_param_to(torch.device("cpu"))
    try:
        yield
    finally:
        device_flat_param.copy_(flat_param.data)
        flat_param.data = device_flat_param
        handle._use_unsharded_views(as_params=handle._use_orig_params)


def _validate_unshard_params_args(
    state: _FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """
    Validates the options of ``summon_full_params()``. All combinations of
    ``writeback``, ``rank0_only``, ``offload_to_cpu`` and ``with_grads`` are
    supported for every sharding strategy and for ``use_orig_params`` both
    ``True`` and ``False``. With ``NO_SHARD``, changes persist regardless of
    ``writeback``, with ``offload_to_cpu=True`` too.
    """
    if writeback and rank0_only:
        _validate_rank0_writeback(state)
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu=True and rank0_only=False may result in the "
            "unsharded parameters being redundantly copied to CPU memory for "
            "GPUs sharing the same CPU memory, which risks CPU OOM. We "
            "recommend using offload_to_cpu=True with rank0_only=True.",
            stacklevel=2,
        )


def _validate_rank0_writeback(state: _FSDPState) -> None:
    """
    Raises for what ``writeback=True, rank0_only=True`` does not support,
    before any collective, on every rank (the configuration is the same on
    every rank).
    """
    handle = state._handle
    if (
        handle is not None
        and not handle.uses_sharded_strategy
        and handle._offload_params
        and handle.device.type != "cpu"
    ):
        # Rank 0 edits the copy on the compute device, and resharding would
        # restore its stale CPU copy
        raise NotImplementedError(
            "writeback=True and rank0_only=True do not support NO_SHARD with "
            "CPUOffload(offload_params=True) on an accelerator: rank 0's "
            "changes would not persist on rank 0. Use a sharded strategy, or "
            "rank0_only=False."
        )


@contextlib.contextmanager
def _unshard_fsdp_state_params(
    module: nn.Module,
    state: _FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
    rank0_writeback_call: _Rank0WritebackCall | None = None,
):
    """
    This unshards the parameters for a single FSDP state ``state`` that
    corresponds to ``module``.
    """
    _validate_unshard_params_args(
        state, writeback, rank0_only, offload_to_cpu, with_grads
    )
    state._device_handle.synchronize()
    # If handles are shared by other module(s), the handle may be already unsharded.
    maybe_handle = _module_handle(state, module)
    handle = None
    if (
        maybe_handle
        and maybe_handle._training_state != HandleTrainingState.SUMMON_FULL_PARAMS
    ):
        handle = maybe_handle
    if not handle:
        yield
        return

    if handle._training_state != HandleTrainingState.IDLE:
        raise AssertionError(
            f"Expects the handle training to be IDLE but got {handle._training_state}"
        )

    if writeback and rank0_only:
        with _unshard_fsdp_state_params_from_rank0(
            module, state, handle, offload_to_cpu, with_grads, rank0_writeback_call
        ):
            yield
        return

    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS

    _reset_flat_param_grad_info_if_needed(handle)
    free_unsharded_flat_param = handle.needs_unshard()
    # No need to call `wait_stream()` since we unshard in the computation
    # stream directly
    computation_stream = state._device_handle.current_stream()
    _unshard(state, handle, computation_stream, computation_stream)
    if with_grads:
        _unshard_grads_for_summon(handle)

    if rank0_only and state.rank != 0:
        # Free the unsharded flattened parameter early
        _reshard(state, handle, free_unsharded_flat_param)
        if with_grads:
            _reshard_grads(handle)
        try:
            yield
        finally:
            handle._training_state = HandleTrainingState.IDLE
    else:
        # Unflatten the unsharded flattened parameters
        with contextlib.ExitStack() as stack:
            # Invariant: rank == 0 or !rank0_only
            # NOTE: On a CPU compute device the unsharded parameter is already in
            # CPU memory, and `to_cpu()` would free it instead of copying it.
            if (
                offload_to_cpu
                and handle.uses_sharded_strategy
                and handle.flat_param.device.type != "cpu"
            ):
                stack.enter_context(handle.to_cpu())
                # NOTE: Since PyTorch enforces that a parameter and its
                # gradients need to match metadata (e.g. device), we must
                # move gradients to CPU *after* we move parameters.
            elif offload_to_cpu and not handle.flat_param.is_cpu:
                # `NO_SHARD` (a CPU copy of the parameter, as for sharding)
                stack.enter_context(_no_shard_to_cpu(handle))
            # NOTE: This assumes 1 `FlatParameter`
            if not state._use_orig_params:
                stack.enter_context(_unflatten_as_params(state, module))
            if with_grads:
                stack.enter_context(_unsharded_grad_views(handle, writeback))
            try:
                yield
            finally:
                stack.close()
                if writeback:
                    _writeback_to_local_shard(handle, with_grads)
                _reshard(state, handle, free_unsharded_flat_param)
                if with_grads:
                    _reshard_grads(handle)
                handle._training_state = HandleTrainingState.IDLE


@contextlib.contextmanager
def _unshard_params_for_summon(
    module: nn.Module,
    state: _FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
    rank0_writeback_call: _Rank0WritebackCall | None = None,
):
    _validate_unshard_params_args(
        state, writeback, rank0_only, offload_to_cpu, with_grads
    )
    _lazy_init(state, module)
    if state.training_state == TrainingState.FORWARD_BACKWARD:
        raise AssertionError(
            "Cannot manually unshard parameters during forward/backward"
        )
    elif state.training_state == TrainingState.SUMMON_FULL_PARAMS:
        raise AssertionError(
            "Cannot manually unshard parameters when already unsharding parameters"
        )
    with _unshard_fsdp_state_params(
        module=module,
        state=state,
        writeback=writeback,
        rank0_only=rank0_only,
        offload_to_cpu=offload_to_cpu,
        with_grads=with_grads,
        rank0_writeback_call=rank0_writeback_call,
    ):
        try:
            state.training_state = TrainingState.SUMMON_FULL_PARAMS
            yield
        finally:
            state.training_state = TrainingState.IDLE


@contextlib.contextmanager
def _unshard_params(
    module: nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
):
    """
    This unshards FSDP-managed parameters for all modules with FSDP applied in
    the module tree rooted at ``module``.

    With ``writeback=True`` and ``rank0_only=True``, what rank 0 (for hybrid
    sharding, rank 0 of the first replica, which is global rank 0 by default)
    changes in the unsharded parameters, and with ``with_grads=True`` in their
    gradients, is written back to every rank upon exit: rank 0 scatters each
    rank's shard (``NO_SHARD`` broadcasts), so the other ranks never hold the
    unsharded parameters; their own changes are discarded. If the body raises on any rank, the ranks agree to write back
    nothing: every rank keeps the parameters it had before the context
    (with ``NO_SHARD``, rank 1's, including what its body changed). A
    failure on one rank on entry (e.g. out of memory on rank 0) is not
    agreed on, as elsewhere in FSDP: the other ranks may block. With
    ``rank0_only=False``, each rank writes back its shard of its unsharded
    parameters upon exit, whether the body raised or not.
    """
    if not recurse:
        optional_state = _get_module_fsdp_state(module)
        if optional_state is None:
            with contextlib.nullcontext():
                yield
            return
        states_and_modules = ([optional_state], [module])
    else:
        states_and_modules = traversal_utils._get_fsdp_states_with_modules(module)
    rank0_writeback_call = None
    if writeback and rank0_only:
        for state in states_and_modules[0]:
            _validate_rank0_writeback(state)
        rank0_writeback_call = _Rank0WritebackCall.create()
    with contextlib.ExitStack() as stack:
        if rank0_writeback_call is not None:
            # Exits last: the states' writebacks run concurrently
            stack.callback(rank0_writeback_call.frees.wait)
        for state, module in zip(*states_and_modules):
            stack.enter_context(
                _unshard_params_for_summon(
                    module=module,
                    state=state,
                    writeback=writeback,
                    rank0_only=rank0_only,
                    offload_to_cpu=offload_to_cpu,
                    with_grads=with_grads,
                    rank0_writeback_call=rank0_writeback_call,
                )
            )
        yield


def _deregister_orig_params(state: _FSDPState, module: nn.Module) -> None:
    """
    Deregisters the original parameters; registers the ``FlatParameter``.
    """
    handle = _module_handle(state, module)
    if not handle:
        return
    _p_assert(
        handle._use_orig_params,
        f"Inconsistent `_use_orig_params` -- FSDP: {state._use_orig_params} "
        f"handle: {handle._use_orig_params}",
    )
    handle._deregister_orig_params()
    _register_flat_param(state, module)


def _register_orig_params(state: _FSDPState, module: nn.Module) -> None:
    """
    Deregisters the ``FlatParameter``; registers the original parameters.
    """
    handle = _module_handle(state, module)
    if not handle:
        return
    _deregister_flat_param(state, module)
    if handle.is_sharded(handle.flat_param):
        handle._use_sharded_views()
        handle._use_sharded_grad_views()
    else:
        handle._use_unsharded_views(as_params=True)
