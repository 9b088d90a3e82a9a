# Owner(s): ["oncall: distributed"]

import contextlib
import copy
import sys
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
from torch.distributed.fsdp._unshard_param_utils import _unshard_fsdp_state_params
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


class _BodyError(Exception):
    pass


def _make_reference() -> nn.Module:
    torch.manual_seed(0)
    # Odd numels so that the last shard is padded
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


def _wrap(reference: nn.Module, **fsdp_kwargs) -> FSDP:
    """Nested FSDP: an inner unit for the first linear layer, the root for the rest."""
    model = copy.deepcopy(reference)
    model[0] = FSDP(model[0], **fsdp_kwargs)
    return FSDP(model, **fsdp_kwargs)


def _edited_values(params) -> list[torch.Tensor]:
    """
    What rank 0 writes into the full parameters: distinct values that no rank holds
    before.
    """
    return [
        torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.25 - 3.0
        for p in params
    ]


def _grad_values(params) -> list[torch.Tensor]:
    """
    What rank 0 writes into the full gradients: distinct values, none a parameter's.
    """
    return [
        torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * -0.125 + 1.0
        for p in params
    ]


def _backward(model: nn.Module, device: torch.device) -> None:
    """
    A forward and backward on the same input on every rank: every rank has a gradient.
    """
    inp = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    model(inp.to(device)).sum().backward()


def _largest_allocation_bytes(prof: profile, device: torch.device) -> int:
    """
    The largest single allocation on ``device`` while profiling with
    ``profile_memory=True``.
    """
    sizes = [
        event.cpu_memory_usage if device.type == "cpu" else event.device_memory_usage
        for event in prof.events()
        if event.name == "[memory]"
    ]
    return max(sizes, default=0)


