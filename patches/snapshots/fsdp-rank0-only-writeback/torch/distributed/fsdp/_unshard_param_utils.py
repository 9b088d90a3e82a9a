# mypy: allow-untyped-defs
import contextlib
import functools
import warnings
from collections.abc import Generator
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


# NOTE: Writeback from rank 0 (``writeback=True, rank0_only=True``). The
# source is global rank 0. The ranks run the same collectives in the same
# order, even when one fails. Each agreement is one all-reduce of the same
# flags (see ``agree()``), so that a rank that fails after one, and agrees
# upon exit, meets the others' next one; once one says a rank failed, no rank
# agrees again.
# - Entry, per state: each rank does what may fail (the source allocates the
#   unsharded parameter; ``NO_SHARD``: copies it, to restore on failure), then
#   the ranks agree. Then, if any rank needs to unshard (no rank decides
#   alone), the shards are gathered to the source only, which prepares the
#   body.
# - Exit, once all states exited (each, with ``offload_to_cpu`` on an
#   accelerator): each rank allocates what it receives into, then the ranks
#   agree. If none failed, the source scatters the parameters of each state.
#   Else only ``NO_SHARD``'s parameter moves: the source broadcasts its values
#   from before. Then each state frees its unsharded copy.


def _run_all(fns) -> None:
    """Runs each of ``fns``, also after one raised; then raises the first error."""
    error: Exception | None = None
    for fn in fns:
        try:
            fn()
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


class _Rank0Writeback:
    """What the FSDP states of one ``summon_full_params()`` call share."""

    def __init__(self) -> None:
        self.groups, self.device = (), None  # of the agreements: the first state's
        self.ok, self.failed = True, False  # this rank so far; a rank, as agreed
        self.states: list[_Rank0State] = []  # exited, not yet written back

    def agree(self, gather=False) -> bool:
        """Returns whether any rank needs to unshard (see the NOTE)."""
        flags = [not self.ok, gather]
        result = torch.tensor(flags, dtype=torch.int32, device=self.device)
        for group in self.groups:  # for hybrid sharding, in the replica, then across
            dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
        failed, any_gather = result.tolist()
        self.failed = bool(failed)
        if self.failed and self.ok:
            raise RuntimeError(
                "summon_full_params(writeback=True, rank0_only=True) failed on "
                "another rank (see its error): nothing was written back"
            )
        return bool(any_gather)

    def finish(self) -> None:
        """Writes back (if every rank agrees) and frees the states that exited."""
        states, self.states = self.states, []
        if not states:
            return
        try:
            for s in states:
                s.prepare_exit()
        except Exception:
            self.ok = False
            raise
        finally:
            try:
                if not self.failed:
                    self.agree()
            finally:
                write = not self.failed
                _run_all(functools.partial(s.write_back, write) for s in states)
                _run_all(s.free for s in states)


class _Rank0State:
    """A state's part of a call: its unsharded copies on the source, its moves."""

    def __init__(self, state: _FSDPState, handle: FlatParamHandle, groups: tuple):
        self.state, self.handle = state, handle
        self.replicate_group = groups[1] if len(groups) > 1 else None
        self.is_src = all(dist.get_rank(g) == 0 for g in groups)
        self.sharded = handle.uses_sharded_strategy
        self.gather = handle.needs_unshard()
        self.before = self.buffer = None  # buffer: on the device, for CPUOffload

    @torch.no_grad()
    def allocate(self) -> None:
        """What may fail before the entry agreement (see the NOTE)."""
        handle, flat_param = self.handle, self.handle.flat_param
        _reset_flat_param_grad_info_if_needed(handle)
        handle.pre_unshard()
        # As `_unshard()`, to consume the events that `_reshard()` records
        event = self.state._free_event_queue.dequeue_if_needed()
        if self.state.limit_all_gathers and event:
            event.synchronize()
        if self.is_src and self.gather:
            handle._alloc_padded_unsharded_flat_param()
        if self.is_src and not self.sharded:
            self.before = flat_param.detach().clone()

    @torch.no_grad()
    def unshard(self) -> None:
        handle, flat_param = self.handle, self.handle.flat_param
        # As the ranks agreed: also where this rank's is unsharded already
        dst = self.is_src and self.gather
        padded = handle._get_padded_unsharded_flat_param() if dst else None
        if self.gather:
            handle.gather_to_rank0(flat_param.data, padded, self.replicate_group)
        if self.is_src or not self.sharded:
            handle.unshard()  # only switches to the gathered parameter
        handle.post_unshard()

    def prepare_exit(self) -> None:
        """Allocates what this rank receives into, before the exit agreement."""
        local_shard, device = self.handle.flat_param._local_shard, self.handle.device
        if self.sharded and local_shard.device != device:  # CPUOffload
            self.buffer = torch.empty_like(local_shard, device=device)

    @torch.no_grad()
    def write_back(self, write: bool) -> None:
        """The source's writeback; without ``write``, ``NO_SHARD``'s restore."""
        handle, flat_param = self.handle, self.handle.flat_param
        if not self.sharded:
            if not write and self.before is not None:
                flat_param.copy_(self.before)  # the source's values from before
            self._scatter(None, flat_param.data)
        elif write:
            padded = handle._get_padded_unsharded_flat_param() if self.is_src else None
            self._scatter(padded, flat_param._local_shard, self.buffer)

    def _scatter(self, padded, out: torch.Tensor, buffer=None) -> None:
        """Writes the source's ``padded`` to each rank's shard ``out``."""
        buffer = out if buffer is None else buffer
        self.handle.scatter_from_rank0(padded, buffer, self.replicate_group).wait()
        if buffer is not out:
            out.copy_(buffer)

    def free(self) -> None:
        """
        Frees the unsharded copy, every rank's (an early free may have failed).
        """
        try:
            # Even if allocated before (a forward), so no rank keeps a stale copy
            _reshard(self.state, self.handle, self.sharded)
        finally:
            self.handle._training_state = HandleTrainingState.IDLE


