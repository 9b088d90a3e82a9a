# Owner(s): ["oncall: distributed"]

import contextlib
import copy
import sys
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
from torch.profiler import profile, ProfilerActivity
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

FULL, GRAD_OP, NO_SHARD = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
)
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


def _edit(params, with_grads: bool) -> None:
    with torch.no_grad():
        for p, value, grad in zip(
            params, _edits(params), _edits(params, True), strict=True
        ):
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
                self.assertEqual(
                    flat_param.data_ptr(), flat_param._local_shard.data_ptr()
                )

    def _check_full(self, model: FSDP, reference: nn.Module, with_grads: bool) -> None:
        """Every rank's full parameters (and gradients) are the reference's, bitwise."""
        with FSDP.summon_full_params(model, writeback=False, with_grads=with_grads):
            for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
                self.assertTrue(torch.equal(p.cpu(), ref), f"rank {self.rank}: {p}")
                if with_grads and ref.grad is None:
                    self.assertIsNone(p.grad)
                elif with_grads:
                    self.assertTrue(torch.equal(p.grad.cpu(), ref.grad), f"{p.grad}")

    def _check_writeback(
        self, model: FSDP, reference: nn.Module, with_grads: bool, **kwargs
    ) -> None:
        """
        Rank 0 edits the full parameters (and gradients); every rank has its edits,
        bitwise, and training from there matches ``reference`` given the same edits.
        """
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
                    for p in params:
                        p.fill_(123.0)
                        if p.grad is not None:
                            p.grad.fill_(123.0)
        self._check_idle_and_resharded(model)
        ref_params = list(reference.parameters())
        _edit(ref_params, with_grads)
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

    def _check_other_ranks_allocate_at_most_a_shard(
        self, with_grads: bool, **kwargs
    ) -> None:
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
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
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


