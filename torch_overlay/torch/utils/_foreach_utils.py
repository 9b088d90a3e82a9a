from typing import TypeAlias

import torch
from torch import Tensor
from torch.autograd.grad_mode import no_grad


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
# Tensors of one device and dtype but of different types, such as DTensors and plain
# tensors, go to separate groups: a tensor subclass handles a foreach call on the whole
# list, and DTensor refuses plain tensors ("got mixed torch.Tensor and DTensor").
@no_grad()
def _group_tensors_by_device_and_dtype(
    tensorlistlist: TensorListList,
    with_indices: bool = False,
) -> dict[tuple[torch.device, torch.dtype], tuple[TensorListList, Indices]]:
    grouped = torch._C._group_tensors_by_device_and_dtype(tensorlistlist, with_indices)
    types = set(map(type, tensorlistlist[0])) if tensorlistlist else set()
    if len({_tensor_type(t) for t in types}) <= 1:
        return grouped
    split: dict[tuple[torch.device, torch.dtype], tuple[TensorListList, Indices]] = {}
    for key, (tensorlists, indices) in grouped.items():
        positions: dict[type, list[int]] = {}
        for i, t in enumerate(tensorlists[0]):
            positions.setdefault(_tensor_type(type(t)), []).append(i)
        for tensor_type, ps in positions.items():
            split_key = key
            if tensor_type is not Tensor:
                split_key = _SubclassGroupKey(*key, tensor_type)
            split[split_key] = (
                [[ts[i] for i in ps] if ts else ts for ts in tensorlists],
                [indices[i] for i in ps] if indices else indices,
            )
    return split


def _tensor_type(tensor_type: type) -> type:
    return Tensor if tensor_type is torch.nn.Parameter else tensor_type


class _SubclassGroupKey(tuple):
    """The key of a group of tensor subclass instances whose device and dtype may be
    those of plain tensors in another group: it unpacks as ``(device, dtype)`` like
    every key, and compares and hashes with the subclass too."""

    tensor_type: type

    def __new__(
        cls, device: torch.device, dtype: torch.dtype, tensor_type: type
    ) -> "_SubclassGroupKey":
        key = super().__new__(cls, (device, dtype))
        key.tensor_type = tensor_type
        return key

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _SubclassGroupKey)
            and tuple(self) == tuple(other)
            and self.tensor_type is other.tensor_type
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((*self, self.tensor_type))


def _device_has_foreach_support(device: torch.device) -> bool:
    return (
        device.type in (_get_foreach_kernels_supported_devices() + ["cpu"])
        and not torch.jit.is_scripting()
    )


def _has_foreach_support(tensors: list[Tensor], device: torch.device) -> bool:
    return _device_has_foreach_support(device) and all(
        t is None or type(t) in _foreach_supported_types for t in tensors
    )
