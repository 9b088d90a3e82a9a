# Owner(s): ["oncall: distributed"]

import contextlib
import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._flat_param import FlatParamHandle
from torch.profiler import profile, ProfilerActivity
from torch.testing._internal.common_utils import run_tests

from common_fsdp_unshard import batch, BodyError, reference_model
from test_fsdp_unshard_rank0_writeback import (
    _edit,
    _Rank0WritebackTest,
    _summon_rank0,
    BOTH,
    FAILED_ELSEWHERE,
    FULL,
    GRAD_OP,
    HYBRID,
)


class Injected(Exception):
    """A failure forced on one rank."""


def _fail_once(point, owner, name: str, after: bool, fired: list):
    """
    Patches ``owner.name`` to raise ``Injected(point)`` at its first call, before it
    runs, or ``after`` it ran (a collective or a free, which must run on every rank).
    """
    original = getattr(owner, name)

    def failing(*args, **kwargs):
        if fired:
            return original(*args, **kwargs)
        fired.append(point)
        if not after:
            raise Injected(point)
        result = original(*args, **kwargs)
        if result is None:
            raise Injected(point)

        def wait():  # an asynchronous collective: it raises once finished
            result.wait()
            raise Injected(point)

        return mock.Mock(wait=wait)

    return mock.patch.object(owner, name, failing)


class _Rank0GatherTest(_Rank0WritebackTest):
    # Where a rank fails, in order: (owner, attribute, fails after running, the
    # ranks that reach it)
    points = {
        "pre_unshard": (FlatParamHandle, "pre_unshard", False, (0, 1)),
        "alloc": (FlatParamHandle, "_alloc_padded_unsharded_flat_param", False, (0,)),
        "gather": (dist, "gather", True, (0, 1)),
        "post_unshard": (FlatParamHandle, "post_unshard", False, (0, 1)),
        "to_cpu": (FlatParamHandle, "to_cpu", False, (0,)),
        "unflatten": (FlatParamHandle, "unflatten_as_params", False, (0,)),
        # The other ranks free the unsharded parameter before the body
        "early_free": (unshard_param_utils, "_reshard", False, (1,)),
        "body": (None, None, False, (0, 1)),
        "scatter": (dist, "scatter", True, (0, 1)),
        "free": (unshard_param_utils, "_reshard", True, (0,)),
    }
    # The points after the ranks agreed to write back: only the failed rank raises
    after_agreement = ("scatter", "free")

    def _failures(self, *points: str) -> list[tuple[str, int]]:
        """Each point and each rank that reaches it."""
        return [(p, rank) for p in points for rank in self.points[p][-1]]

    def _test_failure_at(self, failure, nested, with_grads, **kwargs):
        """
        ``failure``: a point fails on a rank, in the first unit it reaches (of two if
        ``nested``). Before the ranks agree to write back, every rank raises with
        nothing changed; after, only that rank raises, and each has rank 0's edits.
        Either way FSDP is idle and trains on; a hang fails at the group's timeout.
        """
        (point, fail_rank), kwargs = failure, {**kwargs, "use_orig_params": False}
        if point == "to_cpu" and self.device.type == "cpu":
            return  # ``offload_to_cpu`` copies nothing on a CPU compute device
        if nested:
            model, reference = self._models(with_grads, **kwargs)
        else:
            reference = reference_model()
            kwargs["device_id"] = self.device
            model = FSDP(copy.deepcopy(reference), self.process_group, **kwargs)
            if with_grads:
                for m, device in [(model, self.device), (reference, "cpu")]:
                    m(batch().to(device)).sum().backward()
        fails, fired = self.rank == fail_rank, []
        owner, name, after, _ = self.points[point]
        raises = self.assertRaisesRegex(RuntimeError, FAILED_ELSEWHERE)
        if fails:
            raises = self.assertRaisesRegex(Injected, point)
        elif point in self.after_agreement:
            raises = contextlib.nullcontext()
        failing = contextlib.nullcontext()
        if fails and owner is not None:
            failing = _fail_once(point, owner, name, after, fired)
        offload_to_cpu = point == "to_cpu"
        with failing, raises:
            with _summon_rank0(
                model, with_grads=with_grads, offload_to_cpu=offload_to_cpu
            ):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
                if fails and point == "body":
                    raise Injected(point)
        self.assertEqual(fired, [point] if fails and point != "body" else [])
        self._check_idle_and_resharded(model)
        if point in self.after_agreement:
            _edit(list(reference.parameters()), with_grads)
        self._check_full(model, reference, with_grads)
        self._check_writeback(model, reference, with_grads)

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

    def _test_hybrid_shard(self, with_grads: bool, **kwargs) -> None:
        # Rank 2, rank 0 of the other replica, must not keep a full copy either
        self._test_rank0_writeback(with_grads, offload_to_cpu=True, **kwargs)
        # Nor allocate one: only rank 0's replica gathers, to rank 0
        self._test_allocate_at_most_a_shard(with_grads, **kwargs)

    def _test_collectives(self, fail, with_grads: bool) -> None:
        """
        Every unit's scatter starts before any is waited for, and the units are freed
        once all finished, also if one failed (it raises once every unit is idle again).
        """
        model, reference = self._models(backward=with_grads, use_orig_params=True)
        if self.rank != 0:
            model.zero_grad(set_to_none=True)
        scatter, reshard, events = dist.scatter, unshard_param_utils._reshard, []

        def recording_scatter(*args, **kwargs):
            n, work = events.count("scatter"), scatter(*args, **kwargs)
            events.append("scatter")
            # The first unit's parameter scatter fails, or each gradient scatter
            fails = fail == "scatter" and (n % 2 == 1 if with_grads else n == 0)

            def wait():
                work.wait()
                events.append("wait")
                if fails:
                    raise BodyError("scatter failed")

            return mock.Mock(wait=wait)

        def recording_reshard(*args):
            events.append("reshard")
            return reshard(*args)

        with (
            mock.patch.object(dist, "scatter", recording_scatter),
            mock.patch.object(unshard_param_utils, "_reshard", recording_reshard),
            self.assertRaises(BodyError) if fail else contextlib.nullcontext(),
        ):
            with _summon_rank0(model, with_grads=with_grads):
                events.clear()  # the other ranks reshard early, on entry
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        n, frees = 2 + 2 * with_grads, 2
        self.assertEqual(events, ["scatter"] * n + ["wait"] * n + ["reshard"] * frees)
        self._check_idle_and_resharded(model)
        # What the (recorded) collectives delivered
        _edit(list(reference.parameters()), with_grads)
        self._check_full(model, reference, with_grads)


