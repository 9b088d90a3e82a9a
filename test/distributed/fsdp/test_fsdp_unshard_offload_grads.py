# Owner(s): ["oncall: distributed"]

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
)
from torch.testing._internal.common_utils import run_tests, TEST_WITH_DEV_DBG_ASAN

from common_fsdp_unshard import batch, BodyError, FSDPUnshardTest, reference_model
from test_fsdp_unshard_grad_dtype import check_zeros_in_param_dtype

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


class TestUnshardOffloadAndGrads(FSDPUnshardTest):
    """
    ``offload_to_cpu`` with ``NO_SHARD``, and ``with_grads`` with ``offload_to_cpu`` or
    flat parameters.
    """

    world_size = 2

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
        loss = model(batch().to(self.device)).sum()
        ref_loss = reference(batch()).sum()
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
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=ShardingStrategy.NO_SHARD,
            use_orig_params=use_orig_params,
        )
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
        self._check_idle_and_resharded(model)
        if writeback:
            with torch.no_grad():
                for ref_param in reference.parameters():
                    ref_param.add_(1.0)
        self._check_full(model, reference)
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
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        model(batch().to(self.device)).sum().backward()
        reference(batch()).sum().backward()
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
        self._check_idle_and_resharded(model)
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
        reference = reference_model()
        model = self._wrap(
            reference, sharding_strategy=sharding_strategy, use_orig_params=False
        )
        for module in (model, reference):
            module(batch().to(self.device)).sum().backward()
            torch.optim.SGD(module.parameters(), lr=0.1).step()
        with FSDP.summon_full_params(
            model, writeback=False, offload_to_cpu=offload_to_cpu, with_grads=True
        ):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.cpu(), ref_param)
                self.assertEqual(param.grad.cpu(), ref_param.grad)
        self._check_idle_and_resharded(model)

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
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        option_sequence = [
            {"writeback": True, "offload_to_cpu": True, "with_grads": True},
            {"writeback": False, "rank0_only": True},
            {"writeback": False, "rank0_only": True, "offload_to_cpu": True},
            {"writeback": True, "offload_to_cpu": True, "recurse": False},
            {"writeback": True},
            {"writeback": False, "with_grads": True},
            {"writeback": True, "offload_to_cpu": True},
        ]
        model(batch().to(self.device)).sum().backward()
        reference(batch()).sum().backward()
        for options in option_sequence:
            with FSDP.summon_full_params(model, **options):
                for param in model.parameters():
                    param.detach().clone()
            self._check_idle_and_resharded(model)
            self._train_step_and_compare(model, reference)
        self._check_full(model, reference)

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
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        model(batch().to(self.device)).sum().backward()
        reference(batch()).sum().backward()
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
                    raise BodyError
            except BodyError:
                raised = True
            self.assertTrue(raised)
            self._check_idle_and_resharded(model)
            self._train_step_and_compare(model, reference)
        self._check_full(model, reference)

    def test_with_grads_zeros_in_param_dtype(self):
        """
        With flat parameters too, a rank without a gradient sends zeros in the
        parameter's dtype.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES[:2], "use_orig_params": [False]},
            check_zeros_in_param_dtype,
            self,
        )

    def test_with_grads_other_dtype_raises(self):
        """
        Gradients in another dtype than the parameter (``keep_low_precision_grads``)
        raise on every rank before any gradient moves, leaving FSDP idle.
        """
        self.run_subtests(
            {"use_orig_params": [False, True], "writeback": [False, True]},
            self._test_with_grads_other_dtype_raises,
        )

    def _test_with_grads_other_dtype_raises(self, use_orig_params, writeback):
        low = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        model, reference = self._models(
            backward=False, use_orig_params=use_orig_params, mixed_precision=low
        )
        model(batch().to(self.device)).sum().backward()
        with self.assertRaisesRegex(NotImplementedError, "gradient in torch.float32"):
            with FSDP.summon_full_params(model, writeback=writeback, with_grads=True):
                pass
        self._check_idle_and_resharded(model)
        self._check_full(model, reference)


if __name__ == "__main__":
    run_tests()