class _Rank0WritebackTest(FSDPTestContinuousCPU):
    """The checks that the two- and four-rank test classes share."""

    def _check_rank0_writeback(
        self, model: FSDP, offload_to_cpu: bool, is_src: bool
    ) -> None:
        """
        Rank 0 edits the full parameters with ``writeback=True, rank0_only=True``; every
        rank sees them after.
        """
        with FSDP.summon_full_params(
            model, writeback=True, rank0_only=True, offload_to_cpu=offload_to_cpu
        ):
            params = list(model.parameters())
            with torch.no_grad():
                if is_src:
                    expected = _edited_values(params)
                    for param, value in zip(params, expected, strict=True):
                        param.copy_(value.to(param.device))
                else:
                    # The other ranks never hold the unsharded parameters, and what they
                    # change is discarded
                    for fsdp_module in FSDP.fsdp_modules(model):
                        handle = fsdp_module._handle
                        if handle.uses_sharded_strategy:
                            self.assertEqual(
                                handle.flat_param._full_param_padded.untyped_storage().size(),
                                0,
                            )
                    for param in params:
                        param.fill_(123.0)
        self._check_idle_and_resharded(model)
        with FSDP.summon_full_params(model, writeback=False):
            params = list(model.parameters())
            for param, value in zip(params, _edited_values(params), strict=True):
                self.assertTrue(
                    torch.equal(param.cpu(), value),
                    f"rank {self.rank}: {param} != {value}",
                )

    def _check_rank0_grad_writeback(
        self, model: FSDP, reference: nn.Module, offload_to_cpu: bool, is_src: bool
    ) -> None:
        """
        Rank 0 edits the full parameters and gradients with ``with_grads=True,
        writeback=True, rank0_only=True``; every rank has them after, bitwise, and an
        optimizer step and a training step after match ``reference`` (the unwrapped
        model) given the same edits.
        """
        with FSDP.summon_full_params(
            model,
            writeback=True,
            rank0_only=True,
            offload_to_cpu=offload_to_cpu,
            with_grads=True,
        ):
            params = list(model.parameters())
            with torch.no_grad():
                if is_src:
                    for param, value, grad in zip(
                        params,
                        _edited_values(params),
                        _grad_values(params),
                        strict=True,
                    ):
                        param.copy_(value.to(param.device))
                        param.grad.copy_(grad.to(param.device))
                else:
                    for param in params:
                        param.fill_(123.0)
                        if param.grad is not None:
                            param.grad.fill_(123.0)
        self._check_idle_and_resharded(model)
        ref_params = list(reference.parameters())
        with torch.no_grad():
            for param, value, grad in zip(
                ref_params,
                _edited_values(ref_params),
                _grad_values(ref_params),
                strict=True,
            ):
                param.copy_(value)
                param.grad = grad
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            for param, ref_param in zip(model.parameters(), ref_params, strict=True):
                self.assertTrue(
                    torch.equal(param.cpu(), ref_param),
                    f"rank {self.rank}: {param} != {ref_param}",
                )
                self.assertTrue(
                    torch.equal(param.grad.cpu(), ref_param.grad),
                    f"rank {self.rank}: {param.grad}",
                )
        # The optimizer steps with the written-back gradients on every rank's shard
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        optim.step()
        ref_optim.step()
        with FSDP.summon_full_params(model, writeback=False):
            for param, ref_param in zip(model.parameters(), ref_params, strict=True):
                self.assertTrue(
                    torch.equal(param.cpu(), ref_param),
                    f"rank {self.rank}: {param} != {ref_param}",
                )
        optim.zero_grad()
        ref_optim.zero_grad()
        inp = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
        for _ in range(2):
            loss = model(inp.to(self.device)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            ref_loss = reference(inp).sum()
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
            self.assertEqual(loss.cpu(), ref_loss)

    def _check_idle_and_resharded(self, model: FSDP) -> None:
        """
        After a ``writeback=True, rank0_only=True`` context, every rank (the source too)
        is idle and sharded.
        """
        for fsdp_module in FSDP.fsdp_modules(model):
            self.assertEqual(fsdp_module.training_state, TrainingState.IDLE)
            handle = fsdp_module._handle
            self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
            if handle.uses_sharded_strategy:
                self.assertEqual(
                    handle.flat_param._full_param_padded.untyped_storage().size(), 0
                )
                self.assertEqual(
                    handle.flat_param.data_ptr(),
                    handle.flat_param._local_shard.data_ptr(),
                )

    def _check_other_ranks_allocate_at_most_a_shard(
        self, model: FSDP, is_src: bool, with_grads: bool = False
    ) -> None:
        """
        With ``writeback=True, rank0_only=True``, only the source materializes the
        unsharded flat parameters: on entry the other ranks send it their shards instead
        of all-gathering, and upon exit they receive their shard in place, so none of
        their allocations exceeds a shard. ``model`` is sharded (no forward ran) and has
        one FSDP unit whose unsharded flat parameter dwarfs the rest. With
        ``with_grads``, the gradients too, after a backward.
        """
        if with_grads:
            model(torch.randn(2, 256, device=self.device)).sum().backward()
        # Lazy initialization allocates and frees on its own: keep it out of the
        # measurement
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            pass
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities, profile_memory=True) as prof:
            with FSDP.summon_full_params(
                model, writeback=True, rank0_only=True, with_grads=with_grads
            ):
                if is_src:
                    with torch.no_grad():
                        for param in model.parameters():
                            param.mul_(2.0)
                            if with_grads:
                                param.grad.mul_(2.0)
        largest = _largest_allocation_bytes(prof, self.device)
        handles = [m._handle for m in FSDP.fsdp_modules(model)]
        itemsize = handles[0].flat_param.element_size()
        shard_bytes = max(h.flat_param._local_shard.numel() for h in handles) * itemsize
        unsharded_bytes = (
            max(h.flat_param._padded_unsharded_size.numel() for h in handles) * itemsize
        )
        if is_src:
            # The measurement sees the source's unsharded flat parameter
            self.assertGreaterEqual(largest, unsharded_bytes)
        else:
            self.assertLessEqual(
                largest,
                shard_bytes,
                f"rank {self.rank} allocated {largest} bytes "
                f"(unsharded: {unsharded_bytes})",
            )