@contextlib.contextmanager
def _unshard_fsdp_state_params_from_rank0(
    module: nn.Module,
    state: _FSDPState,
    handle: FlatParamHandle,
    offload_to_cpu: bool,
    call: _Rank0Writeback | None,
) -> Generator:
    """
    ``_unshard_fsdp_state_params()`` for ``writeback=True, rank0_only=True``
    (see the NOTE). Without a ``call`` of other states, it writes back upon exit.
    """
    own_call, call = call is None, call or _Rank0Writeback()
    groups = (state.process_group,)  # for hybrid sharding, then its replicate group
    if state.sharding_strategy in HYBRID_SHARDING_STRATEGIES:
        groups += (state._inter_node_pg,)
    call.groups, call.device = call.groups or groups, call.device or handle.device
    s, flat_param = _Rank0State(state, handle, groups), handle.flat_param
    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS
    try:  # if a rank fails, every rank raises, before any data moved
        try:
            s.allocate()
        except Exception:
            call.ok = False
            raise
        finally:
            s.gather = call.agree(s.gather)
    except BaseException:
        _reshard(state, handle, s.gather)
        handle._training_state = HandleTrainingState.IDLE
        raise
    body_succeeded = False
    try:
        s.unshard()
        if not s.is_src:
            # Free early, even if allocated before (a forward): it would go stale
            _reshard(state, handle, s.sharded)
            yield
        else:
            with contextlib.ExitStack() as stack:
                if offload_to_cpu and not flat_param.is_cpu:
                    stack.enter_context(handle.to_cpu())
                if not state._use_orig_params:
                    stack.enter_context(_unflatten_as_params(state, module))
                yield
        body_succeeded = True
    finally:
        call.ok = call.ok and body_succeeded
        call.states.append(s)
        if own_call or (offload_to_cpu and handle.device.type != "cpu"):
            call.finish()


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


def _validate_unshard_params_args(
    state: _FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """
    Validates the options of ``summon_full_params()``. All combinations are
    supported for every sharding strategy and ``use_orig_params``, except those
    below. With ``NO_SHARD``, changes persist regardless of ``writeback``.
    """
    if writeback and rank0_only:
        # Rank 0 would edit the device copy, and resharding restore the CPU one
        handle = state._handle
        offload = handle and handle._offload_params and handle.device.type != "cpu"
        if offload and not handle.uses_sharded_strategy:
            raise NotImplementedError(
                "writeback=True and rank0_only=True is not supported yet with "
                "NO_SHARD and CPUOffload(offload_params=True) on an accelerator: "
                "use rank0_only=False"
            )
        if with_grads:
            raise NotImplementedError(
                "writeback=True and rank0_only=True is not supported yet"
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
    rank0_writeback: _Rank0Writeback | None = None,
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
            module, state, handle, offload_to_cpu, rank0_writeback
        ):
            yield
        return

    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS

    _reset_flat_param_grad_info_if_needed(handle)
    # Before the parameters move: if it raises, it does on every rank
    if with_grads and handle.uses_sharded_strategy:
        handle.check_grad_dtypes()
    free_unsharded_flat_param = handle.needs_unshard()
    # No need to call `wait_stream()` since we unshard in the computation
    # stream directly
    computation_stream = state._device_handle.current_stream()
    _unshard(state, handle, computation_stream, computation_stream)
    if with_grads:
        _unshard_grads(handle)

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
            if with_grads:  # set back once the parameter is back on its device
                flat_param = handle.flat_param
                stack.callback(setattr, flat_param, "grad", flat_param.grad)
            # Invariant: rank == 0 or !rank0_only
            if offload_to_cpu and handle.uses_sharded_strategy:
                stack.enter_context(handle.to_cpu())
                # NOTE: Since PyTorch enforces that a parameter and its
                # gradients need to match metadata (e.g. device), we must
                # move gradients to CPU *after* we move parameters.
            elif offload_to_cpu and not handle.flat_param.is_cpu:
                # `NO_SHARD` (a CPU copy of the parameter, as for sharding)
                stack.enter_context(handle.to_cpu())
            # NOTE: This assumes 1 `FlatParameter`
            if not state._use_orig_params:
                stack.enter_context(_unflatten_as_params(state, module))
            if with_grads:
                stack.enter_context(handle.unsharded_grad_views(writeback))
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
    rank0_writeback: _Rank0Writeback | None = None,
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
        rank0_writeback=rank0_writeback,
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
    rank0_writeback = _Rank0Writeback() if writeback and rank0_only else None
    with contextlib.ExitStack() as stack:
        if rank0_writeback is not None:
            # Exits last: every state's writeback, once all states exited
            stack.callback(rank0_writeback.finish)
        for state, module in zip(*states_and_modules):
            stack.enter_context(
                _unshard_params_for_summon(
                    module=module,
                    state=state,
                    writeback=writeback,
                    rank0_only=rank0_only,
                    offload_to_cpu=offload_to_cpu,
                    with_grads=with_grads,
                    rank0_writeback=rank0_writeback,
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