class TestUnshardRank0Writeback(_Rank0WritebackTest):
    """``summon_full_params(writeback=True, rank0_only=True)`` on two ranks."""

    world_size = 2

    def test_rank0_writeback(self):
        """Rank 0's edits reach every rank, and training goes on from there."""
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP, NO_SHARD],
                "use_orig_params": [False, True],
                "offload_to_cpu": [False, True],
                "with_grads": [False, True],
            },
            self._test_rank0_writeback,
        )

    def test_rank0_writeback_grads_on_some_ranks(self):
        """
        A rank without a gradient receives rank 0's, with mixed precision too; without a
        gradient on any rank, the parameters are written back and no rank gets one.
        """
        self.run_subtests(
            {
                "sharding_strategy": [FULL, NO_SHARD],
                "use_orig_params": [True, False],
                "grad_on_rank0": [False, True],
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

    def test_rank0_writeback_body_raises(self):
        """If the body raises on rank 0 after editing, nothing is written back."""
        self.run_subtests(
            {
                "sharding_strategy": [FULL, NO_SHARD],
                "use_orig_params": [False, True],
                "with_grads": [False, True],
            },
            self._test_rank0_writeback_body_raises,
        )

    def _test_rank0_writeback_body_raises(self, with_grads, **kwargs):
        model, reference = self._models(with_grads, **kwargs)
        with (
            self.assertRaisesRegex(_BodyError, "after the edit")
            if self.rank == 0
            else contextlib.nullcontext()
        ):
            with _summon_rank0(model, with_grads=with_grads):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
                    raise _BodyError("after the edit")
        self._check_idle_and_resharded(model)
        self._check_full(model, reference, with_grads)
        # Still usable, from the values from before
        self._check_writeback(model, reference, with_grads)

    def test_rank0_writeback_other_ranks_allocate_at_most_a_shard(self):
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP],
                "use_orig_params": [False, True],
                "with_grads": [False, True],
            },
            self._check_other_ranks_allocate_at_most_a_shard,
        )

    def test_rank0_writeback_padding_stays_zeros(self):
        """
        The padding of the last rank's shard stays zeros whatever rank 0's padded
        unsharded tensors hold past the unpadded numel (uninitialized after
        ``to_cpu()`` on an accelerator; visible in the shard without
        ``use_orig_params``).
        """
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP],
                "use_orig_params": [False, True],
                "with_grads": [False, True],
            },
            self._test_rank0_writeback_padding_stays_zeros,
        )

    def _test_rank0_writeback_padding_stays_zeros(self, with_grads, **kwargs):
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
        zeros = torch.tensor(
            [int(all(not p.any() for p in paddings))], device=self.device
        )
        # Every rank fails together, so that none blocks in the next collective
        dist.all_reduce(zeros, op=dist.ReduceOp.MIN)
        self.assertTrue(zeros.item(), f"rank {self.rank}: paddings {paddings}")

    def test_rank0_writeback_single_state(self):
        """
        ``_unshard_fsdp_state_params()``, which the state-dict paths call without
        ``summon_full_params()``, writes back one state on its own.
        """
        for sharding_strategy in [FULL, NO_SHARD]:
            reference = _reference()
            model = FSDP(
                copy.deepcopy(reference),
                process_group=self.process_group,
                device_id=self.device,
                sharding_strategy=sharding_strategy,
            )
            with FSDP.summon_full_params(model):  # lazy initialization
                pass
            with unshard_param_utils._unshard_fsdp_state_params(
                model, model, True, True, offload_to_cpu=False, with_grads=False
            ):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads=False)
            self._check_idle_and_resharded(model)
            _edit(list(reference.parameters()), with_grads=False)
            self._check_full(model, reference, with_grads=False)

    def _patched_scatters(self, fails):
        """
        Records ``dist.scatter``'s works and when each is waited for; the n-th one
        raises once waited for if ``fails(n)``.
        """
        scatter, events = dist.scatter, []

        class Work:
            def __init__(self, work, fails):
                self.work, self.fails = work, fails

            def wait(self):
                self.work.wait()
                events.append("wait")
                if self.fails:
                    raise _BodyError("collective failed")

        def patched(*args, **kwargs):
            events.append("scatter")
            return Work(scatter(*args, **kwargs), fails(events.count("scatter") - 1))

        return mock.patch.object(dist, "scatter", patched), events

    def _reshard_by_hand(self, model: FSDP) -> None:
        for fsdp_module in FSDP.fsdp_modules(model):
            unshard_param_utils._reshard(fsdp_module, fsdp_module._handle, True)
            fsdp_module._handle._training_state = HandleTrainingState.IDLE

    def test_rank0_writeback_scatters_run_concurrently(self):
        """
        Every unit's scatter starts before any is waited for, and rank 0 frees only
        after all were waited for: never while a collective may read the buffer.
        """
        model, reference = self._models(backward=False)
        patch, events = self._patched_scatters(lambda n: False)
        reshard = unshard_param_utils._reshard

        def recording_reshard(*args):
            events.append("reshard")
            return reshard(*args)

        with (
            patch,
            mock.patch.object(unshard_param_utils, "_reshard", recording_reshard),
        ):
            with _summon_rank0(model):
                events.clear()  # the other ranks reshard early, on entry
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads=False)
        frees = ["reshard"] * 2 if self.rank == 0 else []
        self.assertEqual(events, ["scatter", "scatter", "wait", "wait"] + frees)
        self._check_idle_and_resharded(model)
        _edit(list(reference.parameters()), with_grads=False)
        self._check_full(model, reference, with_grads=False)

    def test_rank0_writeback_failed_collective_frees_nothing(self):
        """
        If a writeback collective fails, every rank raises once all finished, and
        frees nothing (with NCCL, it may still read the buffer); a rank without a
        gradient gets none from the failed gradient scatter.
        """
        for with_grads in [False, True]:
            model, _ = self._models(backward=True, use_orig_params=True)
            if self.rank != 0:
                model.zero_grad(set_to_none=True)
            # The first unit's parameter scatter fails, or each gradient scatter
            patch, events = self._patched_scatters(
                lambda n, grads=with_grads: n % 2 == 1 if grads else n == 0
            )
            with patch, self.assertRaisesRegex(_BodyError, "collective failed"):
                with _summon_rank0(model, with_grads=with_grads):
                    pass
            n = 2 + 2 * with_grads
            self.assertEqual(events, ["scatter"] * n + ["wait"] * n)
            for handle in [m._handle for m in FSDP.fsdp_modules(model)]:
                state = handle._training_state
                self.assertEqual(state, HandleTrainingState.SUMMON_FULL_PARAMS)
                allocated = handle.flat_param._full_param_padded.untyped_storage()
                self.assertEqual(allocated.size() > 0, self.rank == 0)
                if with_grads and self.rank != 0:
                    self.assertIsNone(handle.flat_param.grad)
            self._reshard_by_hand(model)
            self._check_idle_and_resharded(model)

    def test_rank0_writeback_cleanup_error_spares_other_units(self):
        """
        If freeing one unit raises on rank 0, the error reaches the caller, the other
        unit is freed and idle, and every rank has rank 0's edits.
        """
        model, reference = self._models(backward=False)
        reshard, failed = unshard_param_utils._reshard, []

        def failing_reshard(state, *args):
            if armed and self.rank == 0 and not failed:
                failed.append(state)
                raise _BodyError("reshard failed")
            return reshard(state, *args)

        armed = False
        with (
            mock.patch.object(unshard_param_utils, "_reshard", failing_reshard),
            self.assertRaises(_BodyError)
            if self.rank == 0
            else contextlib.nullcontext(),
        ):
            with _summon_rank0(model):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads=False)
                armed = True
        for fsdp_module in FSDP.fsdp_modules(model):
            state = fsdp_module._handle._training_state
            if fsdp_module in failed:  # left as the failure left it
                self.assertEqual(state, HandleTrainingState.SUMMON_FULL_PARAMS)
                self._reshard_by_hand(fsdp_module)
        self.assertEqual(len(failed), int(self.rank == 0))
        self._check_idle_and_resharded(model)
        _edit(list(reference.parameters()), with_grads=False)
        self._check_full(model, reference, with_grads=False)

    def test_rank0_writeback_no_shard_cpu_offload_on_accelerator_raises(self):
        """
        ``NO_SHARD`` with ``CPUOffload(offload_params=True)`` on an accelerator would
        lose rank 0's edits on rank 0 (resharding restores its CPU copy): every rank
        refuses it before any collective. The offload and the accelerator are faked
        on the handle, which the check reads.
        """
        model, reference = self._models(backward=False, sharding_strategy=NO_SHARD)
        handle = model._handle
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(handle, "_offload_params", True))
            stack.enter_context(
                mock.patch.object(handle, "device", torch.device("cuda"))
            )
            for name in ["all_reduce", "broadcast", "gather", "scatter", "barrier"]:
                stack.enter_context(
                    mock.patch.object(dist, name, side_effect=AssertionError)
                )
            with self.assertRaisesRegex(NotImplementedError, "NO_SHARD and CPUOffload"):
                with _summon_rank0(model):
                    pass
        self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
        self._check_writeback(model, reference, with_grads=False)


class TestUnshardRank0WritebackHybrid(_Rank0WritebackTest):
    """Hybrid sharding on a 2 x 2 mesh: every replica gets rank 0's edits."""

    world_size = 4

    def test_rank0_writeback_hybrid_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        self.run_subtests(
            {
                "sharding_strategy": HYBRID,
                "use_orig_params": [False, True],
                "with_grads": [False, True],
            },
            self._test_rank0_writeback_hybrid_shard,
            device_mesh=mesh,
        )

    def _test_rank0_writeback_hybrid_shard(self, with_grads, **kwargs):
        # Rank 2, rank 0 of the other replica, must not keep a full copy either
        self._test_rank0_writeback(with_grads, offload_to_cpu=True, **kwargs)
        # Nor allocate one: only rank 0's replica gathers, to rank 0
        self._check_other_ranks_allocate_at_most_a_shard(with_grads, **kwargs)


if __name__ == "__main__":
    run_tests()
