# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
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

STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]


class _BodyError(Exception):
    pass


def _make_reference() -> nn.Module:
    torch.manual_seed(0)
    # Odd numels so that the last shard is padded
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


class TestUnshardOffloadAndGrads(FSDPTestContinuousCPU):
    """
    ``offload_to_cpu`` with ``NO_SHARD``, and ``with_grads`` with ``offload_to_cpu`` or
    flat parameters.
    """

    world_size = 2

    def _wrap(
        self,
        reference: nn.Module,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
    ) -> FSDP:
        """
        Nested FSDP: an inner unit for the first linear layer, the root for the rest.
        """
        kwargs = {
            "process_group": self.process_group,
            "device_id": self.device,
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
        }
        model = copy.deepcopy(reference)
        model[0] = FSDP(model[0], **kwargs)
        return FSDP(model, **kwargs)

    def _input(self) -> torch.Tensor:
        # The same batch on every rank: the averaged gradient equals the reference's
        return torch.randn(4, 5, generator=torch.Generator().manual_seed(1))

    def _assert_idle(self, model: FSDP) -> None:
        for fsdp_module in FSDP.fsdp_modules(model):
            self.assertEqual(fsdp_module.training_state, TrainingState.IDLE)
            self.assertEqual(
                fsdp_module._handle._training_state, HandleTrainingState.IDLE
            )

    def _assert_params_equal(self, model: FSDP, reference: nn.Module) -> None:
        with FSDP.summon_full_params(model, writeback=False):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.cpu(), ref_param)

    def _train_step_and_compare(self, model: FSDP, reference: nn.Module) -> None:
        """
        One SGD step on both models from their current gradients, then compare the next
        loss.
        """
        for module in (model, reference):
            with torch.no_grad():
                for param in module.parameters():
                    if param.grad is not None:
                        param -= 0.1 * param.grad
                        param.grad = None
        loss = model(self._input().to(self.device)).sum()
        ref_loss = reference(self._input()).sum()
        self.assertEqual(loss.cpu(), ref_loss)
        loss.backward()
        ref_loss.backward()

    def test_offload_to_cpu_no_shard(self):
        """
        ``offload_to_cpu=True`` with ``NO_SHARD``: full CPU parameters inside, changes
        kept with writeback.
        """
        self.run_subtests(
            {
                "use_orig_params": [False, True],
                # (writeback, rank0_only); both together: rank-0 writeback's tests
                "options": [(True, False), (False, False), (False, True)],
            },
            self._test_offload_to_cpu_no_shard,
        )

    def _test_offload_to_cpu_no_shard(self, use_orig_params, options):
        writeback, rank0_only = options
        reference = _make_reference()
        model = self._wrap(reference, ShardingStrategy.NO_SHARD, use_orig_params)
        with FSDP.summon_full_params(
            model, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=True
        ):
            if self.rank == 0 or not rank0_only:
                for param, ref_param in zip(
                    model.parameters(), reference.parameters(), strict=True
                ):
                    self.assertEqual(param.device, torch.device("cpu"))
                    self.assertEqual(param, ref_param)
                if writeback:
                    with torch.no_grad():
                        for param in model.parameters():
                            param.add_(1.0)
        self._assert_idle(model)
        if writeback:
            with torch.no_grad():
                for ref_param in reference.parameters():
                    ref_param.add_(1.0)
        self._assert_params_equal(model, reference)
        for param in model.parameters():
            self.assertEqual(param.device, self.device)
        self._train_step_and_compare(model, reference)

    def test_with_grads_offload_or_flat_params(self):
        """
        ``with_grads=True`` with ``offload_to_cpu=True`` or ``use_orig_params=False``
        gives the full gradients.
        """
        self.run_subtests(
            {
                "sharding_strategy": STRATEGIES,
                # (use_orig_params, offload_to_cpu): the combinations that stock torch
                # rejects
                "options": [(False, False), (False, True), (True, True)],
                "writeback": [False, True],
            },
            self._test_with_grads_offload_or_flat_params,
        )

    def _test_with_grads_offload_or_flat_params(
        self, sharding_strategy, options, writeback
    ):
        use_orig_params, offload_to_cpu = options
        reference = _make_reference()
        model = self._wrap(reference, sharding_strategy, use_orig_params)
        model(self._input().to(self.device)).sum().backward()
        reference(self._input()).sum().backward()
        with FSDP.summon_full_params(
            model, writeback=writeback, offload_to_cpu=offload_to_cpu, with_grads=True
        ):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.shape, ref_param.shape)
                self.assertIsNotNone(param.grad)
                if offload_to_cpu:
                    self.assertEqual(param.grad.device, torch.device("cpu"))
                self.assertEqual(param.grad.cpu(), ref_param.grad)
                self.assertGreater(torch.count_nonzero(param.grad), 0)
                if writeback:
                    param.grad *= 2
        self._assert_idle(model)
        if writeback:
            for ref_param in reference.parameters():
                ref_param.grad *= 2
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.cpu(), ref_param)
                self.assertEqual(param.grad.cpu(), ref_param.grad)
        self._train_step_and_compare(model, reference)

    def test_with_grads_flat_params_after_optimizer_step(self):
        """
        ``with_grads=True`` with ``use_orig_params=False`` after the flat parameter
        changed in place (an optimizer step): the full gradients are still exposed.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES, "offload_to_cpu": [False, True]},
            self._test_with_grads_flat_params_after_optimizer_step,
        )

    def _test_with_grads_flat_params_after_optimizer_step(
        self, sharding_strategy, offload_to_cpu
    ):
        reference = _make_reference()
        model = self._wrap(reference, sharding_strategy, use_orig_params=False)
        for module in (model, reference):
            module(self._input().to(self.device)).sum().backward()
            torch.optim.SGD(module.parameters(), lr=0.1).step()
        with FSDP.summon_full_params(
            model, writeback=False, offload_to_cpu=offload_to_cpu, with_grads=True
        ):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.cpu(), ref_param)
                self.assertEqual(param.grad.cpu(), ref_param.grad)
        self._assert_idle(model)

    def test_summon_sequence_between_steps(self):
        """
        Any sequence of ``summon_full_params`` options between training steps leaves
        training unchanged.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES, "use_orig_params": [False, True]},
            self._test_summon_sequence_between_steps,
        )

    def _test_summon_sequence_between_steps(self, sharding_strategy, use_orig_params):
        reference = _make_reference()
        model = self._wrap(reference, sharding_strategy, use_orig_params)
        option_sequence = [
            {"writeback": True, "offload_to_cpu": True, "with_grads": True},
            {"writeback": False, "rank0_only": True},
            {"writeback": False, "rank0_only": True, "offload_to_cpu": True},
            {"writeback": True, "offload_to_cpu": True, "recurse": False},
            {"writeback": True},
            {"writeback": False, "with_grads": True},
            {"writeback": True, "offload_to_cpu": True},
        ]
        model(self._input().to(self.device)).sum().backward()
        reference(self._input()).sum().backward()
        for options in option_sequence:
            with FSDP.summon_full_params(model, **options):
                for param in model.parameters():
                    param.detach().clone()
            self._assert_idle(model)
            self._train_step_and_compare(model, reference)
        self._assert_params_equal(model, reference)

    def test_body_raises_leaves_model_usable(self):
        """
        An exception inside the context leaves every rank idle, consistent and
        trainable.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES, "use_orig_params": [False, True]},
            self._test_body_raises_leaves_model_usable,
        )

    def _test_body_raises_leaves_model_usable(self, sharding_strategy, use_orig_params):
        reference = _make_reference()
        model = self._wrap(reference, sharding_strategy, use_orig_params)
        model(self._input().to(self.device)).sum().backward()
        reference(self._input()).sum().backward()
        option_sequence = [
            {"writeback": False, "offload_to_cpu": True, "with_grads": True},
            {"writeback": False, "rank0_only": True, "offload_to_cpu": True},
            {"writeback": True, "with_grads": True},
            {"writeback": False, "rank0_only": True},
        ]
        for options in option_sequence:
            raised = False
            try:
                with FSDP.summon_full_params(model, **options):
                    raise _BodyError
            except _BodyError:
                raised = True
            self.assertTrue(raised)
            self._assert_idle(model)
            self._train_step_and_compare(model, reference)
        self._assert_params_equal(model, reference)


if __name__ == "__main__":
    run_tests()
