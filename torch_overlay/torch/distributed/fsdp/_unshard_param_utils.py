# mypy: allow-untyped-defs
import contextlib
import warnings
from collections.abc import Callable, Generator
from typing import cast

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
from torch.distributed.fsdp._runtime_utils import (
    _lazy_init,
    _reset_flat_param_grad_info_if_needed,
    _reshard,
    _reshard_grads,
    _unshard,
    _unshard_grads,
)
from torch.distributed.utils import _p_assert

from ._flat_param import FlatParamHandle, HandleShardingStrategy


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


def _rank0_writeback_inter_node_pg(
    state: _FSDPState, handle: FlatParamHandle
) -> dist.ProcessGroup | None:
    """
    Returns the process group across replicas for hybrid sharding, over which
    rank 0's replica sends the written-back shards to the other replicas, and
    ``None`` for the other sharding strategies.
    """
    if handle._sharding_strategy in (
        HandleShardingStrategy.HYBRID_SHARD,
        HandleShardingStrategy._HYBRID_SHARD_ZERO2,
    ):
        return state._inter_node_pg
    return None


def _is_rank0_writeback_src(state: _FSDPState, handle: FlatParamHandle) -> bool:
    """
    Returns whether this rank keeps the unsharded parameter for
    ``writeback=True, rank0_only=True``: rank 0 of the process group, and for
    hybrid sharding, of the replica at rank 0 of the inter-node process group
    (global rank 0 for the default process groups). Other ranks' changes could
    not be kept, so they do not see the unsharded parameter.
    """
    inter_node_pg = _rank0_writeback_inter_node_pg(state, handle)
    return state.rank == 0 and (
        inter_node_pg is None or dist.get_rank(inter_node_pg) == 0
    )


class _Rank0WritebackCall:
    """
    What the FSDP states of one ``writeback=True, rank0_only=True``
    ``summon_full_params()`` call share upon exit:

    - Whether the body succeeded on every rank, agreed on once per set of
      process groups instead of once per state: the innermost state exits
      first and sees whether the body raised, and the states exit in the same
      order on every rank.
    - The collectives that write back each state's parameters. They run
      concurrently instead of one after the other, and what must wait for
      them (e.g. freeing rank 0's unsharded parameter, which it is sending)
      runs in :meth:`wait`, once all of them finished. A state may call
      :meth:`wait` early to bound memory (see ``_unshard_fsdp_state_params()``).
    """

    def __init__(self) -> None:
        self._succeeded: dict[tuple[dist.ProcessGroup, ...], bool] = {}
        self._works: list[dist.Work] = []
        self._callbacks: list[Callable[[], None]] = []

    def agree(
        self,
        process_groups: tuple[dist.ProcessGroup, ...],
        body_succeeded: bool,
        device: torch.device,
    ) -> bool:
        if process_groups not in self._succeeded:
            succeeded = torch.tensor(
                [int(body_succeeded)], dtype=torch.int32, device=device
            )
            # After the first all-reduce, every rank of a group holds the same
            # value, so for hybrid sharding the second gives the minimum over
            # all replicas.
            for process_group in process_groups:
                dist.all_reduce(succeeded, op=dist.ReduceOp.MIN, group=process_group)
            self._succeeded[process_groups] = bool(succeeded.item())
        return self._succeeded[process_groups]

    def start(
        self,
        state: _FSDPState,
        handle: FlatParamHandle,
        body_succeeded: bool,
        callback: Callable[[], None],
    ) -> None:
        """
        Starts writing back the handle's parameters from rank 0 (see
        ``_writeback_from_rank0()``), and runs ``callback`` in :meth:`wait`
        once that finished.
        """
        work = _writeback_from_rank0(state, handle, body_succeeded, self)
        if work is not None:
            self._works.append(work)
        self._callbacks.append(callback)

    def wait(self) -> None:
        """
        Waits for all collectives, then runs the callbacks in the order they
        were added, each even if an earlier one raised, and raises the first
        error. If a collective fails, the others are still waited for (their
        buffers must not be freed while in flight), then its error propagates
        and no callback runs: the failed collective's buffers may still be in
        use (e.g. by an NCCL kernel), so they are not freed, as when a
        collective fails elsewhere in FSDP.
        """
        works, self._works = self._works, []
        callbacks, self._callbacks = self._callbacks, []
        error: Exception | None = None
        for work in works:
            try:
                work.wait()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        for callback in callbacks:
            try:
                callback()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error


