# Owner(s): ["oncall: distributed"]

import sys

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._unshard_param_utils import _validate_unshard_params_args
from torch.testing._internal.common_utils import TEST_WITH_DEV_DBG_ASAN, run_tests

from common_fsdp_cpu import FSDPTestContinuousCPU

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print(
        "Skip dev-asan as torch + multiprocessing spawn have known issues",
        file=sys.stderr,
    )
    sys.exit(0)


class TestUnshardOffloadWarning(FSDPTestContinuousCPU):
    """
    The ``summon_full_params`` offload warning, on two ranks of any backend (gloo on CPU
    included).
    """

    world_size = 2

    def test_offload_to_cpu_warning_text(self):
        """
        The warning for ``offload_to_cpu=True, rank0_only=False`` reads as a sentence.
        """
        model = FSDP(
            nn.Linear(4, 4), process_group=self.process_group, device_id=self.device
        )
        with self.assertWarns(UserWarning) as caught:
            _validate_unshard_params_args(
                model,
                writeback=False,
                rank0_only=False,
                offload_to_cpu=True,
                with_grads=False,
            )
        self.assertIn("may result in the unsharded parameters", str(caught.warning))


if __name__ == "__main__":
    run_tests()
