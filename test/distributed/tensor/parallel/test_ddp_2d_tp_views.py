# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

from test_ddp_2d_tp_params import DIM, Model, TP_PLAN  # noqa: E402


class TestDDP2DTPViews(DTensorContinuousTestBase):
    """DDP(TP model): the DTensor views of the parameters, reused across forwards."""

    world_size = 4

    def setup(self):
        mesh = init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = Model().to(self.device_type)
        parallelize_module(model, mesh["tp"], TP_PLAN)
        other = copy.deepcopy(model)  # TP only, the same values
        torch.manual_seed(mesh["dp"].get_local_rank())
        return DDP(model, device_mesh=mesh["dp"]), model, other

    def test_view_reused_until_stale(self):
        ddp, model, other = self.setup()
        seen = []
        model.blocks[0].net1.register_forward_pre_hook(
            lambda m, i: seen.append(m.weight)
        )
        x = torch.randn(4, DIM, device=self.device_type)
        for _ in range(2):
            ddp(x).sum().backward()
        self.assertIsInstance(seen[0], DTensor)
        self.assertIs(seen[1], seen[0])  # unchanged: the same view
        self.assertEqual(copy.deepcopy(model)(x), other(x))  # views are not leaves
        self.assertEqual(model.blocks[1](x), other.blocks[1](x))  # called directly
        model.double()  # gives each DTensor parameter a new local tensor
        other.double()
        self.assertEqual(model(x.double()), other(x.double()))
        self.assertIsNot(seen[-1], seen[0])

    def test_first_forward_without_grad(self):
        """A view built under no_grad or inference_mode is not reused for training."""
        for first_forward in (torch.no_grad, torch.inference_mode):
            ddp, model, _ = self.setup()
            x = torch.randn(4, DIM, device=self.device_type)
            with first_forward():
                ddp(x)
            ddp(x).sum().backward()
            grads = {
                n: p.grad for n, p in model.named_parameters() if isinstance(p, DTensor)
            }
            self.assertEqual(len(grads), 8, "TP parameters went missing")
            for name, grad in grads.items():
                self.assertIsInstance(grad, DTensor, name)


if __name__ == "__main__":
    run_tests()
