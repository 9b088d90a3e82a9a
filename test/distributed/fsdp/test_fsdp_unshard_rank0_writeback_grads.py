# Owner(s): ["oncall: distributed"]

import torch
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp._flat_param import FlatParamHandle
from torch.testing._internal.common_utils import run_tests

from common_fsdp_unshard import batch
from test_fsdp_unshard_rank0_gather import _Rank0GatherTest
from test_fsdp_unshard_rank0_writeback import (
    _edit,
    _edits,
    _summon_rank0,
    BOTH,
    FULL,
    GRAD_OP,
    HYBRID,
    NO_SHARD,
)


class TestUnshardRank0WritebackGrads(_Rank0GatherTest):
    """
    ``summon_full_params(writeback=True, rank0_only=True, with_grads=True)`` on two
    ranks: rank 0's changes to the gradients reach every rank too.
    """

    world_size = 2
    points = {
        **_Rank0GatherTest.points,
        "grad_views": (FlatParamHandle, "_use_unsharded_grad_views", False, (0,)),
        "grad_free": (unshard_param_utils, "_reshard_grads", True, (0, 1)),
    }
    after_agreement = (*_Rank0GatherTest.after_agreement, "grad_free")

    def test_rank0_writeback_grads(self):
        """Rank 0's edits reach every rank, and training goes on from there."""
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP, NO_SHARD],
                "use_orig_params": BOTH,
                "offload_to_cpu": BOTH,
            },
            self._test_rank0_writeback,
            with_grads=True,
        )

    def test_rank0_writeback_grads_on_some_ranks(self):
        """
        A rank without a gradient receives rank 0's, with mixed precision too; without a
        gradient on any rank, the parameters are written back and no rank gets one.
        """
        self.run_subtests(
            {
                "sharding_strategy": [FULL, NO_SHARD],
                "use_orig_params": BOTH,
                "grad_on_rank0": BOTH,
                "mixed_precision": [None, MixedPrecision(param_dtype=torch.bfloat16)],
            },
            self._test_rank0_writeback_grads_on_some_ranks,
        )

    def _test_rank0_writeback_grads_on_some_ranks(self, grad_on_rank0, **kwargs):
        model, reference = self._models(backward=True, **kwargs)
        if self.rank != 0 or not grad_on_rank0:
            model.zero_grad(set_to_none=True)
        with _summon_rank0(model, with_grads=True):
            params = list(model.parameters())
            if self.rank == 0:
                self.assertEqual(
                    [p.grad is None for p in params], [not grad_on_rank0] * 3
                )
                _edit(params, with_grads=grad_on_rank0)
        self._check_idle_and_resharded(model)
        ref_params = list(reference.parameters())
        _edit(ref_params, with_grads=False)
        for ref, grad in zip(ref_params, _edits(ref_params, grads=True), strict=True):
            ref.grad = grad if grad_on_rank0 else None
        self._check_full(model, reference, with_grads=True)

    def test_rank0_writeback_grads_none_stays_none(self):
        """
        A rank whose gradient is None keeps None where rank 0 writes nothing into
        its shard, as with ``rank0_only=False``, and rank 0 keeps its gradient.
        """
        self.run_subtests(
            {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH},
            self._test_rank0_writeback_grads_none_stays_none,
        )

    def _test_rank0_writeback_grads_none_stays_none(self, **kwargs):
        grads = []
        for rank0_only in (True, False):
            model, _ = self._models(backward=True, **kwargs)
            if self.rank != 0:
                model.zero_grad(set_to_none=True)
            with FSDP.summon_full_params(
                model, writeback=True, rank0_only=rank0_only, with_grads=True
            ):
                pass
            self._check_idle_and_resharded(model)
            grads.append([p.grad for p in model.parameters()])
        self.assertEqual(grads[0], grads[1])
        nones = [g is None for g in grads[0]]
        self.assertTrue(all(nones) if self.rank else not all(nones))

    def test_rank0_writeback_grads_body_raises(self):
        config = {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_body_raises, with_grads=True)

    def test_rank0_writeback_grads_rank0_allocation_fails(self):
        config = {"sharding_strategy": [FULL], "fail_at": [0, 1]}
        self.run_subtests(config, self._test_rank0_allocation_fails, with_grads=True)

    def test_rank0_writeback_grads_other_dtype_raises(self):
        """
        A rank without a gradient would send zeros in the parameter's dtype, others
        theirs in bfloat16 (``keep_low_precision_grads``): every rank raises before
        any collective that moves data, with nothing changed and FSDP idle again.
        """
        self.run_subtests(
            {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH},
            self._test_rank0_writeback_grads_other_dtype_raises,
        )

    def _test_rank0_writeback_grads_other_dtype_raises(self, **kwargs):
        low = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        model, reference = self._models(backward=False, mixed_precision=low, **kwargs)
        model(batch().to(self.device)).sum().backward()
        if self.rank != 0:
            model.zero_grad(set_to_none=True)
        with self.assertRaisesRegex(NotImplementedError, "gradient in torch.float32"):
            with _summon_rank0(model, with_grads=True):
                if self.rank == 0:
                    _edit(list(model.parameters()))
        self._check_idle_and_resharded(model)
        self._check_full(model, reference)

    def test_rank0_writeback_grads_other_ranks_allocate_at_most_a_shard(self):
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP],
                "use_orig_params": BOTH,
            },
            self._test_allocate_at_most_a_shard,
            with_grads=True,
        )

    def test_rank0_writeback_grads_padding_stays_zeros(self):
        """The padding of the last rank's gradient shard stays zeros too."""
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP],
                "use_orig_params": BOTH,
            },
            self._test_padding_stays_zeros,
            with_grads=True,
        )

    def test_rank0_writeback_grads_failure(self):
        """
        A rank fails where gradients add a step: no rank hangs, and all agree on the
        gradients too.
        """
        failures = [("gather", 1), ("post_unshard", 0), ("early_free", 1)]
        failures += [("body", 1), ("scatter", 0)]
        failures += self._failures("grad_views", "grad_free")
        config = {"failure": failures, "nested": BOTH}
        self.run_subtests(config, self._test_failure_at, with_grads=True)

    def test_rank0_writeback_grads_collectives(self):
        config = {"fail": [None, "scatter"]}
        self.run_subtests(config, self._test_collectives, with_grads=True)


class TestUnshardRank0WritebackGradsHybrid(_Rank0GatherTest):
    """Hybrid sharding on a 2 x 2 mesh: every replica gets rank 0's gradients."""

    world_size = 4

    def test_rank0_writeback_grads_hybrid_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        config = {"sharding_strategy": HYBRID, "use_orig_params": BOTH}
        self.run_subtests(
            config, self._test_hybrid_shard, device_mesh=mesh, with_grads=True
        )


if __name__ == "__main__":
    run_tests()
