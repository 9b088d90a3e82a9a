# Owner(s): ["oncall: distributed"]

import contextlib
import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
from torch.profiler import profile, ProfilerActivity
from torch.testing._internal.common_utils import run_tests

from common_fsdp_cpu import FSDPTestContinuousCPU

FULL, GRAD_OP = ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP
NO_SHARD, BOTH = ShardingStrategy.NO_SHARD, [False, True]
HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]


class _BodyError(Exception):
    pass


def _reference() -> nn.Module:
    torch.manual_seed(0)
    # Odd numels so that the last shard is padded
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


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


class _Rank0WritebackTest(FSDPTestContinuousCPU):
    def _wrap(self, reference: nn.Module, **kwargs) -> FSDP:
        """Nested FSDP: an inner unit for the first layer, the root for the rest."""
        if "device_mesh" not in kwargs:
            kwargs["process_group"] = self.process_group
        model = copy.deepcopy(reference)
        model[0] = FSDP(model[0], device_id=self.device, **kwargs)
        return FSDP(model, device_id=self.device, **kwargs)

    def _models(self, backward: bool, **kwargs) -> tuple[FSDP, nn.Module]:
        """The FSDP model and its reference, after a backward on the same batch."""
        reference = _reference()
        model = self._wrap(reference, **kwargs)
        inp = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
        for m, device in [(model, self.device), (reference, "cpu")][: 2 * backward]:
            m(inp.to(device)).sum().backward()
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
                self.assertTrue(torch.equal(p.cpu(), ref), f"rank {self.rank}: {p}")
                if with_grads and ref.grad is None:
                    self.assertIsNone(p.grad)
                elif with_grads:
                    self.assertTrue(torch.equal(p.grad.cpu(), ref.grad), f"{p.grad}")

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
        inp = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
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

    def _test_allocate_at_most_a_shard(self, with_grads: bool, **kwargs) -> None:
        """No allocation on the other ranks exceeds a shard; one unit dwarfs others."""
        torch.manual_seed(0)
        model = self._wrap(
            nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 3)), **kwargs
        )
        if with_grads:
            model(torch.randn(2, 256, device=self.device)).sum().backward()
        # Lazy initialization allocates on its own: keep it out of the measurement
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            pass
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
        with profile(activities=activities, profile_memory=True) as prof:
            with _summon_rank0(model, with_grads=with_grads):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        usage = "cpu" if self.device.type == "cpu" else "device"
        events = [e for e in prof.events() if e.name == "[memory]"]
        largest = max([getattr(e, f"{usage}_memory_usage") for e in events] + [0])
        handles = [m._handle for m in FSDP.fsdp_modules(model)]
        itemsize = handles[0].flat_param.element_size()
        shard = max(h.flat_param._local_shard.numel() for h in handles) * itemsize
        full = max(h.flat_param._padded_unsharded_size.numel() for h in handles)
        if self.rank == 0:
            self.assertGreaterEqual(largest, full * itemsize)
        else:
            self.assertLessEqual(largest, shard, f"rank {self.rank} (full: {full})")

    def _test_hybrid_shard(self, with_grads, **kwargs):
        # Rank 2, rank 0 of the other replica, must not keep a full copy either
        self._test_rank0_writeback(with_grads, offload_to_cpu=True, **kwargs)
        # Nor allocate one: only rank 0's replica gathers, to rank 0
        self._test_allocate_at_most_a_shard(with_grads, **kwargs)

    def _test_body_raises(self, with_grads, **kwargs):
        model, reference = self._models(with_grads, **kwargs)
        raises = self.assertRaisesRegex(_BodyError, "after the edit")
        with raises if self.rank == 0 else contextlib.nullcontext():
            with _summon_rank0(model, with_grads=with_grads):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
                    raise _BodyError("after the edit")
        self._check_idle_and_resharded(model)
        self._check_full(model, reference, with_grads)
        # Still usable, from the values from before
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

    def _test_collectives(self, fail, with_grads: bool) -> None:
        """
        Every unit's scatter starts before any is waited for; rank 0 frees once all
        finished, nothing if one failed (NCCL may still read the buffer), and the other
        units if freeing one fails; a rank without a gradient gets none on failure.
        """
        model, reference = self._models(backward=with_grads, use_orig_params=True)
        if self.rank != 0:
            model.zero_grad(set_to_none=True)
        scatter, reshard, events, failed = (
            dist.scatter,
            unshard_param_utils._reshard,
            [],
            [],
        )

        def recording_scatter(*args, **kwargs):
            n, work = events.count("scatter"), scatter(*args, **kwargs)
            events.append("scatter")
            # The first unit's parameter scatter fails, or each gradient scatter
            fails = fail == "scatter" and (n % 2 == 1 if with_grads else n == 0)

            def wait():
                work.wait()
                events.append("wait")
                if fails:
                    raise _BodyError("scatter failed")

            return mock.Mock(wait=wait)

        def recording_reshard(state, *args):
            events.append("reshard")
            if fail == "free" and "wait" in events and not failed:
                failed.append(state)
                raise _BodyError("free failed")
            return reshard(state, *args)

        raises = fail == "scatter" or (fail == "free" and self.rank == 0)
        with (
            mock.patch.object(dist, "scatter", recording_scatter),
            mock.patch.object(unshard_param_utils, "_reshard", recording_reshard),
            self.assertRaises(_BodyError) if raises else contextlib.nullcontext(),
        ):
            with _summon_rank0(model, with_grads=with_grads):
                events.clear()  # the other ranks reshard early, on entry
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        n, frees = 2 + 2 * with_grads, 2 * (self.rank == 0 and fail != "scatter")
        self.assertEqual(events, ["scatter"] * n + ["wait"] * n + ["reshard"] * frees)
        if fail == "scatter":
            failed = FSDP.fsdp_modules(model)
        for state in failed:  # left as the failure left it
            handle = state._handle
            self.assertEqual(
                handle._training_state, HandleTrainingState.SUMMON_FULL_PARAMS
            )
            allocated = handle.flat_param._full_param_padded.untyped_storage()
            self.assertEqual(allocated.size() > 0, self.rank == 0)
            if with_grads and self.rank != 0:
                self.assertIsNone(handle.flat_param.grad)
            unshard_param_utils._reshard(state, handle, True)
            handle._training_state = HandleTrainingState.IDLE
        self._check_idle_and_resharded(model)
        if fail != "scatter":
            _edit(list(reference.parameters()), with_grads)
            self._check_full(model, reference, with_grads)


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
        """If the body raises on rank 0 after editing, nothing is written back."""
        config = {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_body_raises, with_grads=False)

    def test_rank0_writeback_other_ranks_allocate_at_most_a_shard(self):
        config = {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_allocate_at_most_a_shard, with_grads=False)

    def test_rank0_writeback_padding_stays_zeros(self):
        """
        The last rank's shard padding stays zeros whatever rank 0's unsharded tensor
        holds there (uninitialized after ``to_cpu()`` on an accelerator).
        """
        config = {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_padding_stays_zeros, with_grads=False)

    def test_rank0_writeback_single_state(self):
        """``_unshard_fsdp_state_params()`` (state-dict paths) writes back one state."""
        for sharding_strategy in [FULL, NO_SHARD]:
            reference = _reference()
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

    def test_rank0_writeback_collectives(self):
        config = {"fail": [None, "scatter", "free"]}
        self.run_subtests(config, self._test_collectives, with_grads=False)

    def test_rank0_writeback_no_shard_cpu_offload_on_accelerator_raises(self):
        """
        ``NO_SHARD`` with ``CPUOffload(offload_params=True)`` on an accelerator would
        lose rank 0's edits on rank 0: every rank refuses it before any collective
        (the offload and the accelerator are faked on the handle, which is checked).
        """
        model, reference = self._models(backward=False, sharding_strategy=NO_SHARD)
        handle, names = model._handle, ["all_reduce", "broadcast", "gather", "scatter"]
        fake_offload = {"_offload_params": True, "device": torch.device("cuda")}
        no_collectives = {n: mock.Mock(side_effect=AssertionError) for n in names}
        with (
            mock.patch.multiple(handle, **fake_offload),
            mock.patch.multiple(dist, **no_collectives),
            self.assertRaisesRegex(NotImplementedError, "NO_SHARD and CPUOffload"),
            _summon_rank0(model),
        ):
            pass
        self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
        self._check_writeback(model, reference, with_grads=False)


class TestUnshardRank0WritebackHybrid(_Rank0WritebackTest):
    """Hybrid sharding on a 2 x 2 mesh: every replica gets rank 0's edits."""

    world_size = 4

    def test_rank0_writeback_hybrid_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        config = {"sharding_strategy": HYBRID, "use_orig_params": BOTH}
        self.run_subtests(
            config, self._test_hybrid_shard, device_mesh=mesh, with_grads=False
        )


if __name__ == "__main__":
    run_tests()
