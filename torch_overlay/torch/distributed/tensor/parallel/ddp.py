# mypy: allow-untyped-defs
import copy
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel._data_parallel_utils import (
    _flatten_tensor,
    sync_grad_hook,
)


__all__ = []  # type: ignore[var-annotated]


# NOTE: The name of the attribute of each module that owns DTensor parameters
# localized for data parallelism, holding its ``_DTensorParamViews``.
_VIEWS_ATTR = "_dp_dtensor_param_views"


@dataclass
class _DTensorParamViews:
    """
    The DTensor parameters that one module owns, localized for data parallelism.

    ``module._parameters[name]`` always holds the local shard, an ``nn.Parameter``
    carrying its ``DTensorSpec`` as ``_st_info``: DDP, optimizers,
    ``named_parameters()`` and checkpoints see this one object before, during and
    after every forward. While the module runs its forward,
    ``module.__dict__[name]`` holds a DTensor view of the local shard, which
    shadows the parameter for attribute access (``module.weight``) so that the
    forward computes with DTensors, and gradients flow to the local shard.
    ``specs`` maps each name to its global spec (kept here, as a parameter
    assigned later or a deep copy of one has no ``_st_info``). ``depth`` counts
    nested entries (a module calling itself) so that the views live until the
    outermost forward exits. ``cache`` holds each name's view between forwards,
    see ``_cached_dtensor_view``.
    """

    specs: dict[str, DTensorSpec]
    depth: int = 0
    cache: dict[str, tuple[nn.Parameter, int, DTensor]] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles start without views: deepcopy rejects them (they
        # are not graph leaves) and they belong to this module's parameters.
        return {**self.__dict__, "depth": 0, "cache": {}}


def _dtensor_view(tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """
    Return ``tensor`` (a local parameter or a tensor sharing its storage) as a
    DTensor with the global ``spec``, without copying or communicating.
    """
    return DTensor.from_local(
        tensor,
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=spec.shape,
        stride=spec.stride,
    )


# NOTE: Each module reuses the DTensor view of a localized parameter across
# forwards, as building one (``DTensor.from_local``) per parameter and forward
# is most of the cost of the hooks. Reusing it is correct: the view aliases the
# parameter's storage and version counter, so optimizer steps show through, and
# its autograd node (``_FromTorchTensor``) saves no tensors, so each backward
# can go through it again. A view is rebuilt when it would be wrong:
# - the registered parameter is another object (``load_state_dict(assign=True)``,
#   assignment): gradients would go to the old one;
# - the parameter's ``requires_grad`` changed: gradients would flow into a
#   frozen parameter, or not into an unfrozen one;
# - the parameter's data is another tensor (``p.data = ...``, also how
#   ``module.to()``/``_apply`` move and cast parameters): the view would show
#   the old data;
# - the view itself was modified in place (its version changed): its autograd
#   history is no longer the parameter alone.
# Views are built with grad mode on and outside inference mode, whatever mode
# the forward runs in: under inference_mode a view would be an inference tensor,
# which a later training forward cannot save for backward (even the view of a
# frozen parameter), and under no_grad the view of a parameter that requires
# grad would have no autograd node, so every no_grad forward would rebuild it
# (the ``requires_grad`` check). Ops under no_grad or inference_mode record no
# graph from a view that requires grad, as from a parameter.
# A cached view keeps the storage it was made from alive until the module's
# next forward replaces it (e.g. after ``module.to(device)``, which DDP does
# not support after wrapping anyway).
def _cached_dtensor_view(
    views: _DTensorParamViews, name: str, local: nn.Parameter
) -> DTensor:
    """
    Return the DTensor view of the local parameter ``local`` registered as
    ``name``: the cached one if still valid, else a new one, cached.
    """
    if torch.compiler.is_compiling():
        # NOTE: Under torch.compile the view is built inside the graph, where
        # ``from_local`` costs nothing, and is never cached: a view stored in
        # the cache would outlive the graph and become one of its outputs, and
        # AOT autograd would expect a DTensor gradient for it in backward where
        # none flows (the cache's checks would also break the graph).
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
    """
    Forward pre-hook: show the module's localized parameters as DTensors
    """
    views = module.__dict__.get(_VIEWS_ATTR)
    if views is None:
        return
    views.depth += 1
    if views.depth > 1:
        return
    params = module._parameters
    for name in views.specs:
        module.__dict__[name] = _cached_dtensor_view(views, name, params[name])


def _exit_dtensor_views(module: nn.Module, *_: Any) -> None:
    """
    Forward hook (also on exceptions): show the local parameters again
    """
    views = module.__dict__.get(_VIEWS_ATTR)
    if views is None or views.depth == 0:
        return
    views.depth -= 1
    if views.depth > 0:
        return
    for name in views.specs:
        module.__dict__.pop(name, None)


def _dtensor_state_dict_hook(module: nn.Module, state_dict, prefix, *_: Any):
    """
    Save the localized parameters as DTensors with their global shape, as
    tensor parallelism alone does, so that checkpoints are the same with or
    without data parallelism.
    """
    for name, spec in module.__dict__[_VIEWS_ATTR].specs.items():
        key = prefix + name
        value = state_dict.get(key)
        if value is not None and not isinstance(value, DTensor):
            state_dict[key] = _dtensor_view(value, spec)


def _to_local_shard(value: Any, spec: DTensorSpec, local_shape: torch.Size) -> Any:
    """
    The local shard of ``value`` for a localized parameter of global ``spec``:
    a DTensor is redistributed to the parameter's placements; a plain tensor of
    the global shape (a full state dict, as for TP alone) is sliced, without
    communication, as every rank holds all of it, and copied: a slice would
    keep the whole full tensor alive in the parameter or optimizer state it
    becomes (``assign=True``, ``Optimizer.load_state_dict``), non-contiguous,
    and the optimizer's steps would write into the caller's full tensors.
    Anything else is returned as is (a local shard, or a tensor that
    ``load_state_dict`` reports).
    """
    if isinstance(value, DTensor):
        if value.placements != spec.placements:
            value = value.redistribute(spec.mesh, spec.placements)
        return value.to_local()
    if (
        isinstance(value, torch.Tensor)
        and value.shape == spec.shape
        and value.shape != local_shape
    ):
        shape, offset = compute_local_shape_and_global_offset(
            spec.shape, spec.mesh, spec.placements
        )
        local = value[tuple(slice(o, o + n) for n, o in zip(shape, offset))]
        return local.clone(memory_format=torch.contiguous_format)
    return value


def _dtensor_load_state_dict_pre_hook(module: nn.Module, state_dict, prefix, *_: Any):
    """
    Accept DTensors (what ``state_dict()`` returns) and full tensors of the
    global shape (what ``get_model_state_dict(full_state_dict=True)`` returns)
    for localized parameters: load the parameter's local shard of them.
    """
    params = module._parameters
    for name, spec in module.__dict__[_VIEWS_ATTR].specs.items():
        key = prefix + name
        value = state_dict.get(key)
        param = params.get(name)
        if value is not None and param is not None:
            state_dict[key] = _to_local_shard(value, spec, param.shape)


def _register_dtensor_views(
    module: nn.Module, specs: dict[str, DTensorSpec], *, enter_hook: bool
) -> None:
    """
    Record which parameters of ``module`` are localized DTensors and register
    the module's hooks, once. The root's views are entered by
    ``_reconstruct_dtensor`` (``enter_hook=False``) but, like every owner's,
    ended by an always-called forward hook: a forward that raised must not leave
    its views in place, or later forwards would reuse them unchecked (after
    ``p.data = ...`` or a load with ``assign=True``, with the old data, silently).
    """
    views = module.__dict__.get(_VIEWS_ATTR)
    if views is not None:
        views.specs.update(specs)
        return
    module.__dict__[_VIEWS_ATTR] = _DTensorParamViews(specs)
    if enter_hook:
        module.register_forward_pre_hook(_enter_dtensor_views)
    module.register_forward_hook(_exit_dtensor_views, always_call=True)
    module.register_state_dict_post_hook(_dtensor_state_dict_hook)
    module.register_load_state_dict_pre_hook(_dtensor_load_state_dict_pre_hook)


# NOTE: An optimizer built on the TP model before it was wrapped (by DDP or
# ``replicate``, which localize when they are called) holds the DTensor
# parameters that ``_localize_dtensor`` replaced by local ones, and so may
# anything else that took them then (a list for ``clip_grad_norm_``, an
# optimizer that is not a ``torch.optim.Optimizer``). Nothing computes with
# these objects again, so, left as they were, they would never get a gradient
# and the TP weights would silently never train. Instead, each one becomes a
# ``_ReplacedDTensorParameter``, a DTensor that stands for its local parameter:
# its data is the local parameter's current data and its ``grad`` a DTensor view
# of the local parameter's gradient, so that reading, zeroing, scaling or
# clipping its gradient, and updating it in place, act on what DDP trains. A
# ``torch.optim.Optimizer`` still computes on local tensors: a global optimizer
# step pre-hook, registered with the first replacement, puts the local
# parameters in place of the replaced ones in the optimizer's parameter groups
# and state before its first step. The replaced parameters are also kept in a
# weak map (an entry lives as long as someone, e.g. an optimizer, holds the
# DTensor), so that this hook costs nothing once none is left, and so that it
# also finds a parameter of a DTensor subclass, whose class is left alone (it
# gets no gradient before that step). A gradient that autograd accumulates into
# a replaced parameter itself (a loss term computed from it) could only be
# lost: it raises instead, see ``_gradient_to_replaced_param_hook``.
_LOCALIZED_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_optimizer_hook_handle = None


class _ReplacedDTensorParameter(DTensor):
    """
    A DTensor parameter that ``_localize_dtensor`` replaced by the local
    parameter ``_dp_local_param``, for whoever still holds it: it shows that
    parameter's data and gradient as DTensors of its global spec, see
    ``_LOCALIZED_PARAMS``. Freezing or unfreezing it freezes or unfreezes that
    parameter too. Copies and pickles are plain DTensor parameters with the
    current data.
    """

    # The class of an existing DTensor parameter is changed to this one: no
    # new slots, so that the layout stays the same.
    __slots__ = ()

    def _local_param(self) -> nn.Parameter:
        local = self.__dict__["_dp_local_param"]
        if local.dtype != self.dtype or local.device != self.device:
            raise RuntimeError(
                f"This DTensor parameter ({self.dtype} on {self.device}) was "
                f"replaced by a local parameter when its model was wrapped by "
                f"DistributedDataParallel or replicate() with a device_mesh, "
                f"and that parameter is now {local.dtype} on "
                f"{local.device} (module.to() or `.data = ...` after wrapping), "
                f"which this object cannot stand for. Build the optimizer, and "
                f"anything else that holds the model's parameters, after "
                f"DDP(...), from model.parameters()."
            )
        return local

    @property  # type: ignore[override]
    def _local_tensor(self) -> torch.Tensor:
        # NOTE: Always the local parameter's current data (which
        # ``load_state_dict(assign=True)``, ``p.data = ...`` or ``module.to()``
        # may have replaced), so that in-place updates of this DTensor, e.g.
        # by an optimizer that is not a ``torch.optim.Optimizer``, update the
        # weights DDP trains. The DTensor's own local tensor, hidden by this
        # property, keeps the original data alive as long as this object.
        return self._local_param().detach()

    @property  # type: ignore[override]
    def grad(self) -> DTensor | None:
        grad = self._local_param().grad
        return None if grad is None else _dtensor_view(grad, self._spec)

    @grad.setter
    def grad(self, grad: torch.Tensor | None) -> None:
        local = self._local_param()
        if isinstance(grad, DTensor):
            grad = _to_local_shard(grad, self._spec, local.shape)
        elif grad is not None and (
            not isinstance(grad, torch.Tensor) or grad.shape != local.shape
        ):
            raise RuntimeError(
                f"The gradient of a DTensor parameter replaced by a local "
                f"parameter (DistributedDataParallel with a device_mesh) must be "
                f"None, a DTensor, or a tensor of the local shape "
                f"{tuple(local.shape)}, not {type(grad).__name__}"
                f"{tuple(getattr(grad, 'shape', ()))}"
            )
        local.grad = grad

    @property  # type: ignore[override]
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, requires_grad: bool) -> None:
        self.requires_grad_(requires_grad)

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:
        # NOTE: A parameter list kept from before wrapping (e.g. to freeze
        # the base weights later) is the user's handle on the weights DDP
        # trains: its flag is theirs too.
        self._local_param().requires_grad_(requires_grad)
        super().requires_grad_(requires_grad)
        _guard_gradient(self)
        return self

    def _as_dtensor_parameter(self) -> nn.Parameter:
        param = nn.Parameter(
            _dtensor_view(self._local_tensor, self._spec),
            requires_grad=self.requires_grad,
        )
        param.grad = self.grad
        return param

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        return copy.deepcopy(self._as_dtensor_parameter(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._as_dtensor_parameter().__reduce_ex__(protocol)


def _local_state(value: Any, local: nn.Parameter) -> Any:
    """
    The local shard of an optimizer state tensor of the localized parameter
    ``local`` (e.g. Adam's ``exp_avg``): a DTensor or a full tensor of the
    global shape becomes a tensor laid out like ``local``; a 0-dim tensor
    (``step``) or anything else is kept.
    """
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return _to_local_shard(value, local._st_info, local.shape)
    return value


def _use_localized_params(optimizer: Optimizer, *_: Any) -> None:
    """
    Optimizer step pre-hook: replace the DTensor parameters that were localized
    for data parallelism by their local parameters, and move their state.
    """
    if not _LOCALIZED_PARAMS:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            local = _LOCALIZED_PARAMS.get(param)
            if local is None:
                continue
            params[i] = local
            state = optimizer.state.pop(param, None)
            if state is not None:
                optimizer.state[local] = {
                    key: _local_state(value, local) for key, value in state.items()
                }


# NOTE: An optimizer of localized parameters keeps their state (e.g. Adam's
# ``exp_avg``) as local shards. Its ``state_dict()`` gives them as DTensors of
# the global shape, as for TP alone (so ``get_optimizer_state_dict``, full or
# sharded, and DCP see the same as without DDP), and its ``load_state_dict()``
# takes them back, or full tensors of the global shape, as local shards. The
# hooks are registered on each optimizer that holds localized parameters at
# its first step, which ``get_optimizer_state_dict`` also runs to create the
# state. An optimizer without them keeps the number of parameters it had then,
# to look again only when parameters are added. A state dict
# loaded before that first step (the usual resume: build the optimizer, load,
# train) went in without the load hook, so its states of localized parameters
# are converted to local shards then, as the hook would have done.
_OPTIMIZER_PARAM_COUNTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_OPTIMIZERS_WITH_HOOKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _optimizer_params_by_index(optimizer: Optimizer, state_dict) -> dict[Any, Any]:
    """
    Map the parameter indices of an optimizer state dict to the optimizer's
    parameters, as ``Optimizer.load_state_dict`` does.
    """
    return dict(
        zip(
            chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
            chain.from_iterable(g["params"] for g in optimizer.param_groups),
        )
    )


def _optimizer_state_dict_post_hook(optimizer: Optimizer, state_dict) -> None:
    params = _optimizer_params_by_index(optimizer, state_dict)
    for index, state in state_dict["state"].items():
        param = params.get(index)
        spec = getattr(param, "_st_info", None)
        if spec is None:
            continue
        state_dict["state"][index] = {
            key: _dtensor_view(value, spec)
            if isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.dim() > 0
            and value.shape == param.shape
            else value
            for key, value in state.items()
        }


def _optimizer_load_state_dict_pre_hook(optimizer: Optimizer, state_dict) -> Any:
    params = _optimizer_params_by_index(optimizer, state_dict)
    new_state = {}
    for index, state in state_dict["state"].items():
        param = params.get(index)
        if hasattr(param, "_st_info") and isinstance(state, dict):
            state = {key: _local_state(value, param) for key, value in state.items()}
        new_state[index] = state
    return {**state_dict, "state": new_state}


def _register_optimizer_hooks(optimizer: Optimizer) -> None:
    if optimizer in _OPTIMIZERS_WITH_HOOKS:
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _OPTIMIZER_PARAM_COUNTS.get(optimizer) == count:
        return
    _OPTIMIZER_PARAM_COUNTS[optimizer] = count
    if any(hasattr(p, "_st_info") for g in optimizer.param_groups for p in g["params"]):
        _OPTIMIZERS_WITH_HOOKS[optimizer] = True
        optimizer.register_state_dict_post_hook(_optimizer_state_dict_post_hook)
        optimizer.register_load_state_dict_pre_hook(_optimizer_load_state_dict_pre_hook)
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                if state and hasattr(param, "_st_info"):
                    optimizer.state[param] = {
                        key: _local_state(value, param) for key, value in state.items()
                    }


def _optimizer_step_pre_hook(optimizer: Optimizer, *_: Any) -> None:
    """
    Global optimizer step pre-hook, registered with the first localization.
    """
    _use_localized_params(optimizer)
    _register_optimizer_hooks(optimizer)


def _gradient_to_replaced_param_hook(param: torch.Tensor) -> None:
    """
    Post-accumulate-grad hook of a replaced DTensor parameter: nothing reads
    its own gradient (its ``grad`` shows the local parameter's), so a gradient
    accumulated into it would be lost, silently. It is dropped, so that it
    does not pile up there, and the backward raises.
    """
    torch._C.TensorBase.grad.__set__(param, None)
    raise RuntimeError(
        "A gradient reached a DTensor parameter that DistributedDataParallel or "
        "replicate() with a device_mesh replaced by a local parameter when it "
        "wrapped the model: a loss term computed from a parameter taken before "
        "wrapping (e.g. a penalty over a list of parameters kept from then) "
        "would train nothing, since DDP trains and synchronizes the registered "
        "parameters. Compute it from the parameters the model holds after "
        "DDP(...): model.parameters() (local shards), or the module's DTensor "
        "views during its forward."
    )


def _guard_gradient(param: torch.Tensor) -> None:
    """
    Register ``_gradient_to_replaced_param_hook`` on the replaced parameter
    ``param`` once it requires grad (it cannot be registered before).
    """
    if param.requires_grad and "_dp_gradient_guard" not in param.__dict__:
        param._dp_gradient_guard = param.register_post_accumulate_grad_hook(  # type: ignore[attr-defined]
            _gradient_to_replaced_param_hook
        )


def _record_localized(param: nn.Parameter, local: nn.Parameter) -> None:
    global _optimizer_hook_handle
    if param in _LOCALIZED_PARAMS:  # a tied parameter's other owners
        return
    _guard_gradient(param)
    if type(param) is DTensor:
        # The local parameter shares the DTensor's local tensor (see
        # ``_flatten_tensor``), so the data it shows is the same.
        param.__class__ = _ReplacedDTensorParameter
        param._dp_local_param = local  # type: ignore[attr-defined]
    _LOCALIZED_PARAMS[param] = local
    if _optimizer_hook_handle is None:
        _optimizer_hook_handle = register_optimizer_step_pre_hook(
            _optimizer_step_pre_hook
        )


class _KeepParamsOnAssign:
    """
    Load hooks of a module whose parameters DDP holds after
    ``_localize_dtensor``: ``load_state_dict(assign=True)`` registers new
    parameter objects, which DDP's reducer and the user's optimizer never see,
    so training would silently go on with the old ones, unsynchronized. The
    registered objects are put back, holding the loaded tensors' data (what
    ``assign`` asks for); a tensor that cannot be their data (another dtype or
    device) is an error of ``load_state_dict``, and that parameter is kept.
    """

    def __init__(self, ignored: set[str]) -> None:
        self.ignored = ignored
        self.before: dict[str, tuple[nn.Parameter, bool]] = {}

    def pre_hook(
        self,
        module: nn.Module,
        state_dict,
        prefix,
        local_metadata,
        strict,
        missing_keys,
        unexpected_keys,
        error_msgs,
    ) -> None:
        self.before = {}
        if not local_metadata.get("assign_to_params_buffers", False):
            return
        for name, param in module._parameters.items():
            if param is None or name in self.ignored:
                continue
            value = state_dict.get(prefix + name)
            ok = not isinstance(value, torch.Tensor) or (
                value.dtype == param.dtype and value.device == param.device
            )
            if not ok:
                error_msgs.append(
                    f'While assigning the parameter named "{prefix + name}": '
                    f"the model was wrapped by DistributedDataParallel with a "
                    f"device_mesh, so DDP and the optimizer hold this parameter "
                    f"({param.dtype} on {param.device}); assign=True can only give "
                    f"it new data of the same dtype and device, not {value.dtype} "
                    f"on {value.device}. Convert the state dict, or load with "
                    f"assign=False."
                )
            self.before[name] = (param, ok)

    def post_hook(self, module: nn.Module, incompatible_keys) -> None:
        before, self.before = self.before, {}
        for name, (old, ok) in before.items():
            new = module._parameters.get(name)
            if new is old or new is None:
                continue
            module._parameters[name] = old
            if ok and new.shape == old.shape:
                old.data = new.data


def _keep_params_on_assign(
    module: nn.Module, ignored_params: set[nn.Parameter]
) -> None:
    for submodule in module.modules():
        if "_dp_keep_params_on_assign" in submodule.__dict__:
            continue
        ignored = {
            name for name, p in submodule._parameters.items() if p in ignored_params
        }
        if len(ignored) == len(submodule._parameters):
            continue
        guard = _KeepParamsOnAssign(ignored)
        submodule.__dict__["_dp_keep_params_on_assign"] = guard
        submodule.register_load_state_dict_pre_hook(guard.pre_hook)
        submodule.register_load_state_dict_post_hook(guard.post_hook)


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


def _update_module_param(param_list: list[tuple[nn.Module, str, nn.Parameter]]):
    """
    Update parameters within the module
    """
    for item in param_list:
        parent_module, module_path, t = item
        if module_path not in parent_module._parameters:
            raise AssertionError
        # Replace in place: the parameter stays registered, in its position.
        parent_module._parameters[module_path] = t


def _reconstruct_dtensor(module: nn.Module, _input: Any):
    """
    Reconstruct DTensor parameters from local tensors: the forward pre-hook of
    the root module, whose own DTensor parameters get DTensor views during its
    forward. Submodules that own DTensor parameters have their own hooks.
    """
    _enter_dtensor_views(module)


def _localize_dtensor(
    module: nn.Module, *_: Any, ignored_params: set[nn.Parameter] | None = None
):
    """
    Convert DTensor parameters to local tensors

    Every DTensor parameter of ``module``'s tree (except ``ignored_params``) is
    replaced, in each module that owns it, by one local ``nn.Parameter`` (shared
    by all owners of a tied parameter) with the same ``requires_grad``, and
    becomes a ``_ReplacedDTensorParameter`` that stands for it, for whoever
    still holds the DTensor (see ``_LOCALIZED_PARAMS``). Each
    submodule that owns such parameters gets forward hooks that show them as
    DTensors during its forward. The root's own parameters get them from
    ``_reconstruct_dtensor`` and lose them in the root's always-called exit
    hook (see ``_register_dtensor_views``). DDP and ``replicate`` call it once,
    when they wrap the module.
    """
    if ignored_params is None:
        ignored_params = set()
    param_list = []
    # A tied DTensor parameter gets one local parameter for all of its owners.
    localized: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in ignored_params:
            continue
        t, sharding_info = _flatten_tensor(param)
        if sharding_info is not None:
            t = nn.Parameter(t, requires_grad=param.requires_grad)
            t._st_info = sharding_info  # type: ignore[attr-defined]
            t = localized.setdefault(id(param), t)
            _record_localized(param, t)
            param_list.append((*_get_submodule_n_params(module, name), t))
    _update_module_param(param_list)  # type: ignore[arg-type]
    # Registered once per parameter: a hook per forward would pile up.
    for t in localized.values():
        if t.requires_grad:
            t.register_hook(sync_grad_hook)
    owners: dict[nn.Module, dict[str, DTensorSpec]] = {}
    for parent_module, module_path, t in param_list:
        owners.setdefault(parent_module, {})[module_path] = t._st_info  # type: ignore[attr-defined]
    for owner, specs in owners.items():
        _register_dtensor_views(owner, specs, enter_hook=owner is not module)
    # After the views' load hooks, which turn DTensors into local tensors.
    _keep_params_on_assign(module, ignored_params)


def _pre_dp_module_transform(module: nn.Module):
    """
    Enable the composability between Tensor Parallelism (TP) and Data
    Parallelism(DP) in PyTorch when using DDP. We need to convert Parameters which
    are DTensors to local tensors before wrapping with data parallelism API.

    Each DTensor parameter is replaced, in every module that owns it, by one local
    ``nn.Parameter`` (same ``requires_grad``, tied parameters stay tied) that stays
    registered for good: DDP, optimizers, ``named_parameters()`` and
    ``state_dict()`` see the same object before, during and after every forward.
    Forward hooks on each module that owns such parameters show them as DTensor
    views (zero copy, gradients flow to the local parameter, reused across
    forwards until stale) while that module runs forward, so nested modules,
    submodules called on their own and activation checkpointing work. DDP then handles the local parameters like any
    other, e.g. in its gradient buckets. ``state_dict()`` returns the TP
    parameters as DTensors with their global shape, as TP alone does, and
    ``load_state_dict()`` accepts them back.

    This API is used by ``DistributedDataParallel`` and ``replicate`` when given a
    ``device_mesh`` sliced from a 2-D mesh; FSDP composes with TP on its own.

    Args:
        module (:class:`nn.Module`):
            Module which has been applied TP on.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>>
        >>> # Define the module.
        >>> mesh_2d = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> m = module(...)
        >>> parallelize_module(m, mesh_2d["tp"], {"w1": ColwiseParallel()})
        >>> m = DDP(m, device_mesh=mesh_2d["dp"])  # calls _pre_dp_module_transform(m)
        >>>
    """

    _localize_dtensor(module)
    module.register_forward_pre_hook(_reconstruct_dtensor)