class TestUnshardRank0Writeback(_Rank0WritebackTest):
    """
    ``summon_full_params(writeback=True, rank0_only=True)`` on two ranks (gloo on CPU
    included).
    """

    world_size = 2

    def test_rank0_writeback(self):
        """
        What rank 0 changes is on every rank afterwards, bitwise, and training goes on
        from there.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
                "offload_to_cpu": [False, True],
            },
            self._test_rank0_writeback,
        )

    def _test_rank0_writeback(self, sharding_strategy, use_orig_params, offload_to_cpu):
        reference = _make_reference()
        model = _wrap(
            reference,
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        inp = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
        # A forward without backward leaves the root's unsharded parameter allocated, to
        # be reused by the next forward: it must not go stale on the ranks that did not
        # make the change.
        with torch.no_grad():
            model(inp.to(self.device))
        self._check_rank0_writeback(model, offload_to_cpu, is_src=self.rank == 0)
        with torch.no_grad():
            for param, value in zip(
                reference.parameters(),
                _edited_values(list(reference.parameters())),
                strict=True,
            ):
                param.copy_(value)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(inp.to(self.device)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            ref_loss = reference(inp).sum()
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
            self.assertEqual(loss.cpu(), ref_loss)

    def test_rank0_writeback_other_ranks_allocate_at_most_a_shard(self):
        """
        Rank 1 never materializes an unsharded flat parameter or gradient: none of its
        allocations exceeds one shard.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
                "use_orig_params": [False, True],
                "with_grads": [False, True],
            },
            self._test_rank0_writeback_other_ranks_allocate_at_most_a_shard,
        )

    def _test_rank0_writeback_other_ranks_allocate_at_most_a_shard(
        self, sharding_strategy, use_orig_params, with_grads
    ):
        torch.manual_seed(0)
        model = _wrap(
            nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 3)),
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        self._check_other_ranks_allocate_at_most_a_shard(
            model, is_src=self.rank == 0, with_grads=with_grads
        )

    def test_rank0_writeback_body_raises(self):
        """
        If the body raises on rank 0 after a partial change, no rank writes back
        anything and none hangs.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
            },
            self._test_rank0_writeback_body_raises,
        )

    def _test_rank0_writeback_body_raises(self, sharding_strategy, use_orig_params):
        reference = _make_reference()
        model = _wrap(
            reference,
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        raised = False
        try:
            with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                if self.rank == 0:
                    with torch.no_grad():
                        next(iter(model.parameters())).fill_(7.0)
                    raise _BodyError
        except _BodyError:
            raised = True
        self.assertEqual(raised, self.rank == 0)
        for fsdp_module in FSDP.fsdp_modules(model):
            self.assertEqual(fsdp_module.training_state, TrainingState.IDLE)
            self.assertEqual(
                fsdp_module._handle._training_state, HandleTrainingState.IDLE
            )
        with FSDP.summon_full_params(model, writeback=False):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertTrue(torch.equal(param.cpu(), ref_param))
        # The model is still usable, with the values from before the context
        self._check_rank0_writeback(model, offload_to_cpu=False, is_src=self.rank == 0)

    def test_rank0_writeback_single_state(self):
        """
        ``_unshard_fsdp_state_params()``, which the state-dict paths share, writes back
        rank 0's change to one FSDP state when called on its own, without
        ``summon_full_params()``.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.NO_SHARD,
                ]
            },
            self._test_rank0_writeback_single_state,
        )

    def _test_rank0_writeback_single_state(self, sharding_strategy):
        model = FSDP(
            _make_reference(),
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
        )
        # Lazy initialization, as `summon_full_params()` does it before unsharding
        with FSDP.summon_full_params(model, writeback=False):
            pass
        with _unshard_fsdp_state_params(
            model,
            model,
            writeback=True,
            rank0_only=True,
            offload_to_cpu=False,
            with_grads=False,
        ):
            if self.rank == 0:
                with torch.no_grad():
                    for param, value in zip(
                        model.parameters(),
                        _edited_values(list(model.parameters())),
                        strict=True,
                    ):
                        param.copy_(value.to(param.device))
        self._check_idle_and_resharded(model)
        with FSDP.summon_full_params(model, writeback=False):
            params = list(model.parameters())
            for param, value in zip(params, _edited_values(params), strict=True):
                self.assertTrue(
                    torch.equal(param.cpu(), value),
                    f"rank {self.rank}: {param} != {value}",
                )

    def test_rank0_writeback_scatters_run_concurrently(self):
        """
        Every unit's scatter is started before any is waited for, and rank 0 frees an
        unsharded flat parameter only after all of them were waited for: never while a
        collective may still read it.
        """
        events = []

        class RecordingWork:
            def __init__(self, work: dist.Work) -> None:
                self._work = work

            def wait(self, *args, **kwargs):
                events.append("wait")
                return self._work.wait(*args, **kwargs)

        scatter, reshard = dist.scatter, unshard_param_utils._reshard

        def recording_scatter(*args, **kwargs):
            work = scatter(*args, **kwargs)
            events.append("scatter" if work is not None else "blocking scatter")
            return RecordingWork(work) if work is not None else None

        def recording_reshard(*args, **kwargs):
            events.append("reshard")
            return reshard(*args, **kwargs)

        model = _wrap(
            _make_reference(), process_group=self.process_group, device_id=self.device
        )
        with FSDP.summon_full_params(model, writeback=False):
            pass
        events.clear()
        with (
            mock.patch.object(dist, "scatter", recording_scatter),
            mock.patch.object(unshard_param_utils, "_reshard", recording_reshard),
        ):
            with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                # What the other ranks reshard early is not the point here
                events.clear()
                if self.rank == 0:
                    with torch.no_grad():
                        for param, value in zip(
                            model.parameters(),
                            _edited_values(list(model.parameters())),
                            strict=True,
                        ):
                            param.copy_(value.to(param.device))
        # Two units (the inner one and the root): two scatters, then the waits, then (on
        # rank 0) the frees
        expected = ["scatter", "scatter", "wait", "wait"] + (
            ["reshard", "reshard"] if self.rank == 0 else []
        )
        self.assertEqual(events, expected)
        self._check_idle_and_resharded(model)

    def test_rank0_writeback_cleanup_error_spares_other_units(self):
        """
        If freeing one unit's unsharded parameter raises on rank 0 after the writeback,
        the error reaches the caller, the other unit is still resharded and idle, and
        every rank has rank 0's change.
        """
        model = _wrap(
            _make_reference(), process_group=self.process_group, device_id=self.device
        )
        with FSDP.summon_full_params(model, writeback=False):
            pass
        reshard = unshard_param_utils._reshard
        armed = False
        failed = []

        def failing_reshard(state, handle, *args, **kwargs):
            # The first reshard on rank 0 after the body fails (the other ranks reshard
            # early, on entry)
            if armed and self.rank == 0 and not failed:
                failed.append(state)
                raise _BodyError("reshard failed")
            return reshard(state, handle, *args, **kwargs)

        raised = False
        with mock.patch.object(unshard_param_utils, "_reshard", failing_reshard):
            try:
                with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                    params = list(model.parameters())
                    if self.rank == 0:
                        with torch.no_grad():
                            for param, value in zip(
                                params, _edited_values(params), strict=True
                            ):
                                param.copy_(value.to(param.device))
                    armed = True
            except _BodyError:
                raised = True
        self.assertEqual(raised, self.rank == 0)
        self.assertEqual(len(failed), int(self.rank == 0))
        spared = [m for m in FSDP.fsdp_modules(model) if m not in failed]
        self.assertEqual(len(spared), 2 - len(failed))
        for fsdp_module in spared:
            self.assertEqual(
                fsdp_module._handle._training_state, HandleTrainingState.IDLE
            )
            self.assertEqual(
                fsdp_module._handle.flat_param._full_param_padded.untyped_storage().size(),
                0,
            )
        for fsdp_module in failed:
            # Left as the failure left it; finish its reshard by hand to read the
            # parameters below
            self.assertEqual(
                fsdp_module._handle._training_state,
                HandleTrainingState.SUMMON_FULL_PARAMS,
            )
            reshard(fsdp_module, fsdp_module._handle, True)
            fsdp_module._handle._training_state = HandleTrainingState.IDLE
        with FSDP.summon_full_params(model, writeback=False):
            params = list(model.parameters())
            for param, value in zip(params, _edited_values(params), strict=True):
                self.assertTrue(
                    torch.equal(param.cpu(), value),
                    f"rank {self.rank}: {param} != {value}",
                )

    def test_rank0_writeback_failed_collective_frees_nothing(self):
        """
        If waiting for a writeback collective fails, the error reaches every rank and
        rank 0 frees nothing: with NCCL, the collective may still be reading the
        unsharded parameter. The other units' collectives are waited for first, so that
        no rank frees or reuses a buffer that one of them still sends from.
        """
        model = _wrap(
            _make_reference(), process_group=self.process_group, device_id=self.device
        )
        with FSDP.summon_full_params(model, writeback=False):
            pass
        scatter = dist.scatter
        started = []
        waited = []

        class FailingWork:
            """The first unit's scatter fails once it finished; the others succeed."""

            def __init__(self, work: dist.Work, fails: bool) -> None:
                self._work = work
                self._fails = fails

            def wait(self, *args, **kwargs):
                self._work.wait(*args, **kwargs)
                waited.append(self)
                if self._fails:
                    raise _BodyError("collective failed")

        def failing_scatter(*args, **kwargs):
            work = scatter(*args, **kwargs)
            if work is None:
                return None
            started.append(FailingWork(work, fails=not started))
            return started[-1]

        raised = False
        with mock.patch.object(dist, "scatter", failing_scatter):
            try:
                with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                    pass
            except _BodyError:
                raised = True
        self.assertTrue(raised)
        # Both units scattered, and the second unit's scatter finished although the
        # first one's failed
        self.assertEqual(len(started), 2)
        self.assertEqual(waited, started)
        for fsdp_module in FSDP.fsdp_modules(model):
            handle = fsdp_module._handle
            self.assertEqual(
                handle._training_state, HandleTrainingState.SUMMON_FULL_PARAMS
            )
            allocated = (
                handle.flat_param._full_param_padded.untyped_storage().size() > 0
            )
            self.assertEqual(allocated, self.rank == 0)
            # What FSDP would need to go on: reshard and idle again, by hand
            unshard_param_utils._reshard(fsdp_module, handle, True)
            handle._training_state = HandleTrainingState.IDLE
        self._check_idle_and_resharded(model)

    def test_rank0_writeback_with_grads(self):
        """
        Rank 0's edits to the full gradients reach every rank too, bitwise, and an
        optimizer step and a training step after the call match a reference that applied
        the same edits.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [True, False],
                "offload_to_cpu": [False, True],
            },
            self._test_rank0_writeback_with_grads,
        )

    def _test_rank0_writeback_with_grads(
        self, sharding_strategy, use_orig_params, offload_to_cpu
    ):
        reference = _make_reference()
        model = _wrap(
            reference,
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        _backward(model, self.device)
        self._check_rank0_grad_writeback(
            model, reference, offload_to_cpu, is_src=self.rank == 0
        )

    def test_rank0_writeback_with_grads_none(self):
        """
        A rank without a gradient receives rank 0's (rank 0 edits what the others have),
        and without a gradient on any rank, the parameters are written back and no rank
        gets one.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [True, False],
                "grad_on": ["rank 0", "no rank"],
            },
            self._test_rank0_writeback_with_grads_none,
        )

    def _test_rank0_writeback_with_grads_none(
        self, sharding_strategy, use_orig_params, grad_on
    ):
        reference = _make_reference()
        model = _wrap(
            reference,
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        _backward(model, self.device)
        if grad_on == "no rank" or self.rank != 0:
            model.zero_grad(set_to_none=True)
        if grad_on == "rank 0":
            self._check_rank0_grad_writeback(
                model, reference, offload_to_cpu=False, is_src=self.rank == 0
            )
            return
        with FSDP.summon_full_params(
            model, writeback=True, rank0_only=True, with_grads=True
        ):
            params = list(model.parameters())
            if self.rank == 0:
                self.assertTrue(all(param.grad is None for param in params))
                with torch.no_grad():
                    for param, value in zip(
                        params, _edited_values(params), strict=True
                    ):
                        param.copy_(value)
        self._check_idle_and_resharded(model)
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            params = list(model.parameters())
            for param, value in zip(params, _edited_values(params), strict=True):
                self.assertTrue(torch.equal(param.cpu(), value))
                self.assertIsNone(param.grad)

    def test_rank0_writeback_with_grads_body_raises(self):
        """
        If the body raises on rank 0 after editing gradients, no rank's gradient
        changes.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [True, False],
            },
            self._test_rank0_writeback_with_grads_body_raises,
        )

    def _test_rank0_writeback_with_grads_body_raises(
        self, sharding_strategy, use_orig_params
    ):
        model = _wrap(
            _make_reference(),
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        _backward(model, self.device)
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            before = [
                (param.detach().clone(), param.grad.clone())
                for param in model.parameters()
            ]
        with (
            self.assertRaisesRegex(_BodyError, "after the edit")
            if self.rank == 0
            else contextlib.nullcontext()
        ):
            with FSDP.summon_full_params(
                model, writeback=True, rank0_only=True, with_grads=True
            ):
                if self.rank == 0:
                    with torch.no_grad():
                        for param in model.parameters():
                            param.fill_(7.0)
                            param.grad.fill_(7.0)
                    raise _BodyError("after the edit")
        self._check_idle_and_resharded(model)
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            for param, (value, grad) in zip(model.parameters(), before, strict=True):
                self.assertTrue(torch.equal(param, value))
                self.assertTrue(torch.equal(param.grad, grad))

    def test_rank0_writeback_padding_stays_zeros(self):
        """
        The padding of the last rank's shard stays zeros, whatever rank 0's padded
        unsharded flat parameter and gradient hold past the unpadded numel: after
        ``to_cpu()`` on an accelerator, the padding of the re-allocated padded unsharded
        flat parameter is uninitialized, and without ``use_orig_params`` the shard's
        padding is visible in ``model.parameters()``.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
                "use_orig_params": [False, True],
                "with_grads": [False, True],
            },
            self._test_rank0_writeback_padding_stays_zeros,
        )

    def _test_rank0_writeback_padding_stays_zeros(
        self, sharding_strategy, use_orig_params, with_grads
    ):
        model = _wrap(
            _make_reference(),
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        handles = [fsdp_module._handle for fsdp_module in FSDP.fsdp_modules(model)]
        # The root's 21 elements leave one element of padding on the last rank (with
        # `use_orig_params`, alignment padding makes them 22)
        if self.rank == self.world_size - 1 and not use_orig_params:
            self.assertTrue(any(h.flat_param._shard_numel_padded for h in handles))
        _backward(model, self.device)
        with FSDP.summon_full_params(
            model, writeback=True, rank0_only=True, with_grads=with_grads
        ):
            if self.rank == 0:
                for handle in handles:
                    flat_param = handle.flat_param
                    numel = flat_param._unpadded_unsharded_size.numel()
                    padded = [flat_param._full_param_padded]
                    if with_grads:
                        # The gradient is a view into the padded unsharded one
                        storage = flat_param.grad.untyped_storage()
                        padded.append(
                            flat_param.grad.new_empty(0).set_(storage).view(-1)
                        )
                    for tensor in padded:
                        tensor[numel:].fill_(float("nan"))
        self._check_idle_and_resharded(model)
        paddings = []
        for handle in handles:
            flat_param = handle.flat_param
            shards = [flat_param._local_shard]
            if with_grads:
                shards.append(flat_param.grad)
            for shard in shards:
                paddings.append(shard[shard.numel() - flat_param._shard_numel_padded :])
        zeros = all(torch.equal(p, torch.zeros_like(p)) for p in paddings)
        # Every rank fails together, so that none blocks in the next collective
        agreed = torch.tensor([int(zeros)], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.process_group)
        self.assertTrue(agreed.item(), f"rank {self.rank}: paddings {paddings}")

    def test_rank0_writeback_new_grad_on_sharded_param_device(self):
        """
        A rank without a gradient receives rank 0's into a new one on the device of its
        sharded parameter, not on the compute device: with
        ``CPUOffload(offload_params=True)``, a gradient on the accelerator could not be
        the gradient of the CPU parameter. CPU offloading needs an accelerator, so the
        offloaded gradient's device is faked (``meta``) on the handle.
        """
        model = _wrap(
            _make_reference(), process_group=self.process_group, device_id=self.device
        )
        _backward(model, self.device)
        model.zero_grad(set_to_none=True)
        for fsdp_module in FSDP.fsdp_modules(model):
            flat_param = fsdp_module._handle.flat_param
            offloaded = torch.empty(flat_param._sharded_size, device="meta")
            with mock.patch.object(flat_param, "_cpu_grad", offloaded, create=True):
                grad, on_received = unshard_param_utils._grad_to_receive(
                    fsdp_module._handle,
                    unshard_param_utils._Rank0Grads(padded=None, saved=None),
                )
            self.assertEqual(grad.device, offloaded.device)
            self.assertEqual(grad.shape, flat_param._sharded_size)
            self.assertIsNotNone(on_received)
            self.assertIsNone(flat_param.grad)

    def test_rank0_writeback_new_grad_in_low_precision(self):
        """
        With ``keep_low_precision_grads=True``, a rank without a gradient sends and
        receives zeros in the low precision that the other ranks' gradients have, not
        in the parameter's dtype.
        """
        model = _wrap(
            _make_reference(),
            process_group=self.process_group,
            device_id=self.device,
            mixed_precision=MixedPrecision(
                param_dtype=torch.float16, keep_low_precision_grads=True
            ),
        )
        with FSDP.summon_full_params(model, writeback=False):
            pass
        for fsdp_module in FSDP.fsdp_modules(model):
            handle = fsdp_module._handle
            self.assertEqual(unshard_param_utils._grad_dtype(handle), torch.float16)
            grad, on_received = unshard_param_utils._grad_to_receive(
                handle, unshard_param_utils._Rank0Grads(padded=None, saved=None)
            )
            self.assertEqual(grad.dtype, torch.float16)
            self.assertEqual(handle.flat_param.dtype, torch.float32)
            # `.grad` refuses a gradient of another dtype
            on_received()
            self.assertIs(handle.flat_param.grad.dtype, torch.float16)
            handle.flat_param.grad = None

    def test_rank0_writeback_new_grad_waits_for_its_collective(self):
        """
        A rank without a gradient gets one only once the gradient's own collective
        finished: if it fails, the rank still has none.
        """
        model = _wrap(
            _make_reference(),
            process_group=self.process_group,
            device_id=self.device,
            use_orig_params=True,
        )
        _backward(model, self.device)
        if self.rank != 0:
            model.zero_grad(set_to_none=True)
        scatter = dist.scatter
        started = []

        class FailingWork:
            """Each unit scatters its parameter, then its gradient, which fails."""

            def __init__(self, work: dist.Work, fails: bool) -> None:
                self._work = work
                self._fails = fails

            def wait(self, *args, **kwargs):
                self._work.wait(*args, **kwargs)
                if self._fails:
                    raise _BodyError("gradient collective failed")

        def failing_scatter(*args, **kwargs):
            work = scatter(*args, **kwargs)
            if work is None:
                return None
            started.append(FailingWork(work, fails=len(started) % 2 == 1))
            return started[-1]

        with mock.patch.object(dist, "scatter", failing_scatter):
            with self.assertRaisesRegex(_BodyError, "gradient collective failed"):
                with FSDP.summon_full_params(
                    model, writeback=True, rank0_only=True, with_grads=True
                ):
                    pass
        self.assertEqual(len(started), 4)
        for fsdp_module in FSDP.fsdp_modules(model):
            handle = fsdp_module._handle
            if self.rank != 0:
                self.assertIsNone(handle.flat_param.grad)
            unshard_param_utils._reshard(fsdp_module, handle, True)
            handle._training_state = HandleTrainingState.IDLE

    def test_rank0_writeback_no_shard_cpu_offload_on_accelerator_raises(self):
        """
        ``NO_SHARD`` with ``CPUOffload(offload_params=True)`` on an accelerator would
        lose rank 0's change on rank 0 (resharding restores its CPU copy): every rank
        refuses it before any collective. The offload and the accelerator are faked on
        the handle, which the check reads; nothing runs with them.
        """
        model = FSDP(
            _make_reference(),
            process_group=self.process_group,
            device_id=self.device,
            sharding_strategy=ShardingStrategy.NO_SHARD,
        )
        handle = model._handle
        collectives = []

        def record(name):
            def collective(*args, **kwargs):
                collectives.append(name)
                raise AssertionError(f"{name} called")

            return collective

        names = [
            "all_reduce",
            "broadcast",
            "gather",
            "scatter",
            "all_gather_into_tensor",
            "barrier",
        ]
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(handle, "_offload_params", True))
            stack.enter_context(
                mock.patch.object(handle, "device", torch.device("cuda"))
            )
            for name in names:
                stack.enter_context(mock.patch.object(dist, name, record(name)))
            with self.assertRaisesRegex(
                NotImplementedError, "NO_SHARD with CPUOffload.*Use a sharded strategy"
            ):
                with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                    pass
            # Only that combination: a sharded strategy, or the CPU as compute device,
            # passes the check
            for sharded, device in [
                (True, torch.device("cuda")),
                (False, torch.device("cpu")),
            ]:
                with (
                    mock.patch.object(type(handle), "uses_sharded_strategy", sharded),
                    mock.patch.object(handle, "device", device),
                ):
                    unshard_param_utils._validate_rank0_writeback(model)
        self.assertEqual(collectives, [])
        self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
        self._check_rank0_writeback(model, offload_to_cpu=False, is_src=self.rank == 0)


