from typing import TypeAlias
from typing_extensions import Self

import torch
from torch import Tensor
from torch.autograd.grad_mode import no_grad
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type


def _get_foreach_kernels_supported_devices() -> list[str]:
    r"""Return the device type list that supports foreach kernels."""
    return ["cuda", "xpu", "mtia", torch._C._get_privateuse1_backend_name()]


def _get_fused_kernels_supported_devices() -> list[str]:
    r"""Return the device type list that supports fused kernels in optimizer."""
    return [
        "mps",
        "cuda",
        "xpu",
        "hpu",
        "cpu",
        "mtia",
        torch._C._get_privateuse1_backend_name(),
    ]


TensorListList: TypeAlias = list[list[Tensor | None]]
Indices: TypeAlias = list[int]
_foreach_supported_types = [torch.Tensor]


# This util function splits tensors into groups by device and dtype, which is useful before sending
# tensors off to a foreach implementation, which requires tensors to be on one device and dtype.
# If tensorlistlist contains more than one tensorlist, the following assumptions are made BUT NOT verified:
#   - tensorlists CAN be None
#   - all tensors in the first specified list cannot be None
#   - given an index i, all specified tensorlist[i]s match in dtype and device
# with_indices (bool, optional): whether to track previous indices as the last list per dictionary entry.
#   It comes in handy if there are Nones or literals in the tensorlists that are getting scattered out.
#   Whereas mutating a tensor in the resulting split-up tensorlists WILL propagate changes back to the
#   original input tensorlists, changing up Nones/literals WILL NOT propagate, and manual propagation
#   may be necessary. Check out torch/optim/sgd.py for an example.
#
# A traceable wrapper subclass that takes foreach calls (it adds itself to
# _foreach_supported_types, as DTensor does) takes a call on the whole list and refuses
# plain tensors ("got mixed torch.Tensor and DTensor"). Where the first tensorlist mixes
# such a subclass with other tensors, each group is split by the wrapper subclass that
# every tensorlist holds at an index. Other types (nn.Parameter and its subclasses) stay
# with the plain tensors. Without such a subclass, this is the C++ grouping alone.
@no_grad()
def _group_tensors_by_device_and_dtype(
    tensorlistlist: TensorListList,
    with_indices: bool = False,
) -> dict[tuple[torch.device, torch.dtype], tuple[TensorListList, Indices]]:
    grouped = torch._C._group_tensors_by_device_and_dtype(tensorlistlist, with_indices)
    if len(_foreach_supported_types) == 1:  # no subclass takes foreach calls
        return grouped
    # The first tensorlist decides: the parameters, whose gradients and states are
    # tensors of their own type. One look at the type of each, in C, that stops at the
    # first wrapper subclass: a tensorlist without one is the C++ grouping alone.
    wrappers = set(filter(is_traceable_wrapper_subclass_type, _foreach_supported_types))
    if wrappers.isdisjoint(map(type, tensorlistlist[0])):
        return grouped
    if len(set(map(type, tensorlistlist[0]))) == 1:  # all of one wrapper subclass
        return grouped
    split: dict[tuple[torch.device, torch.dtype], tuple[TensorListList, Indices]] = {}
    for key, (tensorlists, indices) in grouped.items():
        positions: dict[tuple[type | None, ...], list[int]] = {}
        for i in range(len(tensorlists[0])):
            kinds = tuple(
                type(ts[i]) if type(ts[i]) in wrappers else None
                for ts in tensorlists
                if ts
            )
            positions.setdefault(kinds if any(kinds) else (), []).append(i)
        if len(positions) == 1:
            split[key] = (tensorlists, indices)
            continue
        for kinds, ps in positions.items():
            split_key = _SubclassGroupKey(*key, kinds) if kinds else key
            split[split_key] = (
                [[ts[i] for i in ps] if ts else ts for ts in tensorlists],
                [indices[i] for i in ps] if indices else indices,
            )
    return split


class _SubclassGroupKey(tuple):
    """The key of a group of tensor subclass instances whose device and dtype may be
    those of plain tensors in another group: it unpacks as ``(device, dtype)`` like
    every key, and compares and hashes with ``tensor_types`` too (the wrapper subclass
    of each tensorlist at the group's indices, None for plain tensors)."""

    tensor_types: tuple[type | None, ...]

    def __new__(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        tensor_types: tuple[type | None, ...],
    ) -> Self:
        key = super().__new__(cls, (device, dtype))
        key.tensor_types = tensor_types
        return key

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _SubclassGroupKey)
            and tuple(self) == tuple(other)
            and self.tensor_types == other.tensor_types
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((*self, self.tensor_types))


def _device_has_foreach_support(device: torch.device) -> bool:
    return (
        device.type in (_get_foreach_kernels_supported_devices() + ["cpu"])
        and not torch.jit.is_scripting()
    )


def _has_foreach_support(tensors: list[Tensor], device: torch.device) -> bool:
    return _device_has_foreach_support(device) and all(
        t is None or type(t) in _foreach_supported_types for t in tensors
    )
