# Owner(s): ["oncall: distributed"]

import torch
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_fsdp import FSDPTestContinuous


class FSDPTestContinuousCPU(FSDPTestContinuous):
    """
    ``FSDPTestContinuous`` that also runs on CPU with gloo: it skips when there
    are fewer accelerators than ranks, and these tests need none.
    """

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        if torch.accelerator.device_count() >= world_size:
            super()._init_pg(rank, world_size, rdvz_file)
        else:
            MultiProcContinuousTest._init_pg.__func__(cls, rank, world_size, rdvz_file)

    @property
    def device(self) -> torch.device:
        if torch.accelerator.device_count() >= self.world_size:
            return torch.accelerator.current_accelerator()
        return torch.device("cpu")
