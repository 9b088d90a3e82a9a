# Owner(s): ["oncall: distributed"]

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
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
    MLPModule,
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


class TestTPFrozenParamsDP(DTensorContinuousTestBase):
    """A TP parameter with ``requires_grad=False`` stays frozen under DDP and FSDP."""

    world_size = 4

    def build(self):
        mesh = init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
        model = MLPModule(self.device_type)
        parallelize_module(
            model, mesh["tp"], {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
        )
        # A frozen base weight, as in LoRA; everything else trains.
        model.net1.weight.requires_grad_(False)
        torch.manual_seed(mesh["dp"].get_local_rank())
        return mesh, model, torch.randn(4, 10, device=self.device_type)

    def test_ddp_frozen_tp_param(self):
        mesh, model, x = self.build()
        frozen = model.net1.weight.to_local().clone()
        ddp = DDP(model, device_mesh=mesh["dp"])
        requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
        self.assertEqual(
            requires_grad,
            {
                "net1.weight": False,
                "net1.bias": True,
                "net2.weight": True,
                "net2.bias": True,
            },
            "frozen TP parameter made trainable",
        )
        params = dict(model.named_parameters())
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            ddp(x).sum().backward()
            optim.step()
        weight = params["net1.weight"]
        self.assertIsNone(weight.grad)
        if isinstance(weight, DTensor):  # DDP keeps TP parameters as DTensors
            weight = weight.to_local()
        self.assertEqual(weight, frozen, atol=0, rtol=0)
        self.assertIsNotNone(params["net1.bias"].grad)
        self.assertIsNotNone(params["net2.weight"].grad)

    def test_fsdp1_frozen_tp_param(self):
        """FSDP1 takes local tensors the same way: the frozen unit stays frozen."""
        mesh, model, x = self.build()
        model.net1.bias.requires_grad_(False)
        frozen = model.net1.weight
        expected = frozen.full_tensor()
        kwargs = {
            "device_mesh": mesh["dp"],
            "device_id": torch.device(self.device_type),
        }
        model.net1 = FSDP(model.net1, **kwargs)
        fsdp = FSDP(model, **kwargs)
        # The frozen DTensor parameter the user holds (e.g. a LoRA base weight).
        self.assertFalse(frozen.requires_grad)
        self.assertFalse(
            frozen.to_local().requires_grad, "frozen TP parameter made trainable"
        )
        optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        for _ in range(2):
            fsdp(x).sum().backward()
            optim.step()
        frozen_flat = model.net1._flat_param
        self.assertFalse(frozen_flat.requires_grad)
        self.assertIsNone(frozen_flat.grad)
        with FSDP.summon_full_params(fsdp):
            weight = model.net1.module.weight
            self.assertIsInstance(weight, DTensor)
            self.assertFalse(weight.requires_grad)
            self.assertEqual(weight.full_tensor(), expected, atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
