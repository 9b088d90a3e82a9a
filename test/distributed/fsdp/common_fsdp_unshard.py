# Owner(s): ["oncall: distributed"]

import copy
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_fsdp import FSDPTestMixin


class BodyError(Exception):
    pass


def reference_model() -> nn.Module:
    torch.manual_seed(0)
    # Odd numels so that the last shard is padded
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


def batch(seed: int = 1) -> torch.Tensor:
    # The same batch on every rank: the averaged gradient equals the reference's
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))


class FSDPUnshardTest(FSDPTestMixin, MultiProcContinuousTest):
    """
    ``summon_full_params()`` checked against an unwrapped reference model, bitwise.
    The process group is created once per class; each subtest wraps a fresh copy of
    the (tiny) reference model, since the tests change the parameters. The ranks use
    one accelerator each if there are enough, else the CPU and gloo: these tests need
    none (NCCL cannot put two ranks on one GPU, nor take CPU tensors).
    """

    # A rank left waiting in a collective fails the test within this, not hangs it
    timeout = timedelta(seconds=60)

    @classmethod
    def device_type(cls) -> str:
        accelerator = torch.accelerator.current_accelerator()
        if accelerator and torch.accelerator.device_count() >= cls.world_size:
            return accelerator.type
        return "cpu"

    @classmethod
    def backend_str(cls) -> str:
        return dist.get_default_backend_for_device(cls.device_type())

    @property
    def device(self) -> torch.device:
        if self.device_type() == "cpu":
            return torch.device("cpu")
        torch.accelerator.set_device_index(self.rank)
        return torch.device(self.device_type(), self.rank)

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.pg

    def assertRaisesRegex(self, expected_exception, expected_regex, *args, **kwargs):
        # `TestCase.assertRaisesRegex()` matches no message when `device_type` is not
        # a native device's name, and `FSDPTestContinuous.device_type` is a method
        return unittest.TestCase.assertRaisesRegex(
            self, expected_exception, expected_regex, *args, **kwargs
        )

    def _wrap(self, reference: nn.Module, **kwargs) -> FSDP:
        """Nested FSDP: an inner unit for the first layer, the root for the rest."""
        if "device_mesh" not in kwargs:
            kwargs["process_group"] = self.process_group
        model = copy.deepcopy(reference)
        model[0] = FSDP(model[0], device_id=self.device, **kwargs)
        return FSDP(model, device_id=self.device, **kwargs)

    def _models(self, backward: bool, **kwargs) -> tuple[FSDP, nn.Module]:
        """The FSDP model and its reference, after a backward on the same batch."""
        reference = reference_model()
        model = self._wrap(reference, **kwargs)
        for m, device in [(model, self.device), (reference, "cpu")][: 2 * backward]:
            m(batch().to(device)).sum().backward()
        return model, reference

    def _check_idle_and_resharded(self, model: FSDP) -> None:
        for fsdp_module in FSDP.fsdp_modules(model):
            self.assertEqual(fsdp_module.training_state, TrainingState.IDLE)
            handle = fsdp_module._handle
            self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
            flat_param = handle.flat_param
            if handle.uses_sharded_strategy:
                storage = flat_param._full_param_padded.untyped_storage()
                self.assertEqual(storage.size(), 0)
                local_shard = flat_param._local_shard
                self.assertEqual(flat_param.data_ptr(), local_shard.data_ptr())

    def _check_full(self, model, reference, with_grads: bool = False) -> None:
        """Every rank's full parameters (and gradients) are the reference's, bitwise."""
        with FSDP.summon_full_params(model, writeback=False, with_grads=with_grads):
            for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
                self.assertEqual(p.cpu(), ref, atol=0, rtol=0, msg=f"rank {self.rank}")
                if with_grads and ref.grad is None:
                    self.assertIsNone(p.grad)
                elif with_grads:
                    self.assertEqual(p.grad.cpu(), ref.grad, atol=0, rtol=0)