@torch.no_grad()
def _gather_to_rank0(
    state: _FSDPState,
    handle: FlatParamHandle,
    stream: torch.Stream,
) -> None:
    """
    The ``writeback=True, rank0_only=True`` counterpart of ``_unshard()`` for
    sharded strategies: gathers the flattened parameter into the padded
    unsharded flattened parameter of the writeback source only, instead of
    all-gathering it, so that the other ranks never allocate it. For hybrid
    sharding, only rank 0's replica gathers; the other replicas keep their
    shards.

    Postcondition: If ``_is_rank0_writeback_src()``, the handle uses the
    unsharded flattened parameter; otherwise, the handle's flattened
    parameter is the sharded one on the compute device, to be resharded.
    """
    inter_node_pg = _rank0_writeback_inter_node_pg(state, handle)
    is_src = _is_rank0_writeback_src(state, handle)
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
        if handle.needs_unshard() and (
            inter_node_pg is None or dist.get_rank(inter_node_pg) == 0
        ):
            gather_list = None
            if is_src:
                gather_list = list(
                    handle._alloc_padded_unsharded_flat_param().chunk(handle.world_size)
                )
            dist.gather(
                handle.flat_param.data,
                gather_list,
                group=state.process_group,
                group_dst=0,
            )
        if is_src:
            # The padded unsharded flattened parameter is complete, so this
            # only switches to using it.
            handle.unshard()
        handle.post_unshard()


