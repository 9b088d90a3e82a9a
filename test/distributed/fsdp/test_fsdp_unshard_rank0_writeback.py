# Owner(s): ["oncall: distributed"]

import contextlib
import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp._common_utils import HandleTrainingState
from torch.distributed.fsdp._flat_param import FlatParamHandle
from torch.testing._internal.common_utils import run_tests

from common_fsdp_unshard import batch, BodyError, FSDPUnshardTest, reference_model

FULL, GRAD_OP = ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP
NO_SHARD, BOTH = ShardingStrategy.NO_SHARD, [False, True]
HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]


def _edits(params, grads: bool = False) -> list[torch.Tensor]:
    """What rank 0 writes into the full parameters (or gradients): new values."""
    scale, offset = (-0.125, 1.0) if grads else (0.25, -3.0)
    return [torch.arange(p.numel()).view(p.shape) * scale + offset for p in params]


def _edit(params, with_grads: bool = False) -> None:
    with torch.no_grad():
        edits = zip(params, _edits(params), _edits(params, True), strict=True)
        for p, value, grad in edits:
            p.copy_(value.to(p.device))
            if with_grads:
                p.grad.copy_(grad.to(p.device))


def _summon_rank0(model: FSDP, **kwargs):
    return FSDP.summon_full_params(model, writeback=True, rank0_only=True, **kwargs)


# What the other ranks raise when the writeback failed on one rank
FAILED_ELSEWHERE = "failed on another rank .*: nothing was written back"


class _Rank0WritebackTest(FSDPUnshardTest):
    def _check_writeback(self, model, reference, with_grads: bool, **kwargs) -> None:
        """Rank 0's edits reach every rank bitwise; training goes on as reference's."""
        with _summon_rank0(model, with_grads=with_grads, **kwargs):
            params = list(model.parameters())
            if self.rank == 0:
                _edit(params, with_grads)
            else:
                # The other ranks never hold the unsharded parameters, and their
                # changes are discarded
                for handle in [m._handle for m in FSDP.fsdp_modules(model)]:
                    if handle.uses_sharded_strategy:
                        storage = handle.flat_param._full_param_padded.untyped_storage()
                        self.assertEqual(storage.size(), 0)
                with torch.no_grad():
                    for t in params + [p.grad for p in params if p.grad is not None]:
                        t.fill_(123.0)
        self._check_idle_and_resharded(model)
        _edit(list(reference.parameters()), with_grads)
        self._check_full(model, reference, with_grads)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        inp = batch(2)
        for _ in range(2):
            # With gradients, the first step uses the written-back ones
            if with_grads:
                optim.step()
                ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            loss, ref_loss = model(inp.to(self.device)).sum(), reference(inp).sum()
            self.assertEqual(loss.cpu(), ref_loss)
            loss.backward()
            ref_loss.backward()
            with_grads = True

    def _test_rank0_writeback(self, with_grads, offload_to_cpu, **kwargs):
        model, reference = self._models(with_grads, **kwargs)
        if not with_grads:
            # A forward without backward leaves the root's unsharded parameter
            # allocated: it must not go stale on the ranks that did not edit it
            with torch.no_grad():
                model(torch.randn(4, 5, device=self.device))
        self._check_writeback(
            model, reference, with_grads, offload_to_cpu=offload_to_cpu
        )

    def _test_body_raises(self, with_grads, **kwargs):
        """
        Rank 1 changes what it holds while rank 0's body raises after its edit: every
        rank raises and nothing is written back. With ``NO_SHARD``, every rank has the
        parameters from before again (rank 0's); with sharding, rank 1 keeps its change
        to its shard, as with ``writeback=False``. Then FSDP is still usable.
        """
        model, reference = self._models(with_grads, **kwargs)
        before = [p.detach().clone() for p in model.parameters()]
        raises = self.assertRaisesRegex(BodyError, "after the edit")
        if self.rank != 0:
            raises = self.assertRaisesRegex(RuntimeError, FAILED_ELSEWHERE)
        with raises:
            with _summon_rank0(model, with_grads=with_grads), torch.no_grad():
                params = list(model.parameters())
                if self.rank == 0:
                    _edit(params, with_grads)
                    raise BodyError("after the edit")
                for p in params:
                    p.fill_(123.0)
        self._check_idle_and_resharded(model)
        if kwargs["sharding_strategy"] == NO_SHARD:
            self._check_full(model, reference, with_grads)
        else:
            if self.rank != 0:
                before = [torch.full_like(p, 123.0) for p in before]
            for p, expected in zip(model.parameters(), before, strict=True):
                self.assertEqual(p, expected, atol=0, rtol=0)
        self._check_writeback(model, reference, with_grads)

    def _test_rank0_allocation_fails(self, with_grads, fail_at, **kwargs):
        """
        Rank 0 fails to allocate a unit's unsharded parameter (out of memory), the
        first unit's or the second's: every rank raises before that unit's gather,
        with nothing changed and FSDP idle again.
        """
        model, reference = self._models(with_grads, **kwargs)
        alloc, calls = FlatParamHandle._alloc_padded_unsharded_flat_param, []

        def failing_alloc(handle):
            if handle not in calls:  # a unit's first allocation
                calls.append(handle)
                if len(calls) == fail_at + 1:
                    raise torch.OutOfMemoryError("rank 0 is out of memory")
            return alloc(handle)

        name = "_alloc_padded_unsharded_flat_param"
        fails = mock.patch.object(FlatParamHandle, name, failing_alloc)
        if self.rank == 0:
            raises = self.assertRaisesRegex(torch.OutOfMemoryError, "out of memory")
        else:
            raises = self.assertRaisesRegex(RuntimeError, FAILED_ELSEWHERE)
        with fails if self.rank == 0 else contextlib.nullcontext(), raises:
            with _summon_rank0(model, with_grads=with_grads):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        self._check_idle_and_resharded(model)
        self._check_full(model, reference, with_grads)
        self._check_writeback(model, reference, with_grads)

    def _test_padding_stays_zeros(self, with_grads, **kwargs):
        model, _ = self._models(backward=True, **kwargs)
        handles = [m._handle for m in FSDP.fsdp_modules(model)]
        if self.rank == 1 and not kwargs["use_orig_params"]:
            self.assertTrue(any(h.flat_param._shard_numel_padded for h in handles))
        with _summon_rank0(model, with_grads=with_grads):
            for flat_param in [h.flat_param for h in handles if self.rank == 0]:
                numel = flat_param._unpadded_unsharded_size.numel()
                flat_param._full_param_padded[numel:].fill_(float("nan"))
                if with_grads:  # a view into the padded unsharded gradient
                    storage = flat_param.grad.untyped_storage()
                    flat_param.grad.new_empty(0).set_(storage)[numel:].fill_(1.0)
        self._check_idle_and_resharded(model)
        paddings = []
        for flat_param in [h.flat_param for h in handles]:
            for shard in [flat_param._local_shard, flat_param.grad][: 1 + with_grads]:
                paddings.append(shard[shard.numel() - flat_param._shard_numel_padded :])
        zeros = torch.tensor([int(all(not p.any() for p in paddings))])
        # Every rank fails together, so that none blocks in the next collective
        dist.all_reduce(zeros := zeros.to(self.device), op=dist.ReduceOp.MIN)
        self.assertTrue(zeros.item(), f"rank {self.rank}: paddings {paddings}")


