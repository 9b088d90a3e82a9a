# Owner(s): ["oncall: distributed"]

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._unshard_param_utils import _validate_unshard_params_args
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_fsdp import FSDPTestContinuous
from torch.testing._internal.common_utils import TEST_WITH_DEV_DBG_ASAN, run_tests

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print("Skip dev-asan as torch + multiprocessing spawn have known issues", file=sys.stderr)
    sys.exit(0)


class TestUnshardOffloadWarning(FSDPTestContinuous):
    """The ``summon_full_params`` offload warning, on two ranks of any backend (gloo on CPU included)."""

    world_size = 2

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        # FSDPTestContinuous skips when there are fewer accelerators than ranks;
        # these tests also run on CPU with gloo.
        if torch.accelerator.device_count() >= world_size:
            super()._init_pg(rank, world_size, rdvz_file)
        else:
            MultiProcContinuousTest._init_pg.__func__(cls, rank, world_size, rdvz_file)

    @property
    def device(self) -> torch.device:
        if torch.accelerator.device_count() >= self.world_size:
            return torch.accelerator.current_accelerator()
        return torch.device("cpu")

    def test_offload_to_cpu_warning_text(self):
        """The warning for ``offload_to_cpu=True, rank0_only=False`` reads as a sentence."""
        model = FSDP(nn.Linear(4, 4), process_group=self.process_group, device_id=self.device)
        with self.assertWarns(UserWarning) as caught:
            _validate_unshard_params_args(
                model, writeback=False, rank0_only=False, offload_to_cpu=True, with_grads=False
            )
        self.assertIn("may result in the unsharded parameters", str(caught.warning))


if __name__ == "__main__":
    run_tests()
