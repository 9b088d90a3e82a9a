# Owner(s): ["oncall: distributed"]

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
    MLPModule,
)


# Tensor-Parallel degree
TP_DEGREE = 2
LR = 3e-3
STEPS = 3


class Test2dParallelIntegration(DTensorContinuousTestBase):
    world_size = 4

    def init_model(self, device_mesh_api=True):
        """A DDP reference and the same model with TP on a 2-D (dp, tp) mesh."""
        torch.manual_seed(0)
        model = MLPModule(self.device_type)
        torch.manual_seed(0)
        twod_model = MLPModule(self.device_type)
        twod_mesh = init_device_mesh(
            self.device_type,
            (self.world_size // TP_DEGREE, TP_DEGREE),
            mesh_dim_names=("dp", "tp"),
        )
        dp_pg = twod_mesh.get_group("dp")
        model = DDP(model, process_group=dp_pg)
        parallelize_plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
        parallelize_module(twod_model, twod_mesh["tp"], parallelize_plan)
        if device_mesh_api:
            twod_model = DDP(twod_model, device_mesh=twod_mesh["dp"])
        else:
            _pre_dp_module_transform(twod_model)
            twod_model = DDP(twod_model, process_group=dp_pg)
        return model, twod_model, dp_pg

    def _check_module(self, m1, m2, check_grad=False):
        """``m2`` (2-D) matches ``m1`` (DDP): every parameter, or its gradient."""
        named_parameters = dict(m1.named_parameters())
        twod_state = m2.state_dict()
        self.assertEqual(list(dict(m2.named_parameters())), list(named_parameters))
        self.assertEqual(list(twod_state), list(m1.state_dict()))
        for name, param_m2 in m2.named_parameters():
            param_m1 = named_parameters[name]
            # The state dict has each TP parameter as a DTensor of global shape.
            global_m2 = twod_state[name]
            if check_grad:
                param_m1 = param_m1.grad
                param_m2 = param_m2.grad
                self.assertIsNotNone(param_m2, name)
                if isinstance(global_m2, DTensor):
                    global_m2 = DTensor.from_local(
                        param_m2,
                        global_m2.device_mesh,
                        global_m2.placements,
                        shape=global_m2.shape,
                        stride=global_m2.stride(),
                    )
                else:
                    global_m2 = param_m2
            if isinstance(global_m2, DTensor):
                self.assertEqual(global_m2.to_local(), param_m2)
                global_m2 = global_m2.full_tensor()
            self.assertEqual(global_m2, param_m1, msg=name)

    def _train(self, model, twod_model, dp_pg, optim, twod_optim, first_step=0):
        for step in range(first_step, first_step + STEPS):
            # Same input within a TP group, a different one per DP rank.
            torch.manual_seed(1000 * step + dist.get_rank(dp_pg))
            input = torch.rand(4, 10, device=self.device_type)
            output = model(input)
            twod_output = twod_model(input)
            self.assertEqual(output, twod_output)
            output.sum().backward()
            twod_output.sum().backward()
            self._check_module(model, twod_model, check_grad=True)
            optim.step()
            twod_optim.step()
            optim.zero_grad()
            twod_optim.zero_grad()
            self._check_module(model, twod_model)

    def test_2d_ddp_integration_functionality(self) -> None:
        for device_mesh_api in (True, False):
            model, twod_model, dp_pg = self.init_model(device_mesh_api)
            optim = torch.optim.Adam(model.parameters(), lr=LR)
            twod_optim = torch.optim.Adam(twod_model.parameters(), lr=LR)
            self._train(model, twod_model, dp_pg, optim, twod_optim)

    def test_2d_ddp_save_load(self) -> None:
        model, twod_model, dp_pg = self.init_model()
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        twod_optim = torch.optim.Adam(twod_model.parameters(), lr=LR)
        self._train(model, twod_model, dp_pg, optim, twod_optim)

        path = [tempfile.mkdtemp() if self.rank == 0 else None]
        dist.broadcast_object_list(path)
        if self.rank == 0:
            self.addCleanup(shutil.rmtree, path[0], ignore_errors=True)
        dcp.save(twod_model.state_dict(), checkpoint_id=path[0])

        # Load into a fresh 2-D model that already trained a step on its own.
        _, new_twod_model, _ = self.init_model()
        new_twod_model(torch.rand(4, 10, device=self.device_type)).sum().backward()
        state_dict = new_twod_model.state_dict()
        dcp.load(state_dict, checkpoint_id=path[0])
        new_twod_model.load_state_dict(state_dict)
        for (name, param), expected in zip(
            new_twod_model.named_parameters(), twod_model.parameters(), strict=True
        ):
            self.assertEqual(param, expected, atol=0, rtol=0, msg=name)

        # Training goes on from the loaded state like the reference.
        new_twod_model.zero_grad()
        new_optim = torch.optim.SGD(new_twod_model.parameters(), lr=LR)
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        self._train(model, new_twod_model, dp_pg, optim, new_optim, STEPS)


if __name__ == "__main__":
    run_tests()
