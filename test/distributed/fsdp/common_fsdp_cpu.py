# Owner(s): ["oncall: distributed"]

import torch
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_fsdp import FSDPTestContinuous


class FSDPTestContinuousCPU(FSDPTestContinuous):
    """
    ``FSDPTestContinuous`` that also runs on CPU with gloo: it skips when there are
    fewer accelerators than ranks, and these tests need none. With fewer accelerators
    than ranks (none, or one GPU for two ranks), the ranks use the CPU and gloo, not the
    accelerator's backend (NCCL cannot put two ranks on one GPU, nor take CPU tensors).
    """

    @classmethod
    def backend_str(cls) -> str:
        if torch.accelerator.device_count() >= cls.world_size:
            return super().backend_str()
        return "gloo"

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
