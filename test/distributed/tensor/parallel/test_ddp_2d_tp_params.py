# Owner(s): ["oncall: distributed"]

import contextlib
import copy
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed._composable.replicate import replicate
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    StateDictOptions,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)
from torch.utils.checkpoint import checkpoint


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)


DIM = 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, 2 * DIM)
        self.net2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.net2(F.relu(self.net1(x)))


class Model(nn.Module):
    """Plain parameters (``embed``, ``head``) around two TP blocks."""

    def __init__(self, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.use_checkpoint:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


TP_PLAN = {
    f"blocks.{i}.{name}": style
    for i in range(2)
    for name, style in (("net1", ColwiseParallel()), ("net2", RowwiseParallel()))
}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(value) for name, value in module.state_dict().items()}


class TestDDP2DTPParams(DTensorContinuousTestBase):
    """TP + DDP on a 2x2 (dp x tp) mesh: parameters, gradients and state."""

    world_size = 4

    def mesh(self):
        return init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("dp", "tp"))

    def build(self, mesh, frozen_tied=False, *, seed=0, **model_kwargs):
        """A non-TP reference and the same model with TP applied."""
        torch.manual_seed(seed)
        reference = Model(**model_kwargs).to(self.device_type)
        model = copy.deepcopy(reference)
        parallelize_module(model, mesh["tp"], TP_PLAN)
        for m in (reference, model):
            if frozen_tied:  # tied after TP, which gives each module its own DTensor
                m.blocks[1].net1.weight = m.blocks[0].net1.weight
                m.blocks[1].net2.weight.requires_grad_(False)
        return reference, model

    def inputs(self, mesh, step):
        # Same input on the ranks of one TP group, different inputs across DP.
        torch.manual_seed(1000 * step + mesh["dp"].get_local_rank())
        return torch.randn(4, DIM, device=self.device_type)

    def ref_ddp(self, mesh, reference):
        return DDP(reference, process_group=mesh["dp"].get_group())

    def train(self, mesh, pairs, steps, optim_cls=torch.optim.SGD):
        """Train ``(ddp, module)`` pairs alike; return their optimizers."""
        optims = [optim_cls(m.parameters(), lr=0.05) for _, m in pairs]
        ddps = [ddp for ddp, _ in pairs]
        self.step(mesh, list(zip(ddps, optims, strict=True)), steps)
        return optims

    def step(self, mesh, pairs, steps):
        """One step of each ``(ddp, optimizer)`` pair per step: the same losses."""
        for step in steps:
            x = self.inputs(mesh, step)
            losses = [ddp(x).pow(2).sum() for ddp, _ in pairs]
            self.assertEqual(losses[1:], losses[:-1], msg=f"step {step}")
            for loss, (_, optim) in zip(losses, pairs, strict=True):
                loss.backward()
                optim.step()
                optim.zero_grad()

    def assert_grads_match(self, model, reference):
        names = [name for name, _ in model.named_parameters()]
        self.assertEqual(names, [name for name, _ in reference.named_parameters()])
        for name, ref in reference.named_parameters():
            local = model.get_parameter(name)
            grad, spec = local.grad, getattr(local, "_st_info", None)
            if grad is not None and spec is not None:  # a TP parameter's shard
                kw = {"shape": spec.shape, "stride": spec.stride}
                grad = DTensor.from_local(grad, spec.mesh, spec.placements, **kw)
            self.assertEqual(None if grad is None else full(grad), ref.grad, msg=name)

    def test_tp_params_stay_registered(self):
        """The same local parameters stay registered, before and after forwards."""
        mesh = self.mesh()
        _, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        before = dict(model.named_parameters())

        def sizes():
            hooks = [(len(m._forward_hooks), len(m.__dict__)) for m in model.modules()]
            return hooks + [len(p._backward_hooks or {}) for p in before.values()]

        first, seen = sizes(), []
        net1 = model.blocks[0].net1
        net1.register_forward_pre_hook(lambda m, i: seen.append(m.weight))
        for step in range(2):
            ddp(self.inputs(mesh, step)).sum().backward()
            after = dict(model.named_parameters())
            self.assertEqual(list(after), list(before), "parameters disappeared")
            for name, param in before.items():
                self.assertIs(after[name], param, name)
        self.assertEqual(set(model.state_dict()), set(before))
        self.assertEqual(sizes(), first, "hooks or state grew with the forwards")
        local = net1.weight
        self.assertEqual(type(local), nn.Parameter)
        self.assertEqual(local._st_info, seen[0]._spec)  # clip_grad_norm_ uses it
        self.assertIsNotNone(local.grad)
        # During its owner's forward, a zero-copy DTensor view of global shape.
        self.assertIsInstance(seen[0], DTensor)
        self.assertEqual(seen[0].shape, (2 * DIM, DIM))
        self.assertEqual(seen[0].to_local().data_ptr(), local.data_ptr())
        # Unchanged parameters: the same view, forward after forward.
        self.assertIs(seen[1], seen[0])

    def test_state_dict_and_dcp_round_trip(self):
        """state_dict() gives global DTensors; DCP save -> load round-trips bitwise."""
        mesh = self.mesh()
        reference, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        sd = model.state_dict()  # global DTensors, as for TP alone
        self.assertEqual(full_state(model), reference.state_dict())
        for key, value in sd.items():
            self.assertEqual(isinstance(value, DTensor), key.startswith("blocks"))
        self.train(mesh, [(ddp, model)], range(2))
        path = [tempfile.mkdtemp() if self.rank == 0 else None]
        dist.broadcast_object_list(path)
        if self.rank == 0:
            self.addCleanup(shutil.rmtree, path[0], ignore_errors=True)
        dcp.save(model.state_dict(), checkpoint_id=path[0])
        _, fresh = self.build(mesh, seed=1)
        fresh_ddp = DDP(fresh, device_mesh=mesh["dp"])
        fresh_ddp(self.inputs(mesh, 0)).sum().backward()
        fresh_sd = fresh.state_dict()
        dcp.load(fresh_sd, checkpoint_id=path[0])
        fresh.load_state_dict(fresh_sd)
        self.assertEqual(full_state(fresh), full_state(model), atol=0, rtol=0)

    def test_views_rebuilt_when_stale(self):
        """Cached DTensor views: rebuilt on new data, not deep-copied."""
        mesh = self.mesh()
        _, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        _, other = self.build(mesh)  # TP only, the same values
        x = self.inputs(mesh, 0)
        ddp(x).sum().backward()
        self.assertEqual(copy.deepcopy(model)(x), other(x))  # views are not leaves
        self.assertEqual(model.blocks[1](x), other.blocks[1](x))  # called directly
        model.double()  # sets each parameter's .data
        other.double()
        self.assertEqual(model(x.double()), other(x.double()))

    def _check_parity(self, wrap, frozen_tied=True, first_forward=None):
        mesh = self.mesh()
        # Non-reentrant activation checkpointing recomputes the TP blocks.
        reference, model = self.build(mesh, frozen_tied, use_checkpoint=wrap == "ddp")
        if wrap == "replicate":
            ddp = replicate(model, device_mesh=mesh["dp"])
        elif wrap == "ddp":
            ddp = DDP(model, device_mesh=mesh["dp"])
        else:
            options = {"gradient_as_bucket_view": True, "static_graph": True}
            ddp = DDP(model, device_mesh=mesh["dp"], **options)
        if first_forward is not None:
            # Views made here must not be reused for training: they would have
            # no autograd node, or be inference tensors.
            with first_forward():
                ddp(self.inputs(mesh, 0))
        ref_ddp = self.ref_ddp(mesh, reference)
        optims = self.train(mesh, [(ddp, model), (ref_ddp, reference)], [])
        for step in range(3):
            x = self.inputs(mesh, step)
            loss, ref_loss = ddp(x).pow(2).sum(), ref_ddp(x).pow(2).sum()
            self.assertEqual(loss, ref_loss, msg=f"step {step}")
            loss.backward()
            ref_loss.backward()
            self.assert_grads_match(model, reference)
            for optim in optims:
                optim.step()
                optim.zero_grad()
        self.assertEqual(full_state(model), reference.state_dict())

    def test_training_parity(self):
        """Losses, gradients and parameters match a non-TP DDP reference."""
        self.run_subtests(
            {"wrap": ["ddp", "ddp_options", "replicate"], "frozen_tied": [False, True]},
            self._check_parity,
        )

    def test_first_forward_without_grad(self):
        """A first forward under no_grad or inference_mode, then training steps."""
        self.run_subtests(
            {"first_forward": [torch.no_grad, torch.inference_mode]},
            self._check_parity,
            wrap="ddp",
        )

    def test_optimizer_built_before_wrapping_raises(self):
        """An optimizer, or a loss, over the replaced DTensor parameters raises."""
        mesh = self.mesh()
        for wrap in (DDP, replicate):
            _, model = self.build(mesh)
            optim = torch.optim.SGD(model.parameters(), lr=0.05)
            kept = [p for p in model.parameters() if isinstance(p, DTensor)]
            ddp = wrap(model, device_mesh=mesh["dp"])
            ddp(self.inputs(mesh, 0)).sum().backward()
            with self.assertRaisesRegex(RuntimeError, "Build the optimizer after"):
                optim.step()
            penalty = sum(p.to_local().pow(2).sum() for p in kept)
            with self.assertRaisesRegex(RuntimeError, "Compute the loss from"):
                penalty.backward()

    def test_no_sync_gradient_accumulation(self):
        """Gradients accumulated under no_sync() over micro-batches match."""
        mesh = self.mesh()
        reference, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        ref_ddp = self.ref_ddp(mesh, reference)
        for micro in range(3):
            x = self.inputs(mesh, micro)
            for d in (ddp, ref_ddp):
                # The last micro-batch synchronizes the accumulated gradients.
                with d.no_sync() if micro < 2 else contextlib.nullcontext():
                    d(x).pow(2).sum().backward()
        self.assert_grads_match(model, reference)

    def test_load_state_dict_assign_after_wrapping(self):
        """load_state_dict(assign=True) keeps the TP parameters DDP holds."""
        mesh = self.mesh()
        _, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        _, other = self.build(mesh, seed=1)  # TP only: state_dict() of DTensors
        params = dict(model.named_parameters())
        sd = other.state_dict()
        tp_sd = {k: v for k, v in sd.items() if isinstance(v, DTensor)}
        model.load_state_dict(tp_sd, strict=False, assign=True)
        # Plain parameters are replaced by assign=True, as under DDP without TP.
        plain_sd = {k: v for k, v in sd.items() if k not in tp_sd}
        model.load_state_dict(plain_sd, strict=False)
        for name, param in model.named_parameters():
            self.assertIs(param, params[name], name)
        self.assertEqual(full_state(model), full_state(other), atol=0, rtol=0)
        other_ddp = DDP(other, device_mesh=mesh["dp"])
        self.train(mesh, [(ddp, model), (other_ddp, other)], range(2))
        self.assertEqual(full_state(model), full_state(other), atol=0, rtol=0)

    def test_replicate_forward_raises(self):
        """A forward that raised leaves no stale DTensor views behind."""
        mesh = self.mesh()
        torch.manual_seed(0)
        model = nn.Linear(DIM, 2 * DIM, device=self.device_type)  # the root owns them
        reference = copy.deepcopy(model)
        plan = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh["tp"], plan)
        replicate(model, device_mesh=mesh["dp"])
        x = self.inputs(mesh, 0)
        self.assertEqual(model(x), reference(x))
        with self.assertRaises(RuntimeError):
            model(torch.randn(4, DIM + 1, device=self.device_type))  # on every rank
        self.assertNotIsInstance(model.weight, DTensor)
        self.assertEqual(model(x), reference(x))

    def test_dcp_state_dict_helpers(self):
        """get_/set_model_state_dict and get_/set_optimizer_state_dict round-trip."""
        mesh = self.mesh()
        reference, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        ref_ddp = self.ref_ddp(mesh, reference)
        pairs = [(ddp, model), (ref_ddp, reference)]
        optim, ref_optim = self.train(mesh, pairs, range(2), torch.optim.AdamW)
        ref_msd = get_model_state_dict(ref_ddp)
        ref_osd = get_optimizer_state_dict(ref_ddp, ref_optim)
        tp_keys = {k for k in ref_msd if k.startswith("blocks.")}
        cases = [
            StateDictOptions(),
            StateDictOptions(cpu_offload=True),
            StateDictOptions(full_state_dict=True),
            StateDictOptions(
                full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True
            ),
        ]
        saved = []
        for options in cases:
            msd = get_model_state_dict(ddp, options=options)
            osd = get_optimizer_state_dict(ddp, optim, options=options)
            if not (options.full_state_dict and options.cpu_offload and self.rank):
                # TP parameters and their states as DTensors, unless full.
                sharded = not options.full_state_dict
                states = [osd["state"][k]["exp_avg"] for k in tp_keys]
                for value in [msd[k] for k in tp_keys] + states:
                    self.assertEqual(isinstance(value, DTensor), sharded, options)
                self.assertEqual({k: full(v) for k, v in msd.items()}, ref_msd)
                for fqn, state in ref_osd["state"].items():
                    actual = {k: full(v) for k, v in osd["state"][fqn].items()}
                    self.assertEqual(actual, state, msg=f"{options} {fqn}")
            saved.append((options, copy.deepcopy((msd, osd))))
        self.step(mesh, [(ddp, optim)], [2])
        for options, (msd, osd) in saved:
            _, fresh = self.build(mesh, seed=1)
            fresh_ddp = DDP(fresh, device_mesh=mesh["dp"])
            fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.05)
            set_model_state_dict(fresh_ddp, msd, options=options)
            set_optimizer_state_dict(fresh_ddp, fresh_optim, osd, options=options)
            self.step(mesh, [(fresh_ddp, fresh_optim)], [2])
            self.assertEqual(full_state(fresh), full_state(model), atol=0, rtol=0)

    def _check_compiled_parity(self, backend):
        """Compiled DDP(TP), frozen and tied TP parameters, against eager non-TP."""
        mesh = self.mesh()
        counters.clear()
        reference, model = self.build(mesh, frozen_tied=True)
        ddp = torch.compile(DDP(model, device_mesh=mesh["dp"]), backend=backend)
        ref_ddp = self.ref_ddp(mesh, reference)
        optims = self.train(mesh, [(ddp, model), (ref_ddp, reference)], [])
        graphs = []
        for step in range(3):
            self.step(mesh, list(zip((ddp, ref_ddp), optims, strict=True)), [step])
            graphs.append(counters["stats"]["unique_graphs"])
        self.assertEqual(full_state(model), reference.state_dict())
        # Compiled in the first step only: nothing recompiles step after step.
        self.assertGreater(graphs[0], 0)
        self.assertEqual(graphs, [graphs[0]] * 3)

    def test_compile_training_parity(self):
        """torch.compile(DDP(TP model)) trains like the non-TP reference."""
        self.run_subtests(
            {"backend": ["aot_eager", "inductor"]}, self._check_compiled_parity
        )


if __name__ == "__main__":
    run_tests()
