# Owner(s): ["oncall: distributed"]

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.testing._internal.common_utils import run_tests, TEST_WITH_DEV_DBG_ASAN

from common_fsdp_unshard import batch, FSDPUnshardTest, reference_model

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print(
        "Skip dev-asan as torch + multiprocessing spawn have known issues",
        file=sys.stderr,
    )
    sys.exit(0)


def check_zeros_in_param_dtype(test: FSDPUnshardTest, **kwargs) -> None:
    """
    ``summon_full_params(with_grads=True)`` on bfloat16 parameters where rank 1 has
    no gradient: every rank gets bfloat16 gradients, rank 0's shard unchanged.
    """
    model = test._wrap(reference_model().to(torch.bfloat16), **kwargs)
    model(batch().to(test.device, torch.bfloat16)).sum().backward()
    handles = [m._handle for m in FSDP.fsdp_modules(model)]
    shards = [h.flat_param.grad.clone() for h in handles]
    if test.rank == 1:
        model.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model, with_grads=True):
        for p in model.parameters():
            test.assertEqual(p.grad.dtype, torch.bfloat16)
        for handle, shard in zip(handles, shards, strict=True):
            grad, n = handle.flat_param.grad, shard.numel()
            test.assertEqual(grad.dtype, torch.bfloat16)
            test.assertEqual(grad[n:], torch.zeros_like(grad[n:]))
            if test.rank == 0:
                test.assertEqual(grad[:n], shard, atol=0, rtol=0)
    test._check_idle_and_resharded(model)


class TestUnshardGradDtype(FSDPUnshardTest):
    """``FlatParamHandle.unshard_grad()`` with a rank without a gradient."""

    world_size = 2

    def test_with_grads_zeros_in_param_dtype(self):
        """
        A rank without a gradient sends zeros in the parameter's dtype (bfloat16
        here), not in float32: else the ranks' all-gathers would not match.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
                "use_orig_params": [True],
            },
            check_zeros_in_param_dtype,
            self,
        )


if __name__ == "__main__":
    run_tests()
