# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    distribute_tensor,
    DTensor,
    Partial,
    Replicate,
    Shard,
)
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TEST_WITH_DEV_DBG_ASAN,
    TestCase,
)
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print("Skip dev-asan as torch + multiprocessing spawn have known issues")
    sys.exit(0)

DIM = 8
INF = float("inf")


class Net(nn.Module):
    """A TP block between plain layers; ``head`` has one output, so FSDP2 leaves
    one rank with empty shards of it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.net1 = nn.Linear(DIM, 2 * DIM)
        self.net2 = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        return self.head(self.net2(F.relu(self.net1(self.embed(x)))))


def full_grad(param):
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


class TestClipGradNormLayouts(DTensorContinuousTestBase):
    world_size = 4
    _mesh = None

    @property
    def mesh(self):
        # Once per class, not per test: each mesh creates its process groups
        if TestClipGradNormLayouts._mesh is None:
            TestClipGradNormLayouts._mesh = init_device_mesh(
                self.device_type, (2, 2), mesh_dim_names=("dp", "tp")
            )
        return TestClipGradNormLayouts._mesh

    def _layout(self, layout, dtype=torch.float32):
        """A reference model, the same in ``layout`` on a (dp, tp) mesh, its wrapper,
        and the all-reduces its clip takes."""
        mesh = self.mesh
        torch.manual_seed(0)
        ref = Net().to(self.device_type, dtype)
        model = copy.deepcopy(ref)
        plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        if layout == "fsdp2_tp":
            # TP parameters on the 2-D mesh, the others on the dp mesh
            fully_shard(model, mesh=mesh["dp"])
            return ref, model, model, 2
        if layout == "fsdp2_tp_plain":
            # FSDP2 on the TP block only: two meshes and plain parameters
            fully_shard(model.net1, mesh=mesh["dp"])
            fully_shard(model.net2, mesh=mesh["dp"])
            return ref, model, model, 2
        return ref, model, model, 1  # "tp": DTensor and plain parameters

    def _backward(self, ref, wrapped, scale=1.0):
        torch.manual_seed(1)  # the same batch on every rank
        x = torch.randn(4, DIM, device=self.device_type) * scale
        x = x.to(next(ref.parameters()).dtype)
        ref(x).pow(2).sum().backward()
        wrapped(x).pow(2).sum().backward()

    @parametrize("layout", ["fsdp2_tp", "fsdp2_tp_plain", "tp"])
    def test_clip_grad_norm(self, layout):
        config = {"norm_type": [2, INF, 1, 3, -INF], "foreach": [None, True, False]}
        config["two_step"] = [False, True]
        self.run_subtests(config, self._test_clip_grad_norm, layout)
        # Gradient norms whose squares overflow float16
        self._test_clip_grad_norm(layout, 2, None, False, torch.float16)

    def _test_clip_grad_norm(
        self, layout, norm_type, foreach, two_step, dtype=torch.float32
    ):
        ref, model, wrapped, all_reduces = self._layout(layout, dtype)
        self._backward(ref, wrapped, 1.0 if dtype == torch.float32 else 100.0)
        max_norm = 0.05  # clipping is active
        ref_norm = clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        with CommDebugMode() as comm_mode:
            if two_step:
                grads = [p.grad for p in model.parameters()]
                norm = get_total_norm(grads, norm_type, foreach=foreach)
                clip_grads_with_norm_(model.parameters(), max_norm, norm, foreach)
            else:
                norm = clip_grad_norm_(
                    model.parameters(), max_norm, norm_type, foreach=foreach
                )
        # One all-reduce of the local norms per process group: no gradient gathered
        self.assertEqual(
            comm_mode.get_comm_counts(), {torch.ops.c10d.allreduce_: all_reduces}
        )
        self.assertNotIsInstance(norm, DTensor)
        # float16: TP's matmuls round differently from the reference's
        tol = {"atol": 1e-5, "rtol": 1e-5}
        if dtype == torch.float16:
            tol = {"atol": 1e-2, "rtol": 1e-2}
        self.assertEqual(norm, ref_norm, **tol)
        self.assertTrue(ref_norm > max_norm or norm_type == -INF)
        ref_grads = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            self.assertEqual(full_grad(param), ref_grads[name].grad, **tol, msg=name)

    @parametrize("layout", ["fsdp2_tp", "tp"])
    def test_nonfinite_grad_on_one_rank(self, layout):
        config = {"value": [INF, float("nan")], "norm_type": [2, INF]}
        self.run_subtests(config, self._test_nonfinite_grad_on_one_rank, layout)

    def _test_nonfinite_grad_on_one_rank(self, layout, value, norm_type):
        ref, model, wrapped, _ = self._layout(layout)
        self._backward(ref, wrapped)
        # One shard of the gradient: FSDP2's on rank 0, TP's on each replica's tp rank 0
        if self.rank == 0 or (layout != "fsdp2_tp" and self.rank % 2 == 0):
            grad = model.net1.weight.grad
            grad = grad.to_local() if isinstance(grad, DTensor) else grad
            grad[0, 0] = value
        # Every rank raises: none is left waiting in a collective
        with self.assertRaisesRegex(RuntimeError, "is non-finite"):
            clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)

    @parametrize("layout", ["fsdp2_tp", "tp"])
    def test_dtensor_total_norm_clips_every_grad(self, layout):
        """A norm of the TP gradients alone (a DTensor) clips gradients on several
        meshes, or DTensor and plain ones."""
        ref, model, wrapped, _ = self._layout(layout)
        self._backward(ref, wrapped)
        tp_names = ["net1.weight", "net1.bias", "net2.weight"]
        ref_norm = get_total_norm([ref.get_parameter(n).grad for n in tp_names])
        norm = get_total_norm([model.get_parameter(n).grad for n in tp_names])
        self.assertIsInstance(norm, DTensor)
        clip_grads_with_norm_(ref.parameters(), 0.05, ref_norm)
        clip_grads_with_norm_(model.parameters(), 0.05, norm)
        for name, param in model.named_parameters():
            self.assertEqual(full_grad(param), ref.get_parameter(name).grad, msg=name)

    def test_local_shards_on_different_devices_raise(self):
        """DTensors sharded over one process group with local shards on different
        devices (say, some offloaded to CPU) raise before any collective."""
        mesh = self.mesh
        grads = [
            distribute_tensor(
                torch.ones(4, 4, device=self.device_type), mesh["dp"], [Shard(0)]
            ),
            # "meta" stands for another device: a CPU-only machine has one device
            DTensor.from_local(
                torch.ones(2, 4, device="meta"),
                mesh,
                [Shard(0), Shard(1)],
                run_check=False,
            ),
        ]
        with self.assertRaisesRegex(
            ValueError, r"local shards are on different devices \(.*meta"
        ):
            get_total_norm(grads)

    def test_partial_grads_are_reduced_first(self):
        """Partial gradients (sequence parallel norms') count as their sum, on a mesh
        of their own."""
        mesh = self.mesh
        local = torch.arange(4.0, device=self.device_type) + self.rank
        grads = [
            DTensor.from_local(local, mesh["dp"], [Partial()]),
            distribute_tensor(local, mesh, [Shard(0), Replicate()]),
        ]
        flat = torch.cat([g.full_tensor() for g in grads])
        for norm_type in (2, INF, 1):
            norm = get_total_norm(grads, norm_type)
            self.assertEqual(norm, torch.linalg.vector_norm(flat, norm_type))

    def test_clip_grad_norm_sequence_parallel_tp(self):
        """TP alone with Partial gradients (a sequence parallel norm), Replicate ones
        of Shard(0) weights (a vocabulary-parallel embedding) and a plain head."""
        torch.manual_seed(0)
        ref = nn.Sequential(
            nn.Embedding(DIM, DIM),
            nn.LayerNorm(DIM),
            nn.Linear(DIM, DIM),
            nn.Linear(DIM, DIM),
        ).to(self.device_type)
        model = parallelize_module(
            copy.deepcopy(ref),
            self.mesh["tp"],
            {
                "0": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1)
                ),
                "1": SequenceParallel(),
                "2": ColwiseParallel(
                    input_layouts=Shard(1), output_layouts=Replicate()
                ),
            },
        )
        tokens = torch.arange(16, device=self.device_type).view(2, 8) % DIM
        for m in (ref, model):
            F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
        self.assertIsInstance(model[1].weight.grad.placements[0], Partial)
        for norm_type in (2, INF):
            ref_norm = clip_grad_norm_(ref.parameters(), 0.05, norm_type)
            norm = clip_grad_norm_(model.parameters(), 0.05, norm_type)
            self.assertEqual(norm, ref_norm)
        for name, param in model.named_parameters():
            self.assertEqual(full_grad(param), ref.get_parameter(name).grad, msg=name)

    def test_stock_paths(self):
        """Plain tensors only, and DTensors on one mesh (the result is a DTensor)."""
        mesh = self.mesh
        torch.manual_seed(0)
        full = [torch.randn(8, 4, device=self.device_type) for _ in range(3)]
        placements = [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate()] * 2]
        for norm_type in (2, INF, 1):
            plain = [nn.Parameter(torch.empty_like(g)) for g in full]
            params = [
                nn.Parameter(distribute_tensor(g, mesh, pl))
                for g, pl in zip(full, placements, strict=True)
            ]
            for p, q, g, pl in zip(plain, params, full, placements, strict=True):
                p.grad = g.clone()
                q.grad = distribute_tensor(g, mesh, pl)
            norm = clip_grad_norm_(plain, 0.5, norm_type)
            flat = torch.cat([g.flatten() for g in full])
            self.assertEqual(norm, torch.linalg.vector_norm(flat, norm_type))
            dnorm = clip_grad_norm_(params, 0.5, norm_type)
            self.assertIsInstance(dnorm, DTensor)
            self.assertEqual(dnorm.full_tensor(), norm)
            for p, q in zip(plain, params, strict=True):
                self.assertEqual(q.grad.full_tensor(), p.grad)


class TestClipGradNormCompile(TestCase):
    def test_plain_path_compiles_as_one_graph(self):
        """Plain gradients compile without a graph break, as before DTensor support,
        also once DTensor is imported (it is, by this file)."""
        params = [nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
        grads = [torch.randn(4, 4) for _ in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        ref_norm = clip_grad_norm_(params, 0.5)
        ref_grads = [p.grad for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch._dynamo.reset()
        compiled = torch.compile(clip_grad_norm_, backend="eager", fullgraph=True)
        self.assertEqual(compiled(params, 0.5), ref_norm)
        self.assertEqual([p.grad for p in params], ref_grads)


instantiate_parametrized_tests(TestClipGradNormLayouts)

if __name__ == "__main__":
    run_tests()
