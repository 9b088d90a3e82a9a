# mypy: allow-untyped-defs
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.parallel._data_parallel_utils import (
    _flatten_tensor,
    sync_grad_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook


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


# Each module owning localized DTensor parameters keeps its views here, and each
# replaced DTensor parameter is marked (see ``_check_optimizer_params``).
_VIEWS_ATTR = "_dp_dtensor_param_views"
_REPLACED_ATTR = "_replaced_by_dp_local_param"
_optimizer_check_handle = None


@dataclass
class _DTensorParamViews:
    """
    The localized DTensor parameters of one module, by name, with their global
    specs (a deep copy of a parameter has no ``_st_info``). During the module's
    forward, ``module.__dict__[name]`` shadows the local ``nn.Parameter`` with a
    DTensor view of it, so the forward computes on DTensors and gradients flow
    to the local shard. ``depth`` counts re-entries; ``cache``: see ``_view``.
    """

    specs: dict[str, DTensorSpec]
    depth: int = 0
    cache: dict[str, tuple[nn.Parameter, int, DTensor]] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        # Deep copies and pickles start without views (they are not leaves).
        return {**self.__dict__, "depth": 0, "cache": {}}


def _dtensor_view(tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
    return DTensor.from_local(
        tensor, spec.mesh, spec.placements, shape=spec.shape, stride=spec.stride
    )


# NOTE: ``DTensor.from_local`` per parameter and forward is most of the hooks'
# cost, so a view is reused until stale: another parameter, ``requires_grad`` or
# data (``module.to()``), or an in-place change of the view. It is built with
# grad on, so a first forward under ``no_grad`` does not break training. Under
# torch.compile it is built in the graph: a cached one would be a graph output.
def _view(views: _DTensorParamViews, name: str, local: nn.Parameter) -> DTensor:
    if torch.compiler.is_compiling():
        return _dtensor_view(local, views.specs[name])
    cached = views.cache.get(name)
    if cached is not None:
        param, version, view = cached
        if (
            param is local
            and view._version == version
            and view.requires_grad == local.requires_grad
            and view._local_tensor.is_set_to(local)
        ):
            return view
    with torch.inference_mode(False), torch.enable_grad():
        view = _dtensor_view(local, views.specs[name])
    views.cache[name] = (local, view._version, view)
    return view


def _enter_dtensor_views(module: nn.Module, *_: Any) -> None:
    views = module.__dict__[_VIEWS_ATTR]
    views.depth += 1
    if views.depth == 1:
        for name in views.specs:
            module.__dict__[name] = _view(views, name, module._parameters[name])


def _exit_dtensor_views(module: nn.Module, *_: Any) -> None:
    # Always called, also when the forward raised: a view left in place would
    # be used by later forwards unchecked.
    views = module.__dict__[_VIEWS_ATTR]
    if views.depth > 0:
        views.depth -= 1
        if views.depth == 0:
            for name in views.specs:
                module.__dict__.pop(name, None)


def _dtensor_state_dict_hook(module: nn.Module, state_dict, prefix, *_: Any):
    """Save the local shards as DTensors of global shape, as TP alone does."""
    for name, spec in module.__dict__[_VIEWS_ATTR].specs.items():
        value = state_dict.get(prefix + name)
        if value is not None and not isinstance(value, DTensor):
            state_dict[prefix + name] = _dtensor_view(value, spec)


def _dtensor_load_state_dict_pre_hook(
    module: nn.Module, state_dict, prefix, local_metadata, *_: Any
):
    """
    Load DTensors as local shards; with ``assign=True``, into the registered
    parameter, which DDP and the optimizer hold, assigned to itself.
    """
    for name, spec in module.__dict__[_VIEWS_ATTR].specs.items():
        param, value = module._parameters[name], state_dict.get(prefix + name)
        if not isinstance(value, DTensor) or param is None:
            continue
        if value.placements != spec.placements:
            value = value.redistribute(spec.mesh, spec.placements)
        value = value.to_local()
        if local_metadata.get("assign_to_params_buffers", False):
            with torch.no_grad():
                param.copy_(value)
            value = param
        state_dict[prefix + name] = value


def _check_optimizer_params(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """
    Global step pre-hook: an optimizer built before ``DDP(...)`` holds replaced
    DTensor parameters, which never get a gradient: they would silently not train.
    """
    for group in optimizer.param_groups:
        if any(hasattr(p, _REPLACED_ATTR) for p in group["params"]):
            raise RuntimeError(
                "The optimizer holds TP parameters that DDP/replicate(device_mesh=...) "
                "replaced by local ones.\nBuild the optimizer after `DDP(...)`, from "
                "`model.parameters()`."
            )


def _raise_replaced_param_grad(param: torch.Tensor) -> None:
    """
    A loss computed from a replaced DTensor parameter (e.g. a penalty over
    parameters taken before ``DDP(...)``) would give its gradient to nothing.
    """
    param.grad = None  # nothing piles up if the caller catches the error
    raise RuntimeError(
        "A gradient reached a TP parameter that DDP/replicate(device_mesh=...) "
        "replaced by a local one.\nCompute the loss from the parameters the model "
        "holds after `DDP(...)`."
    )


def _localize_dtensor(
    module: nn.Module, *_: Any, ignored_params: set[nn.Parameter] | None = None
):
    """
    Convert DTensor parameters to local tensors, once, when DDP or ``replicate``
    wraps ``module``: in every owner, by one local ``nn.Parameter`` (shared by
    tied owners) with the DTensor's ``requires_grad`` and spec (``_st_info``).
    Owners show them as DTensors in forward and ``state_dict()``.
    """
    global _optimizer_check_handle
    if ignored_params is None:
        ignored_params = set()
    localized: dict[int, nn.Parameter] = {}
    owners: dict[nn.Module, dict[str, DTensorSpec]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in ignored_params:
            continue
        t, sharding_info = _flatten_tensor(param)
        if sharding_info is not None:
            t = nn.Parameter(t, requires_grad=param.requires_grad)
            t._st_info = sharding_info  # type: ignore[attr-defined]
            setattr(param, _REPLACED_ATTR, True)
            if id(param) not in localized and param.requires_grad:
                param.register_post_accumulate_grad_hook(_raise_replaced_param_grad)
            owner, attr = _get_submodule_n_params(module, name)
            owner._parameters[attr] = localized.setdefault(id(param), t)
            owners.setdefault(owner, {})[attr] = sharding_info
    for t in localized.values():
        if t.requires_grad:  # once, not per forward
            t.register_hook(sync_grad_hook)
    for owner, specs in owners.items():
        owner.__dict__[_VIEWS_ATTR] = _DTensorParamViews(specs)
        owner.register_forward_pre_hook(_enter_dtensor_views)
        owner.register_forward_hook(_exit_dtensor_views, always_call=True)
        owner.register_state_dict_post_hook(_dtensor_state_dict_hook)
        owner.register_load_state_dict_pre_hook(_dtensor_load_state_dict_pre_hook)
    if localized and _optimizer_check_handle is None:
        _optimizer_check_handle = register_optimizer_step_pre_hook(
            _check_optimizer_params
        )


def _pre_dp_module_transform(module: nn.Module):
    """
    Enable the composability between Tensor Parallelism (TP) and Data
    Parallelism(DP) in PyTorch when using DDP. We need to convert Parameters which
    are DTensors to local tensors before wrapping with data parallelism API.
    We then register two hooks, one for converting local tensors back to DTensor
    preforward and one to convert DTensors back to tensors after Forward. By
    integrating this way, we avoid any special handling of DTensor parameters by DDP
    and get DTensor's gradients propagated back to DP, e.g. gradient buckets of DDP.

    Build the optimizer after wrapping, from ``model.parameters()``: one built
    before holds the replaced DTensors and raises at its first ``step()``.

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

    _localize_dtensor(module, None, None)
