# Owner(s): ["oncall: distributed"]

import contextlib
import copy
import functools
import sys

import torch
import torch.distributed as dist
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
from torch.nn.utils import clip_grads_with_norm_, get_total_norm
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
        self.skipped: set[int] = set()  # blocks left unused

    def forward(self, x):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i in self.skipped:
                continue
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

    def ref_ddp(self, mesh, reference, **options):
        return DDP(reference, process_group=mesh["dp"].get_group(), **options)

    def train(self, mesh, pairs, steps, optim_cls=torch.optim.SGD):
        """Train ``(ddp, module)`` pairs alike; return their optimizers."""
        optims = [optim_cls(m.parameters(), lr=0.05) for _, m in pairs]
        ddps = [ddp for ddp, _ in pairs]
        if steps:
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
            param = model.get_parameter(name)
            grad = param.grad
            if grad is not None:  # the TP alone layout: a DTensor like its parameter
                self.assertEqual(type(grad), type(param.data), msg=name)
                if isinstance(grad, DTensor):
                    self.assertEqual(grad.placements, param.placements, msg=name)
            self.assertEqual(None if grad is None else full(grad), ref.grad, msg=name)

    def wrap(self, mesh, model, wrap="ddp", **options):
        if wrap == "replicate":
            return replicate(model, device_mesh=mesh["dp"], **options)
        return DDP(model, device_mesh=mesh["dp"], **options)

    def test_tp_params_stay_registered(self):
        """The same DTensor parameters stay registered, before and after forwards."""
        mesh = self.mesh()
        for wrap in ("ddp", "replicate"):
            _, model = self.build(mesh)
            before = dict(model.named_parameters())
            ddp = self.wrap(mesh, model, wrap)
            seen = []
            net1 = model.blocks[0].net1
            for step in range(3):
                after = dict(model.named_parameters())
                self.assertEqual(list(after), list(before), "parameters disappeared")
                for name, param in before.items():
                    self.assertIs(after[name], param, name)
                ddp(self.inputs(mesh, step)).sum().backward()
                if step == 0:  # after replicate()'s lazy init
                    net1.register_forward_pre_hook(
                        lambda m, i, s=seen: s.append(m.weight)
                    )
            for key, value in model.state_dict().items():
                self.assertEqual(isinstance(value, DTensor), key.startswith("blocks"))
            # During its owner's forward, a zero-copy DTensor view of the parameter.
            weight = net1.weight
            self.assertIsInstance(seen[0], DTensor)
            self.assertIsNot(seen[0], weight)
            self.assertEqual(
                seen[0].to_local().data_ptr(), weight.to_local().data_ptr()
            )
            self.assertIsInstance(weight.grad, DTensor)

    def _check_parity(self, wrap, frozen_tied=True):
        mesh = self.mesh()
        # Non-reentrant activation checkpointing recomputes the TP blocks.
        reference, model = self.build(mesh, frozen_tied, use_checkpoint=wrap == "ddp")
        # Built before wrapping, as TP alone allows: it holds the same parameters.
        optims = self.train(mesh, [(None, model), (None, reference)], [])
        static = {"gradient_as_bucket_view": True, "static_graph": True}
        options = static if wrap == "bucket_view_static_graph" else {}
        if wrap.endswith("find_unused_parameters"):
            options["find_unused_parameters"] = True
        wrapper = "replicate" if wrap.startswith("replicate") else "ddp"
        ddp = self.wrap(mesh, model, wrapper, **options)
        ref_ddp = self.ref_ddp(mesh, reference, **options)
        for step in range(4):
            if "find_unused_parameters" in options:
                # Unused on one DP rank only, or on every rank.
                unused = {1} if step == 3 or mesh["dp"].get_local_rank() else set()
                model.skipped = reference.skipped = unused if step % 2 else set()
            x = self.inputs(mesh, step)
            # Cleared before the forward, or between it and backward.
            before = step == 3
            for optim in optims if before else []:
                optim.zero_grad()
            loss, ref_loss = ddp(x).pow(2).sum(), ref_ddp(x).pow(2).sum()
            self.assertEqual(loss, ref_loss, msg=f"step {step}")
            for optim in [] if before else optims:
                optim.zero_grad()
            loss.backward()
            ref_loss.backward()
            self.assert_grads_match(model, reference)
            for optim in optims:
                optim.step()
        self.assertEqual(full_state(model), reference.state_dict())

    def test_training_parity(self):
        """Losses, DTensor gradients and parameters match a non-TP DDP reference."""
        wraps = ["ddp", "bucket_view_static_graph", "find_unused_parameters"]
        self.run_subtests(
            {
                "wrap": [*wraps, "replicate_find_unused_parameters"],
                "frozen_tied": [False, True],
            },
            self._check_parity,
        )

    def test_two_step_clip_gives_the_global_norm(self):
        """get_total_norm over p.grad + clip_grads_with_norm_, as TP alone allows."""
        mesh = self.mesh()
        for wrap in ("ddp", "replicate"):
            torch.manual_seed(0)
            reference = MLP().to(self.device_type)
            model = copy.deepcopy(reference)
            plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], plan)
            ddp, ref_ddp = self.wrap(mesh, model, wrap), self.ref_ddp(mesh, reference)
            for step in range(2):
                x = self.inputs(mesh, step)
                norms = []
                for d, m in ((ddp, model), (ref_ddp, reference)):
                    d(x).pow(2).sum().backward()
                    norm = full(get_total_norm([p.grad for p in m.parameters()]))
                    clip_grads_with_norm_(m.parameters(), 0.5, norm)
                    norms.append(norm)
                self.assertEqual(norms[0], norms[1], msg=wrap)
                self.assert_grads_match(model, reference)
                model.zero_grad()
                reference.zero_grad()

    def test_init_after_replicate_equals_tp_alone(self):
        """Materialize from meta and initialize after replicate(): as TP alone."""
        mesh = self.mesh()
        models = []
        for wrap in (True, False):
            with torch.device("meta"):
                model = Model()
            parallelize_module(model, mesh["tp"], TP_PLAN)
            if wrap:
                replicate(model, device_mesh=mesh["dp"])
            model.to_empty(device=self.device_type)
            torch.manual_seed(5)  # the same on every rank, as TP requires
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    nn.init.kaiming_uniform_(m.weight, a=5**0.5)  # fan-in: global
                    nn.init.uniform_(m.bias, -0.1, 0.1)
            models.append(model)
        model, tp_alone = models
        self.assertEqual(full_state(model), full_state(tp_alone), atol=0, rtol=0)
        # Training goes on from there like a non-TP model with the same values.
        reference = Model().to(self.device_type)
        reference.load_state_dict(full_state(tp_alone))
        pairs = [(model, model), (self.ref_ddp(mesh, reference), reference)]
        self.train(mesh, pairs, range(2))
        self.assertEqual(full_state(model), reference.state_dict())

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
        """load_state_dict(assign=True) after wrapping, then training, as TP alone."""
        mesh = self.mesh()
        _, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        _, other = self.build(mesh, seed=1)  # TP only: state_dict() of DTensors
        sd = copy.deepcopy(other.state_dict())
        tp_sd = {k: v for k, v in sd.items() if isinstance(v, DTensor)}
        model.load_state_dict(tp_sd, strict=False, assign=True)
        # Plain parameters are not replaced, as under DDP without TP.
        model.load_state_dict(
            {k: sd[k] for k in sd.keys() - tp_sd.keys()}, strict=False
        )
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
        weight = model.weight
        replicate(model, device_mesh=mesh["dp"])
        x = self.inputs(mesh, 0)
        self.assertEqual(model(x), reference(x))
        with self.assertRaises(RuntimeError):
            model(torch.randn(4, DIM + 1, device=self.device_type))  # on every rank
        self.assertNotIn("weight", model.__dict__)
        self.assertIs(model.weight, weight)
        self.assertEqual(model(x), reference(x))

    def test_dcp_state_dict_helpers(self):
        """get_/set_model_state_dict and get_/set_optimizer_state_dict round-trip."""
        mesh = self.mesh()
        reference, model = self.build(mesh)
        ddp = DDP(model, device_mesh=mesh["dp"])
        ref_ddp = self.ref_ddp(mesh, reference)
        pairs = [(ddp, model), (ref_ddp, reference)]
        # foreach=True, the default on CUDA, over DTensor and plain parameters.
        adamw = functools.partial(torch.optim.AdamW, foreach=True)
        optim, ref_optim = self.train(mesh, pairs, range(2), adamw)
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
            fresh_optim = adamw(fresh.parameters(), lr=0.05)
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
