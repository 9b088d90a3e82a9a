# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_utils import run_tests, TEST_WITH_DEV_DBG_ASAN
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print(
        "Skip dev-asan as torch + multiprocessing spawn have known issues",
        file=sys.stderr,
    )
    sys.exit(0)


DIM = 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, 2 * DIM)
        self.net2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.net2(F.relu(self.net1(x)))


class Blocks(nn.Module):
    """TP blocks between plain layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.b1 = MLP()
        self.b2 = MLP()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(self.b2(self.b1(self.embed(x))))


def grad_as_full(param):
    """The full gradient of ``param``, a plain parameter or the local shard of a TP one."""
    spec = param.__dict__.get("_st_info")
    if spec is None:
        return param.grad
    return DTensor.from_local(
        param.grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    ).full_tensor()


class TestDDP2DTPClipGradNorm(DTensorContinuousTestBase):
    """clip_grad_norm_ over DDP(TP model).parameters() clips by the global norm."""

    world_size = 4

    def test_clip_grad_norm_is_global(self):
        """Every rank gets the non-TP reference's norm and clipped gradients, and trains like it."""
        mesh = init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
        inf = float("inf")
        cases = [(p, foreach, torch.float32) for p in (2.0, inf, 1.0, 3.0, -inf, 0.0) for foreach in (None, False)]
        # Gradient norms far above 256: their squares overflow float16.
        cases.append((2.0, None, torch.float16))
        for norm_type, foreach, dtype in cases:
            torch.manual_seed(0)
            reference = Blocks().to(dtype)
            model = copy.deepcopy(reference)
            plan = {"b1.net1": ColwiseParallel(), "b1.net2": RowwiseParallel()}
            plan.update({"b2.net1": ColwiseParallel(), "b2.net2": RowwiseParallel()})
            parallelize_module(model, mesh["tp"], plan)
            ddp = DDP(model, device_mesh=mesh["dp"])
            ref_ddp = DDP(reference, process_group=mesh["dp"].get_group())
            optim = torch.optim.SGD(model.parameters(), lr=0.05)
            ref_optim = torch.optim.SGD(reference.parameters(), lr=0.05)
            case = f"norm_type={norm_type}, foreach={foreach}, {dtype}"
            for step in range(3):
                torch.manual_seed(1000 * step + mesh["dp"].get_local_rank())
                x = (torch.randn(4, DIM) * (30 if dtype == torch.float16 else 1)).to(dtype)
                ddp(x).pow(2).sum().backward()
                ref_ddp(x).pow(2).sum().backward()
                # A small max_norm: clipping is active at every step.
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type, foreach=foreach)
                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type, foreach=foreach)
                self.assertTrue(torch.isfinite(ref_norm), case)
                self.assertEqual(norm, ref_norm, msg=f"{case}, step {step}: total norm")
                self.assertEqual(len(list(model.parameters())), len(list(reference.parameters())))
                for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
                    self.assertEqual(grad_as_full(param), ref.grad, msg=f"{case}, step {step}: {name}")
                optim.step()
                ref_optim.step()
                optim.zero_grad()
                ref_optim.zero_grad()


if __name__ == "__main__":
    run_tests()