class TestUnshardRank0Gather(_Rank0GatherTest):
    """
    ``summon_full_params(writeback=True, rank0_only=True)`` on two ranks: only rank 0
    allocates the unsharded parameters, and the units' writebacks run concurrently.
    """

    world_size = 2

    def test_rank0_writeback_other_ranks_allocate_at_most_a_shard(self):
        config = {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_allocate_at_most_a_shard, with_grads=False)

    def test_rank0_writeback_failure(self):
        """
        A rank fails at any point of the writeback: no rank hangs, and all agree.
        """
        config = {"failure": self._failures(*self.points), "nested": BOTH}
        self.run_subtests(config, self._test_failure_at, with_grads=False)

    def test_rank0_writeback_collectives(self):
        config = {"fail": [None, "scatter"]}
        self.run_subtests(config, self._test_collectives, with_grads=False)


class TestUnshardRank0GatherHybrid(_Rank0GatherTest):
    """
    Hybrid sharding on a 2 x 2 mesh: only rank 0's replica gathers, to rank 0, and
    every replica gets rank 0's edits.
    """

    world_size = 4

    def test_rank0_writeback_hybrid_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        config = {"sharding_strategy": HYBRID, "use_orig_params": BOTH}
        self.run_subtests(
            config, self._test_hybrid_shard, device_mesh=mesh, with_grads=False
        )


if __name__ == "__main__":
    run_tests()