class TestUnshardRank0Writeback(_Rank0WritebackTest):
    """``summon_full_params(writeback=True, rank0_only=True)`` on two ranks."""

    world_size = 2

    def test_rank0_writeback(self):
        """Rank 0's edits reach every rank, and training goes on from there."""
        strategies = [FULL, GRAD_OP, NO_SHARD]
        config = dict(
            sharding_strategy=strategies, use_orig_params=BOTH, offload_to_cpu=BOTH
        )
        self.run_subtests(config, self._test_rank0_writeback, with_grads=False)

    def test_rank0_writeback_body_raises(self):
        config = {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_body_raises, with_grads=False)

    def test_rank0_writeback_padding_stays_zeros(self):
        """The last rank's shard padding stays zeros, whatever rank 0's holds there."""
        config = {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_padding_stays_zeros, with_grads=False)

    def test_rank0_writeback_rank0_allocation_fails(self):
        config = {"sharding_strategy": [FULL, GRAD_OP], "fail_at": [0, 1]}
        self.run_subtests(config, self._test_rank0_allocation_fails, with_grads=False)

    def test_rank0_writeback_single_state(self):
        """``_unshard_fsdp_state_params()`` (state-dict paths) writes back one state."""
        for sharding_strategy in [FULL, NO_SHARD]:
            reference = reference_model()
            kwargs = {"device_id": self.device, "sharding_strategy": sharding_strategy}
            model = FSDP(copy.deepcopy(reference), self.process_group, **kwargs)
            with FSDP.summon_full_params(model):  # lazy initialization
                pass
            with unshard_param_utils._unshard_fsdp_state_params(
                model, model, True, True, offload_to_cpu=False, with_grads=False
            ):
                if self.rank == 0:
                    _edit(list(model.parameters()))
            self._check_idle_and_resharded(model)
            _edit(list(reference.parameters()))
            self._check_full(model, reference)

    def test_rank0_writeback_no_shard_cpu_offload_on_accelerator_raises(self):
        """
        ``NO_SHARD`` with ``CPUOffload(offload_params=True)`` on an accelerator: every
        rank refuses it before any collective (faked on the handle, which is checked).
        """
        model, reference = self._models(backward=False, sharding_strategy=NO_SHARD)
        handle, names = model._handle, ["all_reduce", "broadcast", "gather", "scatter"]
        fake_offload = {"_offload_params": True, "device": torch.device("cuda")}
        no_collectives = {n: mock.Mock(side_effect=AssertionError) for n in names}
        with (
            mock.patch.multiple(handle, **fake_offload),
            mock.patch.multiple(dist, **no_collectives),
            self.assertRaisesRegex(NotImplementedError, "is not supported yet"),
            _summon_rank0(model),
        ):
            pass
        self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
        self._check_writeback(model, reference, with_grads=False)


if __name__ == "__main__":
    run_tests()
