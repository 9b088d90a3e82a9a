# mypy: allow-untyped-defs
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel._data_parallel_utils import (
    _flatten_tensor,
    sync_grad_hook,
)


__all__ = []  # type: ignore[var-annotated]


def _get_submodule_n_params(module: nn.Module, path: str):
    """
    Get submodule and the direct path of parameter from the module
    """
    if "." in path:
        path_list = path.split(".")
        parent_module_path = ".".join(path_list[:-1])
        module = module.get_submodule(parent_module_path)
        path = path_list[-1]
    return module, path


# NOTE: DDP reduces plain tensors, while the module keeps its DTensor parameters.
# Each DTensor parameter gets a leaf ``nn.Parameter`` sharing the storage of its
# local tensor, which DDP's reducer holds. During its owner's forward, a DTensor
# view of the leaf shadows the parameter (in ``module.__dict__``), so gradients
# reach the leaf and DDP reduces them in its buckets. Around the leaf's gradient
# accumulation, its ``.grad`` follows the parameter's: before, it starts from the
# parameter's gradient (or none, after ``zero_grad()``); once DDP has finished,
# the parameter's gradient is a DTensor view of the leaf's. Optimizer updates
# reach the leaf through the shared storage.
@dataclass
class _LocalParams:
    """The leaves of a module's DTensor parameters, by parameter and by owner."""

    leaves: dict[nn.Parameter, nn.Parameter] = field(default_factory=dict)
    owners: dict[nn.Module, dict[str, nn.Parameter]] = field(default_factory=dict)
    homes: dict[nn.Parameter, tuple[nn.Module, str]] = field(default_factory=dict)
    """An owner of each leaf and the parameter's name there."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)
    """The DTensor parameters that their leaves replace until ``restore()``."""
    depth: dict[nn.Module, int] = field(default_factory=dict)
    views: dict[tuple[nn.Module, str], tuple[nn.Parameter, int, DTensor]] = field(
        default_factory=dict
    )
    grad_accumulators: list[Any] = field(default_factory=list)
    synced: dict[nn.Parameter, torch.Tensor | None] = field(default_factory=dict)
    """The local tensor of each parameter's gradient as the last backward left it."""
    sync_queued: bool = False

    def slots(self):
        """Each leaf with the DTensor parameter it stands for in each owner."""
        for owner, leaves in self.owners.items():
            for name, leaf in leaves.items():
                param = owner._parameters[name]
                if isinstance(param, DTensor):
                    yield leaf, param

    def restore(self) -> None:
        for owner, name, param in self.swapped:
            owner._parameters[name] = param
        self.swapped.clear()

    def start_grads(self) -> None:
        _start_leaf_grads(self)

    def __getstate__(self) -> dict[str, Any]:
        # Deep copies start without views and accumulators (not copyable).
        return {**self.__dict__, "views": {}, "grad_accumulators": [], "synced": {}}


def _dtensor_view(tensor: torch.Tensor, param: DTensor) -> DTensor:
    spec = param._spec
    return DTensor.from_local(
        tensor, spec.mesh, spec.placements, shape=spec.shape, stride=spec.stride
    )


def _follow(leaf: nn.Parameter, param: DTensor) -> None:
    if not leaf.is_set_to(param._local_tensor):
        # ``to_empty()``, ``load_state_dict(assign=True)`` or ``module.to()``
        # gave the parameter a new local tensor: DDP's leaf follows it.
        leaf.data = param._local_tensor


# NOTE: ``DTensor.from_local`` per parameter and forward is most of the hooks'
# cost, so a view is reused until stale: another leaf or ``requires_grad``, new
# data, or an in-place change of the view. It is built with grad on, so a first
# forward under ``no_grad`` does not break training. Under torch.compile it is
# built in the graph: a cached one would be a graph output.
def _view(state: _LocalParams, owner: nn.Module, name: str, leaf, param) -> DTensor:
    if torch.compiler.is_compiling():
        return _dtensor_view(leaf, param)
    _follow(leaf, param)
    cached = state.views.get((owner, name))
    if cached is not None:
        cached_leaf, version, view = cached
        if (
            cached_leaf is leaf
            and view._version == version
            and view.requires_grad == leaf.requires_grad
            and view._local_tensor.is_set_to(leaf)
        ):
            return view
    with torch.inference_mode(False), torch.enable_grad():
        view = _dtensor_view(leaf, param)
    state.views[(owner, name)] = (leaf, view._version, view)
    return view


def _enter_dtensor_views(state: _LocalParams, module: nn.Module, *_: Any) -> None:
    if state.swapped:  # DDP was built by ``_pre_dp_module_transform`` alone
        state.restore()
    state.depth[module] += 1
    if state.depth[module] == 1:
        for name, leaf in state.owners[module].items():
            param = module._parameters[name]
            if isinstance(param, DTensor):
                module.__dict__[name] = _view(state, module, name, leaf, param)


def _exit_dtensor_views(state: _LocalParams, module: nn.Module, *_: Any) -> None:
    # Always called, also when the forward raised: a view left in place would
    # be used by later forwards unchecked.
    if state.depth[module] > 0:
        state.depth[module] -= 1
        if state.depth[module] == 0:
            for name in state.owners[module]:
                module.__dict__.pop(name, None)


