# Owner(s): ["oncall: distributed"]

import contextlib
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

from common_fsdp_unshard import BodyError
from test_fsdp_unshard_rank0_writeback import (
    _edit,
    _Rank0WritebackTest,
    _summon_rank0,
    BOTH,
    FULL,
    GRAD_OP,
    HYBRID,
)


class _Rank0GatherTest(_Rank0WritebackTest):
    points = {
        **_Rank0WritebackTest.points,
        # On entry, before the ranks agree: unsharding starts, rank 0 allocates
        "pre_unshard": (FlatParamHandle, "pre_unshard", False, (0, 1)),
        "alloc": (FlatParamHandle, "_alloc_padded_unsharded_flat_param", False, (0,)),
        # Once they agreed to unshard, then upon exit once they agreed to write back
        "gather": (dist, "gather", True, (0, 1)),
        "scatter": (dist, "scatter", True, (0, 1)),
        "free": (unshard_param_utils, "_reshard", True, (0,)),
    }
    after_agreement = ("scatter", "free")

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

    def test_rank0_writeback_failure_in_collectives(self):
        """
        A rank fails around a collective (unsharding to rank 0, writing back, freeing):
        no rank hangs, and all agree.
        """
        failures = self._failures("pre_unshard", "alloc", "gather", "scatter", "free")
        config = {"failure": failures, "nested": BOTH}
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
        # Rank 2, rank 0 of the other replica, must not keep a full copy either
        self.run_subtests(
            config,
            self._test_rank0_writeback,
            device_mesh=mesh,
            with_grads=False,
            offload_to_cpu=True,
        )

    def test_rank0_writeback_hybrid_shard_allocate_at_most_a_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        config = {"sharding_strategy": HYBRID, "use_orig_params": BOTH}
        self.run_subtests(
            config,
            self._test_allocate_at_most_a_shard,
            device_mesh=mesh,
            with_grads=False,
        )


if __name__ == "__main__":
    run_tests()
