# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.distributed import DDPOptimizer
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_utils import run_tests, TEST_WITH_DEV_DBG_ASAN
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print(
        "Skip dev-asan as torch + multiprocessing spawn have known issues",
        file=sys.stderr,
    )
    sys.exit(0)


# Each TP linear's local weight is 1 MiB, DDP's smallest bucket (its first):
# buckets of 1 MiB split the graph at almost every linear layer.
DIM = 512
BUCKET_BYTES = 2**20


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, 2 * DIM)
        self.net2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.net2(F.relu(self.net1(x)))


class Blocks(nn.Module):
    """TP blocks between plain layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.b1 = MLP()
        self.b2 = MLP()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(self.b2(self.b1(self.embed(x))))


def tp_plan():
    return {
        "b1.net1": ColwiseParallel(),
        "b1.net2": RowwiseParallel(),
        "b2.net1": ColwiseParallel(),
        "b2.net2": RowwiseParallel(),
    }


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class TestDDPOptimizerTensorParallel(DTensorContinuousTestBase):
    """DDP's graph splitting (DDPOptimizer) on tensor parallel models."""

    world_size = 4

    def mesh(self):
        return init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("dp", "tp"))

    def test_split_tp_model_trains_like_eager(self):
        """Split at bucket boundaries, a compiled TP model trains like eager TP."""
        mesh = self.mesh()
        torch.manual_seed(0)
        eager = Blocks().to(self.device_type)
        parallelize_module(eager, mesh["tp"], tp_plan())
        model = copy.deepcopy(eager)
        splitter = DDPOptimizer(
            bucket_bytes_cap=BUCKET_BYTES,
            backend_compile_fn=lookup_backend("aot_eager"),
        )
        compiled = torch.compile(model, backend=splitter.compile_fn)
        optim = torch.optim.SGD(model.parameters(), lr=0.05)
        eager_optim = torch.optim.SGD(eager.parameters(), lr=0.05)
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(4, DIM, device=self.device_type)
            loss = compiled(x).pow(2).sum()
            eager_loss = eager(x).pow(2).sum()
            self.assertEqual(loss, eager_loss, msg=f"step {step}")
            loss.backward()
            eager_loss.backward()
            for (name, p), q in zip(
                model.named_parameters(), eager.parameters(), strict=True
            ):
                self.assertEqual(full(p.grad), full(q.grad), msg=f"step {step}: {name}")
            optim.step()
            eager_optim.step()
            optim.zero_grad()
            eager_optim.zero_grad()
        # Not vacuous: the graph was split, between TP modules.
        self.assertGreater(len(splitter.buckets), 2)

    def test_compiled_ddp_tp_with_graph_splitting(self):
        """
        torch.compile(DDP(TP model)) with optimize_ddp on, several buckets: trains
        like the non-TP reference, and logs no warning of buckets extended past
        their capacity (stock DDP logs none on the reference).
        """
        mesh = self.mesh()
        for backend in ("aot_eager", "inductor"):
            counters.clear()
            torch.manual_seed(0)
            reference = Blocks().to(self.device_type)
            model = copy.deepcopy(reference)
            parallelize_module(model, mesh["tp"], tp_plan())
            for m in (reference, model):
                # Tied after TP, which gives each module its own DTensor.
                m.b2.net1.weight = m.b1.net1.weight
                m.b2.net2.weight.requires_grad_(False)
            bucket_cap_mb = BUCKET_BYTES / 2**20
            quiet = self.assertNoLogs(DDPOptimizer.__module__, level="WARNING")
            with torch._dynamo.config.patch(optimize_ddp=True), quiet:
                ddp = torch.compile(
                    DDP(model, device_mesh=mesh["dp"], bucket_cap_mb=bucket_cap_mb),
                    backend=backend,
                )
                ref_ddp = DDP(
                    reference,
                    process_group=mesh["dp"].get_group(),
                    bucket_cap_mb=bucket_cap_mb,
                )
                optim = torch.optim.SGD(model.parameters(), lr=0.05)
                ref_optim = torch.optim.SGD(reference.parameters(), lr=0.05)
                compiles = []
                for step in range(3):
                    torch.manual_seed(1000 * step + mesh["dp"].get_local_rank())
                    x = torch.randn(4, DIM, device=self.device_type)
                    loss = ddp(x).pow(2).sum()
                    ref_loss = ref_ddp(x).pow(2).sum()
                    self.assertEqual(loss, ref_loss, msg=f"{backend} step {step}")
                    loss.backward()
                    ref_loss.backward()
                    optim.step()
                    ref_optim.step()
                    optim.zero_grad()
                    ref_optim.zero_grad()
                    compiles.append(counters["aot_autograd"]["total"])
            state = {name: full(value) for name, value in model.state_dict().items()}
            self.assertEqual(state, reference.state_dict(), msg=backend)
            # Split: one AOT compilation per split graph, all in the first step.
            self.assertGreater(compiles[0], 2, backend)
            self.assertEqual(compiles, [compiles[0]] * 3, backend)


if __name__ == "__main__":
    run_tests()