@torch.no_grad()
def _writeback_from_rank0(
    state: _FSDPState,
    handle: FlatParamHandle,
    body_succeeded: bool,
    rank0_writeback_call: _Rank0WritebackCall,
) -> dist.Work | None:
    """
    For ``writeback=True, rank0_only=True``, starts writing back rank 0's
    unsharded flattened parameter to the local shard of every rank: rank 0
    scatters the padded shards within its shard group (``NO_SHARD``
    broadcasts), and for hybrid sharding, rank 0's replica then broadcasts
    each shard to the other replicas over the inter-node process group. The
    other ranks only receive their shard, never the unsharded parameter.
    Returns the collective in flight, which must finish before rank 0 frees
    its unsharded flattened parameter and before the local shard is used, or
    ``None`` if nothing is in flight.

    Every rank must call this for the same handles in the same order. The
    ranks first agree on whether the context body succeeded everywhere (via
    ``rank0_writeback_call``, once per ``summon_full_params()`` call); if it
    raised on any rank, nothing is written back on any rank, and the local
    shards keep their values from before the context (for ``NO_SHARD``, rank
    0's in-place changes are undone from rank 1's copy).

    Precondition: If ``_is_rank0_writeback_src()``, the handle's padded
    unsharded flattened parameter holds the values to write back.
    """
    flat_param = handle.flat_param
    inter_node_pg = _rank0_writeback_inter_node_pg(state, handle)
    # NOTE: A rank that raised inside the context reaches this point too, so
    # the ranks agree before any collective that moves data to avoid a hang.
    process_groups = (state.process_group,)
    if inter_node_pg is not None:
        process_groups += (inter_node_pg,)
    succeeded = rank0_writeback_call.agree(
        process_groups, body_succeeded, handle.device
    )
    if not handle.uses_sharded_strategy:
        if handle.world_size == 1:
            return None
        # `NO_SHARD` changes rank 0's parameter in place: send it to the other
        # ranks, or undo the changes from rank 1's copy if the body raised
        src = 0 if succeeded else 1
        local_shard = flat_param.data
    elif succeeded:
        src = 0
        local_shard = flat_param._local_shard  # type: ignore[attr-defined]
    else:
        # Only rank 0's unsharded parameter changed, and it is freed
        return None
    # Collectives run on the compute device (the local shard may be offloaded)
    buffer = (
        local_shard
        if local_shard.device == handle.device
        else torch.empty_like(local_shard, device=handle.device)
    )
    work: dist.Work | None = None
    if not handle.uses_sharded_strategy:
        if buffer is not local_shard and state.rank == src:
            buffer.copy_(local_shard)
        work = dist.broadcast(
            buffer, group=state.process_group, group_src=src, async_op=True
        )
    else:
        if inter_node_pg is None or dist.get_rank(inter_node_pg) == 0:
            scatter_list = None
            if state.rank == 0:
                scatter_list = list(
                    handle._get_padded_unsharded_flat_param().chunk(handle.world_size)
                )
            work = dist.scatter(
                buffer,
                scatter_list,
                group=state.process_group,
                group_src=0,
                async_op=True,
            )
        if inter_node_pg is not None:
            if work is not None:
                work.wait()
            work = dist.broadcast(
                buffer, group=inter_node_pg, group_src=0, async_op=True
            )
    if buffer is not local_shard:
        # Finish now, so that only one handle's shard at a time needs memory
        # on the compute device
        work.wait()  # type: ignore[union-attr]
        local_shard.copy_(buffer)
        return None
    return work


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
    flat_param = handle.flat_param
    if handle._use_orig_params:
        _unshard_grads(handle)
        return
    # NOTE: `unshard_grad()` ends by setting the gradients of the original
    # parameters, which it clears via `_params` and `_shared_params` if all
    # ranks have a `None` gradient; these lists are `None` without
    # `use_orig_params` (a `TypeError`), and there is nothing to clear yet.
    # Empty lists for the call are the least bad option here: the fix belongs
    # in `FlatParamHandle._use_unsharded_grad_views()`, and working around it
    # otherwise means duplicating `unshard_grad()`'s collectives or adding an
    # all-reduce to learn whether any rank has a gradient.
    flat_param._params, flat_param._shared_params = [], []
    try:
        _unshard_grads(handle)
    finally:
        flat_param._params, flat_param._shared_params = None, None


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
    ``True`` and ``False``, except ``with_grads=True`` together with
    ``writeback=True`` and ``rank0_only=True``. With ``NO_SHARD``, changes
    persist regardless of ``writeback``, with ``offload_to_cpu=True`` too.
    """
    if writeback and rank0_only:
        # Rank 0 writes back the parameters only: scattering its unsharded
        # gradient as well is not implemented.
        if with_grads:
            raise NotImplementedError(
                "writeback=True and rank0_only=True do not support "
                "with_grads=True: only rank 0's parameters are written back. "
                "Pass rank0_only=False to modify the gradients, or "
                "with_grads=False."
            )
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu=True and rank0_only=False may result in the "
            "unsharded parameters being redundantly copied to CPU memory for "
            "GPUs sharing the same CPU memory, which risks CPU OOM. We "
            "recommend using offload_to_cpu=True with rank0_only=True.",
            stacklevel=2,
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

    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS
    # NOTE: With `rank0_only=True`, writing back means sending rank 0's
    # unsharded parameter to the other ranks after the context; those ranks
    # free theirs early. The unsharded parameter is then freed on every rank,
    # even if it was allocated before the context (e.g. for the root after
    # forward), so that no rank keeps an unsharded copy that disagrees with the
    # written-back shards.
    rank0_writeback = writeback and rank0_only
    body_succeeded = False
    # Without a call shared with other states, this state waits for its own
    # writeback upon exit
    owns_rank0_writeback_call = rank0_writeback and rank0_writeback_call is None
    if owns_rank0_writeback_call:
        rank0_writeback_call = _Rank0WritebackCall()

    _reset_flat_param_grad_info_if_needed(handle)
    free_unsharded_flat_param = handle.needs_unshard()
    if rank0_writeback and handle.uses_sharded_strategy:
        free_unsharded_flat_param = True
    # No need to call `wait_stream()` since we unshard in the computation
    # stream directly
    computation_stream = state._device_handle.current_stream()
    if rank0_writeback and handle.uses_sharded_strategy:
        _gather_to_rank0(state, handle, computation_stream)
    else:
        _unshard(state, handle, computation_stream, computation_stream)
    if with_grads:
        _unshard_grads_for_summon(handle)

    if rank0_only and (
        state.rank != 0
        or (rank0_writeback and not _is_rank0_writeback_src(state, handle))
    ):
        # Free the unsharded flattened parameter early
        _reshard(state, handle, free_unsharded_flat_param)
        if with_grads:
            _reshard_grads(handle)
        try:
            yield
            body_succeeded = True
        finally:

            def set_idle() -> None:
                handle._training_state = HandleTrainingState.IDLE

            if rank0_writeback:
                # This rank's shard is in use until the writeback finished
                rank0_writeback_call.start(  # type: ignore[union-attr]
                    state, handle, body_succeeded, set_idle
                )
                if owns_rank0_writeback_call:
                    rank0_writeback_call.wait()  # type: ignore[union-attr]
            else:
                set_idle()
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
                body_succeeded = True
            finally:
                stack.close()

                def reshard() -> None:
                    _reshard(state, handle, free_unsharded_flat_param)
                    if with_grads:
                        _reshard_grads(handle)
                    handle._training_state = HandleTrainingState.IDLE

                if rank0_writeback:
                    # Rank 0 frees its unsharded parameter once it is sent
                    rank0_writeback_call.start(  # type: ignore[union-attr]
                        state, handle, body_succeeded, reshard
                    )
                    # With the parameters offloaded, exiting `to_cpu()` allocated
                    # the unsharded parameter on the compute device again: free it
                    # before the next state exits, so that the device holds one
                    # state's at most, as on entry
                    if owns_rank0_writeback_call or (
                        offload_to_cpu and handle.device.type != "cpu"
                    ):
                        rank0_writeback_call.wait()  # type: ignore[union-attr]
                else:
                    if writeback:
                        _writeback_to_local_shard(handle, with_grads)
                    reshard()


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
    changes in the unsharded parameters is written back to every rank upon
    exit: rank 0 scatters each rank's shard (``NO_SHARD`` broadcasts), so the
    other ranks never hold the unsharded parameters; their own changes are
    discarded. If the body raises on any rank, the ranks agree to write back
    nothing: every rank keeps the parameters it had before the context. With
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
    rank0_writeback_call = _Rank0WritebackCall() if writeback and rank0_only else None
    with contextlib.ExitStack() as stack:
        if rank0_writeback_call is not None:
            # Exits last: the states' writebacks run concurrently
            stack.callback(rank0_writeback_call.wait)
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
