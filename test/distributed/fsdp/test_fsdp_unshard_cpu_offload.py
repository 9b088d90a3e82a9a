# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import TEST_WITH_DEV_DBG_ASAN, run_tests

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print(
        "Skip dev-asan as torch + multiprocessing spawn have known issues",
        file=sys.stderr,
    )
    sys.exit(0)


class TestUnshardCPUOffload(MultiProcContinuousTest):
    """``offload_to_cpu`` when the compute device is the CPU (gloo), on two ranks."""

    world_size = 2
    device = torch.device("cpu")

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    def test_offload_to_cpu_on_cpu_compute_device(self):
        """
        ``offload_to_cpu=True`` keeps the full parameters when they already live in CPU
        memory.
        """
        torch.manual_seed(0)
        reference = nn.Linear(4, 6)
        model = FSDP(
            copy.deepcopy(reference),
            process_group=self.pg,
            device_id=self.device,
        )
        for rank0_only in (False, True):
            with FSDP.summon_full_params(
                model, offload_to_cpu=True, rank0_only=rank0_only, writeback=False
            ):
                if self.rank == 0 or not rank0_only:
                    self.assertEqual(model.weight.device, torch.device("cpu"))
                    self.assertEqual(
                        model.weight, reference.weight.to(model.weight.device)
                    )
                    self.assertEqual(model.bias, reference.bias.to(model.bias.device))
        loss = model(torch.ones(2, 4, device=self.device)).sum()
        loss.backward()
        self.assertEqual(loss, reference(torch.ones(2, 4)).sum().to(loss.device))


if __name__ == "__main__":
    run_tests()