class TestUnshardRank0WritebackHybrid(_Rank0WritebackTest):
    """
    ``writeback=True, rank0_only=True`` with hybrid sharding on a 2 x 2 mesh: every
    replica gets rank 0's change.
    """

    world_size = 4

    def test_rank0_writeback_hybrid_shard(self):
        mesh = init_device_mesh(
            self.device.type, (2, 2), mesh_dim_names=("replicate", "shard")
        )
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.HYBRID_SHARD,
                    ShardingStrategy._HYBRID_SHARD_ZERO2,
                ],
                "use_orig_params": [False, True],
            },
            self._test_rank0_writeback_hybrid_shard,
            mesh=mesh,
        )

    def _test_rank0_writeback_hybrid_shard(
        self, sharding_strategy, use_orig_params, mesh
    ):
        model = _wrap(
            _make_reference(),
            device_mesh=mesh,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        # Global rank 0 is the source; rank 2, rank 0 of the other replica, must not
        # keep its full copy either
        self._check_rank0_writeback(model, offload_to_cpu=True, is_src=self.rank == 0)
        # Nor allocate one: only rank 0's replica gathers, to rank 0
        torch.manual_seed(0)
        model = _wrap(
            nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 3)),
            device_mesh=mesh,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        self._check_other_ranks_allocate_at_most_a_shard(model, is_src=self.rank == 0)

    def test_rank0_writeback_hybrid_shard_with_grads(self):
        """Rank 0's edits to the gradients reach every replica too."""
        mesh = init_device_mesh(
            self.device.type, (2, 2), mesh_dim_names=("replicate", "shard")
        )
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.HYBRID_SHARD,
                    ShardingStrategy._HYBRID_SHARD_ZERO2,
                ],
                "use_orig_params": [True, False],
            },
            self._test_rank0_writeback_hybrid_shard_with_grads,
            mesh=mesh,
        )

    def _test_rank0_writeback_hybrid_shard_with_grads(
        self, sharding_strategy, use_orig_params, mesh
    ):
        reference = _make_reference()
        model = _wrap(
            reference,
            device_mesh=mesh,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        _backward(model, self.device)
        self._check_rank0_grad_writeback(
            model, reference, offload_to_cpu=True, is_src=self.rank == 0
        )


if __name__ == "__main__":
    run_tests()