def _sync_param_grads(state: _LocalParams, requeued: bool = False) -> None:
    """End of backward: each parameter's gradient views its leaf's."""
    if not requeued:
        # Queued again, to run after DDP's own end-of-backward callback, which
        # may give the leaves of locally unused parameters their gradients.
        Variable._execution_engine.queue_callback(
            partial(_sync_param_grads, state, requeued=True)
        )
        return
    state.sync_queued = False
    with torch.no_grad():
        for leaf, param in state.slots():
            grad = leaf.grad
            if grad is not None and not (
                isinstance(param.grad, DTensor)
                and param.grad._local_tensor.is_set_to(grad)
            ):
                param.grad = _dtensor_view(grad, param)
            if param.grad is not None:
                state.synced[leaf] = param.grad._local_tensor


def _start_leaf_grad(state: _LocalParams, leaf: nn.Parameter, param: DTensor) -> None:
    """
    The leaf's gradient starts from the parameter's, if that changed since the
    last backward (``zero_grad()``, or a gradient set by hand).
    """
    local = None if param.grad is None else param.grad._local_tensor
    if local is not state.synced.get(leaf):
        _follow(leaf, param)
        leaf.grad = local
        state.synced[leaf] = local


def _start_leaf_grads(state: _LocalParams, *_: Any) -> None:
    # Also the leaves a backward will not reach, whose gradients DDP reads
    # (find_unused_parameters): at the forward, and where DDP's backward starts.
    state.sync_queued = False  # also after a backward that raised
    if not torch.compiler.is_compiling():
        for leaf, param in state.slots():
            if leaf.requires_grad:
                _start_leaf_grad(state, leaf, param)


def _before_accumulate(state: _LocalParams, leaf: nn.Parameter) -> None:
    owner, name = state.homes[leaf]
    _start_leaf_grad(state, leaf, owner._parameters[name])
    if not state.sync_queued:
        state.sync_queued = True
        Variable._execution_engine.queue_callback(partial(_sync_param_grads, state))


def _localize_dtensor(
    module: nn.Module,
    *_: Any,
    ignored_params: set[nn.Parameter] | None = None,
    in_forward: bool = False,
) -> _LocalParams:
    """
    Give each DTensor parameter of ``module`` a leaf ``nn.Parameter`` sharing the
    storage of its local tensor (one per parameter, shared by tied owners), and
    register the hooks that let DDP train the parameter through it (see the
    NOTE above). The leaves, by parameter, are for DDP to reduce.
    ``in_forward``: called in the forward pre-hook of ``module``, whose own
    views then start at once.
    """
    if ignored_params is None:
        ignored_params = set()
    state = _LocalParams()
    leaves = state.leaves
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in ignored_params:
            continue
        t, sharding_info = _flatten_tensor(param)
        if sharding_info is not None:
            if param not in leaves:
                t = nn.Parameter(t, requires_grad=param.requires_grad)
                leaves[param] = t
            owner, attr = _get_submodule_n_params(module, name)
            state.owners.setdefault(owner, {})[attr] = leaves[param]
            state.homes.setdefault(leaves[param], (owner, attr))
    for leaf in leaves.values():
        if leaf.requires_grad:
            leaf.register_hook(sync_grad_hook)
            # DDP's reducer holds the same accumulator, with its own hook.
            acc = leaf.view_as(leaf).grad_fn.next_functions[0][0]
            acc.register_prehook(lambda _, leaf=leaf: _before_accumulate(state, leaf))
            state.grad_accumulators.append(acc)
    if leaves:
        module.register_forward_pre_hook(partial(_start_leaf_grads, state))
    for owner in state.owners:
        state.depth[owner] = 0
        owner.register_forward_pre_hook(partial(_enter_dtensor_views, state))
        owner.register_forward_hook(
            partial(_exit_dtensor_views, state), always_call=True
        )
    if in_forward and module in state.owners:
        _enter_dtensor_views(state, module)
    return state


def _pre_dp_module_transform(module: nn.Module) -> _LocalParams:
    """
    Enable the composability between Tensor Parallelism (TP) and Data
    Parallelism(DP) in PyTorch when using DDP. The module keeps its DTensor
    parameters; DDP reduces the gradients of their local tensors, through leaf
    parameters sharing their storage. Until the returned state's ``restore()``
    (or the first forward), the leaves replace the DTensor parameters in
    ``module``, for DDP to build its reducer from them. During the forward of
    each module owning DTensor parameters, they are DTensor views of the
    leaves, so gradients reach the leaves; after backward, each DTensor
    parameter's ``.grad`` is a DTensor view of its leaf's reduced gradient.

    For now, this API only works with ``DistributedDataParallel``. It will later support
    other DP methods such as FSDP.

    Args:
        module (:class:`nn.Module`):
            Module which has been applied TP on.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch.distributed.tensor.parallel import parallelize_module, PairwiseParallel
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> from torch.distributed.tensor.parallel.ddp import pre_dp_module_transform
        >>>
        >>> # Define the module.
        >>> m = module(...)
        >>> parallelize_module(m, PairwiseParallel())
        >>> m = pre_dp_module_transform(m)
        >>> m = DDP(m)
        >>>
    """

    state = _localize_dtensor(module, None, None)
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in state.leaves:
            owner, attr = _get_submodule_n_params(module, name)
            owner._parameters[attr] = state.leaves[param]
            state.swapped.append((owner, attr, param))
    return state
