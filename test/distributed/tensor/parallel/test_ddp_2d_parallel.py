# Owner(s): ["oncall: distributed"]

import contextlib
import copy
import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.distributed import DDPOptimizer
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.distributed._composable.replicate import replicate
from torch.distributed._tensor import DTensor, Replicate, Shard
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    powerSGD_hook as powerSGD,
)
from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
    _hook_then_optimizer,
    _OptimizerHookState,
)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    StateDictOptions,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.distributed.optim import as_functional_optim
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    loss_parallel,
    parallelize_module,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from torch.testing._internal.common_utils import run_tests, TemporaryDirectoryName

from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
    DTensorTestBase,
    MLPModule,
    ModelArgs,
    Transformer,
    with_comms,
)
from torch.utils.checkpoint import checkpoint

# Tensor-Parallel degree
TP_DEGREE = 2
LR = 3e-5


def init_model(device_type, model_parallel_size=TP_DEGREE):
    torch.manual_seed(0)
    model = MLPModule(device_type)
    torch.manual_seed(0)
    twod_model = MLPModule(device_type)
    model = DDP(model)

    # 2-D mesh is [dp, tp]
    world_size = dist.get_world_size()
    twod_mesh = init_device_mesh(
        device_type,
        (world_size // model_parallel_size, model_parallel_size),
        mesh_dim_names=("dp", "tp"),
    )

    dp_pg = twod_mesh.get_group("dp")

    parallelize_plan = {
        "net1": ColwiseParallel(),
        "net2": RowwiseParallel(),
    }
    twod_model = parallelize_module(twod_model, twod_mesh["tp"], parallelize_plan)
    _pre_dp_module_transform(twod_model)
    # TODO: Add tests when using gradient_as_bucket_view and static_graph for DDP.
    twod_model = DDP(twod_model, process_group=dp_pg)
    return model, twod_model, dp_pg


class Test2dParallelIntegration(DTensorTestBase):
    def _check_module(self, m1, m2, check_grad=False):
        named_parameters = dict(m1.named_parameters())
        for name, param_m2 in m2.named_parameters():
            if name not in named_parameters:
                print(name, named_parameters.keys())
            self.assertTrue(name in named_parameters)
            param_m1 = named_parameters[name]
            if check_grad:
                param_m2 = param_m2.grad
                param_m1 = param_m1.grad
            if isinstance(param_m2, DTensor):
                replicate = [Replicate()]
                param_m2 = param_m2.redistribute(
                    device_mesh=param_m2.device_mesh, placements=replicate
                ).to_local()
            self.assertEqual(param_m2, param_m1)

    @with_comms
    def test_2d_ddp_integration_functionality(self) -> None:
        model, twod_model, dp_pg = init_model(self.device_type)
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        twod_optim = torch.optim.Adam(twod_model.parameters(), lr=LR)

        # Create Input
        input_seed = dist.get_rank(dp_pg)
        torch.manual_seed(input_seed + 1)
        input = torch.rand(4, 10, device=self.device_type)

        output = model(input)
        twod_output = twod_model(input)
        self.assertEqual(output, twod_output)

        output.sum().backward()
        twod_output.sum().backward()
        self._check_module(model, twod_model, check_grad=True)

        optim.step()
        twod_optim.step()
        self._check_module(model, twod_model)

        torch.manual_seed(input_seed + 1004)
        input = torch.rand(16, 10, device=self.device_type)

        output = model(input)
        twod_output = twod_model(input)
        self.assertEqual(output, twod_output)

        # TODO: Add save/load of 2D verification.

    @with_comms
    def test_2d_ddp_frozen_tp_param(self) -> None:
        """
        A TP weight with requires_grad=False (a LoRA base weight) stays frozen:
        under DDP(device_mesh=...), and after _pre_dp_module_transform under
        DDP(process_group=...).
        """
        mesh = init_device_mesh(
            self.device_type,
            (self.world_size // TP_DEGREE, TP_DEGREE),
            mesh_dim_names=("dp", "tp"),
        )
        for transform in (False, True):
            model = MLPModule(self.device_type)
            plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], plan)
            model.net1.weight.requires_grad_(False)
            frozen = model.net1.weight.to_local().clone()
            if transform:
                _pre_dp_module_transform(model)
                ddp = DDP(model, process_group=mesh["dp"].get_group())
            else:
                ddp = DDP(model, device_mesh=mesh["dp"])
            params = dict(model.named_parameters())
            self.assertEqual(
                {name: p.requires_grad for name, p in params.items()},
                {name: name != "net1.weight" for name in params},
                f"frozen TP parameter made trainable (transform={transform})",
            )
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(mesh["dp"].get_local_rank())
            for _ in range(2):
                ddp(torch.randn(4, 10, device=self.device_type)).sum().backward()
                optim.step()
            weight = model.net1.weight
            self.assertIsNone(weight.grad)
            if isinstance(weight, DTensor):  # DDP keeps TP parameters as DTensors
                weight = weight.to_local()
            self.assertEqual(weight, frozen, atol=0, rtol=0)

    @with_comms
    def test_2d_ddp_fused_optimizer_process_group(self) -> None:
        """_register_fused_optim averages over DDP's process group, not the world."""
        mesh = init_device_mesh(
            self.device_type,
            (self.world_size // TP_DEGREE, TP_DEGREE),
            mesh_dim_names=("dp", "tp"),
        )
        model, reference = MLPModule(self.device_type), MLPModule(self.device_type)
        ddp = DDP(model, process_group=mesh["dp"].get_group())
        ddp._register_fused_optim(torch.optim.SGD, lr=0.1)
        ref_ddp = DDP(reference, process_group=mesh["dp"].get_group())
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        torch.manual_seed(self.rank)  # another batch on every rank
        batch = torch.randn(4, 10, device=self.device_type)
        for d in (ddp, ref_ddp):
            d(batch).sum().backward()
        ref_optim.step()
        for name, param in model.named_parameters():
            self.assertEqual(param, reference.get_parameter(name), msg=name)


DIM = 8


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, 2 * DIM)
        self.net2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.net2(F.relu(self.net1(x)))


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class TPModel(nn.Module):
    """Plain ``embed`` and ``head`` around two blocks that get TP."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)
        self.skipped: set[int] = set()  # blocks left unused
        self.checkpoint = None  # "reentrant" or "non_reentrant"
        self.reads: tuple[str, ...] = ()  # TP weights read outside their owner

    def forward(self, x):
        extra = 0.0
        if "before" in self.reads:  # a regularizer, before the owner runs
            extra = full(self.blocks[1].net2.weight).pow(2).sum()
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i in self.skipped:
                continue
            if self.checkpoint:
                reentrant = self.checkpoint == "reentrant"
                x = checkpoint(block, x, use_reentrant=reentrant)
            else:
                x = block(x)
        if "after" in self.reads:  # a tied read, after the owner ran
            x = x + F.linear(x, full(self.blocks[0].net1.weight))[:, :DIM]
        return self.head(x) + 0.01 * extra


WRAPS = ("ddp", "replicate")  # DDP(device_mesh=...) and replicate(device_mesh=...)


TP_PLAN = {
    f"blocks.{i}.{name}": style
    for i in range(2)
    for name, style in (("net1", ColwiseParallel()), ("net2", RowwiseParallel()))
}


def redistribute_grads(module):
    """
    Each DTensor gradient in its parameter's placements, as DDP hands them to the
    optimizer (FSDP2 too): TP alone leaves Partial gradients of sequence parallel
    norms and Replicate ones of Shard(0) embeddings, which torch 2.11's AdamW
    steps off the non-parallel model from the second step on (DDP + TP stays on it).
    """
    for param in module.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


def full_state(module):
    return {name: full(value) for name, value in module.state_dict().items()}


VOCAB = 8


def transformer_args(**kwargs):
    # No dropout: TP alone and DDP would draw different masks. One layer holds
    # every layout of the plan.
    return ModelArgs(n_layers=1, dropout_p=0.0, vocab_size=VOCAB, **kwargs)


def lm_loss(module, tokens):
    logits = module(tokens)
    return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def freezing_loss(models, name, at_call):
    """``lm_loss`` that freezes parameter ``name`` of ``models`` at call ``at_call``."""
    calls = itertools.count()

    def loss(module, tokens):
        if next(calls) == at_call:
            for model in models:
                model.get_parameter(name).requires_grad_(False)
        return lm_loss(module, tokens)

    return loss


class SPNormModel(nn.Sequential):
    """A vocabulary-parallel embedding, a sequence parallel norm and a plain head."""

    plan = {
        "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "1": SequenceParallel(),
        "2": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }

    def __init__(self) -> None:
        super().__init__(
            nn.Embedding(VOCAB, DIM),
            nn.LayerNorm(DIM),
            nn.Linear(DIM, VOCAB),
            nn.Linear(VOCAB, VOCAB),
        )


class VocabParallelLM(nn.Sequential):
    """A vocabulary-parallel embedding and an output sharded over the vocabulary."""

    plan = {
        "0": RowwiseParallel(input_layouts=Replicate()),
        "2": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }

    def __init__(self) -> None:
        super().__init__(
            nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
        )


# DDP's graph splitting (DDPOptimizer): each TP linear's local weight is 1 MiB, DDP's
# smallest bucket (its first), so 1 MiB buckets split the graph at most linears.
SPLIT_DIM = 512
SPLIT_BUCKET_BYTES = 2**20


class SplitMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(SPLIT_DIM, 2 * SPLIT_DIM)
        self.net2 = nn.Linear(2 * SPLIT_DIM, SPLIT_DIM)

    def forward(self, x):
        return self.net2(F.relu(self.net1(x)))


class SplitBlocks(nn.Module):
    """TP blocks between plain layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(SPLIT_DIM, SPLIT_DIM)
        self.b1 = SplitMLP()
        self.b2 = SplitMLP()
        self.head = nn.Linear(SPLIT_DIM, SPLIT_DIM)

    def forward(self, x):
        return self.head(self.b2(self.b1(self.embed(x))))


SPLIT_TP_PLAN = {
    "b1.net1": ColwiseParallel(),
    "b1.net2": RowwiseParallel(),
    "b2.net1": ColwiseParallel(),
    "b2.net2": RowwiseParallel(),
}


class TestDDPTensorParallel(DTensorContinuousTestBase):
    """
    DDP over the dp dimension of a tensor parallel model: DTensor parameters
    and gradients, as with TP alone, against DDP of the same model without TP.
    """

    world_size = 4
    _mesh = None

    @property
    def mesh(self):
        # Once per class: each mesh creates its process groups.
        if TestDDPTensorParallel._mesh is None:
            TestDDPTensorParallel._mesh = init_device_mesh(
                self.device_type, (2, 2), mesh_dim_names=("dp", "tp")
            )
        return TestDDPTensorParallel._mesh

    def build(self, seed=0):
        """A model without TP and the same model with TP."""
        torch.manual_seed(seed)
        reference = TPModel().to(self.device_type)
        model = copy.deepcopy(reference)
        parallelize_module(model, self.mesh["tp"], TP_PLAN)
        return reference, model

    def inputs(self, step, dp_rank=None):
        # The same input in a TP group, different ones across dp.
        if dp_rank is None:
            dp_rank = self.mesh["dp"].get_local_rank()
        torch.manual_seed(1000 * step + dp_rank)
        return torch.randn(4, DIM, device=self.device_type)

    def wrap(self, model, wrap="ddp", **options):
        if wrap == "replicate":
            return replicate(model, device_mesh=self.mesh["dp"], **options)
        return DDP(model, device_mesh=self.mesh["dp"], **options)

    def ref_ddp(self, reference, **options):
        return DDP(reference, process_group=self.mesh["dp"].get_group(), **options)

    def optims(self, *models):
        return [
            torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in models
        ]

    def step(self, pairs, step):
        """A training step of each ``(module, optimizer)`` pair, on one input."""
        for module, optim in pairs:
            module(self.inputs(step)).pow(2).sum().backward()
            if optim is not None:
                optim.step()
                optim.zero_grad()

    def assert_grads_match(self, model, reference, msg="", reduced=True):
        """
        The gradients of ``reference`` (without TP, or TP alone); those DDP
        ``reduced`` in their parameters' placements (TP alone may give others).
        """
        names = [name for name, _ in model.named_parameters()]
        self.assertEqual(names, [name for name, _ in reference.named_parameters()])
        for name, ref in reference.named_parameters():
            param = model.get_parameter(name)
            grad = param.grad
            if grad is not None:  # the layout of TP alone
                self.assertEqual(type(grad), type(param.data), msg=name)
                if reduced and isinstance(grad, DTensor):
                    self.assertEqual(grad.placements, param.placements, msg=name)
            expected = full(ref.grad)
            self.assertEqual(full(grad), expected, msg=f"{msg} {name}")

    def check_parity(self, wrap="ddp", steps=3, comm_hook=None, setup=None, **options):
        """
        Train the TP model under DDP (or replicate) and the model without TP
        under DDP alike: the same losses, gradients and parameters.
        """
        reference, model = self.build()
        # Built before wrapping, as TP alone allows.
        optim, ref_optim = self.optims(model, reference)
        ddp = self.wrap(model, wrap, **options)
        ref_ddp = self.ref_ddp(reference, **options)
        for d in (ddp, ref_ddp) if comm_hook else ():
            d.register_comm_hook(self.mesh["dp"].get_group(), comm_hook)
        # With find_unused_parameters, the last step's zero_grad() comes between
        # its forward and backward (gradients of unused parameters are read).
        late = steps - 1 if options.get("find_unused_parameters") else steps
        for step in range(steps):
            for m in (model, reference):
                if setup is not None:
                    setup(m, step)
            x = self.inputs(step)
            loss, ref_loss = ddp(x).pow(2).sum(), ref_ddp(x).pow(2).sum()
            self.assertEqual(loss, ref_loss, msg=f"step {step}")
            for o in (optim, ref_optim) if step == late else ():
                o.zero_grad()
            loss.backward()
            ref_loss.backward()
            self.assert_grads_match(model, reference, msg=f"step {step}")
            for o in (optim, ref_optim):
                o.step()
                if step != late - 1:
                    o.zero_grad()
        self.assertEqual(full_state(model), reference.state_dict())
        return model

    def test_tp_params_stay_registered(self):
        """The module keeps its DTensor parameters: forward uses them as TP alone."""
        for wrap in WRAPS:
            _, model = self.build()
            before = dict(model.named_parameters())
            ddp = self.wrap(model, wrap)
            seen = []
            model.blocks[0].net1.register_forward_pre_hook(
                lambda m, _, seen=seen: seen.append(m.weight)
            )
            for step in range(2):
                ddp(self.inputs(step)).sum().backward()
                after = dict(model.named_parameters())
                self.assertEqual(list(after), list(before))
                for name, param in before.items():
                    self.assertIs(after[name], param, name)
            for key, value in model.state_dict().items():
                self.assertEqual(isinstance(value, DTensor), key.startswith("blocks"))
            self.assertIs(seen[0], before["blocks.0.net1.weight"])
            self.assertIsInstance(before["blocks.0.net1.weight"].grad, DTensor)

    def test_weight_read_outside_its_owner(self):
        """A TP weight read before its owner's forward (a regularizer) or after it."""
        for where in ("before", "after"):
            self.check_parity(setup=lambda m, step, w=where: setattr(m, "reads", (w,)))

    def test_freeze_after_wrapping(self):
        """A TP weight frozen after wrapping stays as it is."""
        frozen = "blocks.1.net2.weight"

        def freeze(m, step):
            if step == 1:
                m.get_parameter(frozen).requires_grad_(False)

        model = self.check_parity(steps=3, setup=freeze, find_unused_parameters=True)
        self.assertIsNone(model.get_parameter(frozen).grad)

    def test_deepcopy_trains_alone(self):
        """A deep copy of the module (EMA, evaluation) trains as TP alone."""
        reference, model = self.build()
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        ddp(self.inputs(0)).sum().backward()
        ref_ddp(self.inputs(0)).sum().backward()
        copies = copy.deepcopy(model), copy.deepcopy(reference)
        for m in copies:
            m.zero_grad()
            m(self.inputs(1)).pow(2).sum().backward()
        self.assert_grads_match(*copies)

    def test_functional_call(self):
        """torch.func.functional_call gives the tensors passed their gradients."""
        reference, model = self.build()
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        grads = []
        for d in (ddp, ref_ddp):
            params = {
                n: p.detach().clone().requires_grad_()
                for n, p in d.module.named_parameters()
            }
            x = self.inputs(0)
            torch.func.functional_call(d.module, params, (x,)).sum().backward()
            grads.append({n: full(p.grad) for n, p in params.items()})
        self.assertEqual(grads[0], grads[1])

    def test_wrap_under_no_grad(self):
        """Wrapping under torch.no_grad(), as DDP of a plain model allows."""
        reference, model = self.build()
        with torch.no_grad():
            ddp = self.wrap(model)
        self.step([(ddp, None), (self.ref_ddp(reference), None)], 0)
        self.assert_grads_match(model, reference)

    def test_wrap_twice(self):
        """The same model wrapped twice: the last DDP reduces its gradients once."""
        reference, model = self.build()
        first = self.wrap(model)
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        for step in range(2):
            self.step([(ddp, None), (ref_ddp, None)], step)
            self.assert_grads_match(model, reference)
        del first

    def test_activation_checkpointing(self):
        def use(kind):
            def setup(m, step):
                m.checkpoint = kind

            return setup

        for kind in ("reentrant", "non_reentrant"):
            self.check_parity(setup=use(kind))

    def test_comm_hook(self):
        self.check_parity(comm_hook=default_hooks.fp16_compress_hook)

    def check_hook_trains_as_tp_alone(self, register, optim=True, **options):
        """
        DDP of the TP model with the comm hook that ``register(ddp)`` registers,
        against TP alone on the dp group's batch (the mean of its ranks' losses),
        both stepped by SGD: by ``optim``, or by the hook.
        """
        _, model = self.build()
        tp_alone = copy.deepcopy(model)
        ddp = self.wrap(model, **options)
        register(ddp)
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, tp_alone)]
        dp_size = self.mesh["dp"].size()
        for step in range(3):
            ddp(self.inputs(step)).pow(2).sum().backward()
            losses = [
                tp_alone(self.inputs(step, r)).pow(2).sum() for r in range(dp_size)
            ]
            (sum(losses) / dp_size).backward()
            for o in optims if optim else optims[1:]:
                o.step()
            for m in (model, tp_alone):
                m.zero_grad()
        self.assertEqual(full_state(model), full_state(tp_alone), atol=1e-5, rtol=1e-5)

    def test_comm_hook_keyed_by_parameter(self):
        """_hook_then_optimizer steps the module's parameters, as TP alone's SGD."""

        def register(ddp):
            sgd = as_functional_optim(torch.optim.SGD, lr=0.1)
            state = _OptimizerHookState(sgd, ddp.module.parameters())
            hook = _hook_then_optimizer(default_hooks.allreduce_hook, state)
            ddp.register_comm_hook(self.mesh["dp"].get_group(), hook)

        for bucket_view in (False, True):
            self.check_hook_trains_as_tp_alone(
                register, optim=False, gradient_as_bucket_view=bucket_view
            )

    def test_bf16_compress_hook(self):
        """
        Against DDP without TP and the same hook, which rounds each gradient
        element alike (TP alone does not round). Under another name: DDP
        refuses bf16_compress_hook without NCCL 2.10.
        """

        def bf16_hook(state, bucket):
            return default_hooks.bf16_compress_hook(state, bucket)

        self.check_parity(comm_hook=bf16_hook)

    def test_powerSGD_hook(self):
        """
        PowerSGD compresses the local tensor of a DTensor gradient: of full rank
        (lossless), it trains as TP alone.
        """

        def register(ddp):
            state = powerSGD.PowerSGDState(
                self.mesh["dp"].get_group(),
                matrix_approximation_rank=DIM,  # no matrix has a smaller side over DIM
                start_powerSGD_iter=0,
                min_compression_rate=0,  # compress every matrix
                use_error_feedback=False,
                warm_start=False,
            )
            ddp.register_comm_hook(state, powerSGD.powerSGD_hook)

        self.check_hook_trains_as_tp_alone(register)

    def test_find_unused_parameters(self):
        """A block unused on one dp rank, or on every rank, and zero_grad() late."""

        def skip(m, step):
            # Unused on one DP rank only, or on every rank.
            unused = {1} if step == 3 or self.mesh["dp"].get_local_rank() else set()
            m.skipped = unused if step % 2 else set()

        for wrap in WRAPS:
            for bucket_view in (False, True):
                self.check_parity(
                    wrap,
                    steps=4,
                    setup=skip,
                    find_unused_parameters=True,
                    gradient_as_bucket_view=bucket_view,
                )

    def test_static_graph(self):
        for bucket_view in (False, True):
            self.check_parity(static_graph=True, gradient_as_bucket_view=bucket_view)

    def test_first_forward_without_grad(self):
        """A first forward under no_grad (evaluation) leaves training intact."""
        for wrap in WRAPS:
            reference, model = self.build()
            params = list(model.parameters())
            ddp, ref_ddp = self.wrap(model, wrap), self.ref_ddp(reference)
            with torch.no_grad():
                ddp(self.inputs(0))
            self.assertEqual(list(model.parameters()), params)
            self.step([(ddp, None), (ref_ddp, None)], 1)
            self.assert_grads_match(model, reference)

    def test_no_sync_gradient_accumulation(self):
        reference, model = self.build()
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        for micro in range(3):
            for d in (ddp, ref_ddp):
                # The last micro-batch synchronizes the accumulated gradients.
                with d.no_sync() if micro < 2 else contextlib.nullcontext():
                    d(self.inputs(micro)).pow(2).sum().backward()
        self.assert_grads_match(model, reference)

    def test_clip_grad_norm(self):
        """clip_grad_norm_ and get_total_norm over p.grad, as TP alone allows."""
        for wrap, two_step in ((w, t) for w in WRAPS for t in (0, 1)):
            torch.manual_seed(0)
            reference = TPBlock().to(self.device_type)
            model = copy.deepcopy(reference)
            plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
            parallelize_module(model, self.mesh["tp"], plan)
            ddp, ref_ddp = self.wrap(model, wrap), self.ref_ddp(reference)
            norms = []
            for d, m in ((ddp, model), (ref_ddp, reference)):
                d(self.inputs(0)).pow(2).sum().backward()
                if two_step:
                    norm = full(get_total_norm([p.grad for p in m.parameters()]))
                    clip_grads_with_norm_(m.parameters(), 0.5, norm)
                else:
                    norm = full(clip_grad_norm_(m.parameters(), 0.5))
                norms.append(norm)
            self.assertEqual(norms[0], norms[1], msg=wrap)
            self.assert_grads_match(model, reference)

    def test_init_after_replicate_equals_tp_alone(self):
        """Materialize from meta and initialize after replicate(): as TP alone."""
        models = []
        for wrap in (True, False):
            with torch.device("meta"):
                model = TPModel()
            parallelize_module(model, self.mesh["tp"], TP_PLAN)
            if wrap:
                replicate(model, device_mesh=self.mesh["dp"])
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
        reference = TPModel().to(self.device_type)
        reference.load_state_dict(full_state(tp_alone))
        optims = self.optims(model, reference)
        pairs = list(zip((model, self.ref_ddp(reference)), optims, strict=True))
        for step in range(2):
            self.step(pairs, step)
        self.assertEqual(full_state(model), reference.state_dict())

    def test_ddp_optimizer_split_trains_like_eager(self):
        """Split at DDP's bucket boundaries, a compiled TP model trains as eager TP."""
        torch.manual_seed(0)
        eager = SplitBlocks().to(self.device_type)
        parallelize_module(eager, self.mesh["tp"], SPLIT_TP_PLAN)
        model = copy.deepcopy(eager)
        splitter = DDPOptimizer(
            bucket_bytes_cap=SPLIT_BUCKET_BYTES,
            backend_compile_fn=lookup_backend("aot_eager"),
        )
        compiled = torch.compile(model, backend=splitter.compile_fn)
        optim = torch.optim.SGD(model.parameters(), lr=0.05)
        eager_optim = torch.optim.SGD(eager.parameters(), lr=0.05)
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(4, SPLIT_DIM, device=self.device_type)
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

    def test_compile_with_graph_splitting(self):
        """
        torch.compile(DDP(TP model)) with optimize_ddp on, several buckets: trains
        like the non-TP reference, and logs no warning of buckets extended past
        their capacity (stock DDP logs none on the reference).
        """
        mesh = self.mesh
        for backend in ("aot_eager", "inductor"):
            counters.clear()
            torch.manual_seed(0)
            reference = SplitBlocks().to(self.device_type)
            model = copy.deepcopy(reference)
            parallelize_module(model, mesh["tp"], SPLIT_TP_PLAN)
            for m in (reference, model):
                # Tied after TP, which gives each module its own DTensor.
                m.b2.net1.weight = m.b1.net1.weight
                m.b2.net2.weight.requires_grad_(False)
            bucket_cap_mb = SPLIT_BUCKET_BYTES / 2**20
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
                    x = torch.randn(4, SPLIT_DIM, device=self.device_type)
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

    def test_dtensor_buffer_broadcast(self):
        """
        A DTensor buffer replicated over the TP ranks or the dp mesh is broadcast
        from dp rank 0 at each forward, by its local tensor; training goes on.
        """
        for mesh in (self.mesh["tp"], self.mesh["dp"]):
            reference, model = self.build()
            scale = torch.ones(DIM, device=self.device_type)
            model.register_buffer("scale", DTensor.from_local(scale, mesh))
            ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
            for step in range(2):
                with torch.no_grad():  # rank 0's changes win over the others'
                    model.scale.add_(self.mesh["dp"].get_local_rank() + 1)
                for d in (ddp, ref_ddp):
                    d(self.inputs(step)).pow(2).sum().backward()
                self.assert_grads_match(model, reference, msg=f"step {step}")
                self.assertIsInstance(model.scale, DTensor)
                expected = torch.full_like(scale, step + 2)
                self.assertEqual(model.scale.to_local(), expected)

    def test_overlapping_group_raises(self):
        """
        DDP (or replicate) over a group that holds two ranks of a TP group would
        average different shards: every rank raises, before any shard changes.
        """
        tp = self.mesh["tp"]
        overlapping = {
            "default group": lambda m: DDP(m),
            "TP mesh": lambda m: DDP(m, device_mesh=tp),
            "TP ranks": lambda m: DDP(m, process_group=tp.get_group()),
            # replicate() builds its DDP at the first forward
            "replicate": lambda m: replicate(m)(self.inputs(0)),
        }
        for name, wrap in overlapping.items():
            _, model = self.build()
            shards = {
                n: p.to_local().clone()
                for n, p in model.named_parameters()
                if isinstance(p, DTensor)
            }
            with self.assertRaisesRegex(
                ValueError, r"DTensor parameter's mesh.*device_mesh=mesh\["
            ):
                wrap(model)
            for n, shard in shards.items():
                local = model.get_parameter(n).to_local()
                self.assertEqual(local, shard, atol=0, rtol=0, msg=f"{name}: {n}")

    def test_overlapping_dtensor_buffer_raises(self):
        """
        A DTensor buffer DDP broadcasts, sharded over a mesh sharing two ranks with
        DDP's group, raises on every rank, shards unchanged; unbroadcast, it trains.
        """
        world = init_device_mesh(self.device_type, (self.world_size,))
        cases = {  # a plain model, the default group; a TP model, the dp mesh
            "default group": (world, lambda: nn.Linear(DIM, DIM), DDP),
            "dp mesh": (self.mesh["dp"], lambda: self.build()[1], self.wrap),
        }
        for name, (mesh, build, wrap) in cases.items():
            model = build().to(self.device_type)
            local = torch.arange(4.0, device=self.device_type) + 4 * self.rank
            model.register_buffer("table", DTensor.from_local(local, mesh, [Shard(0)]))
            shard = local.clone()
            with self.assertRaisesRegex(ValueError, r"DTensor buffer's mesh.*mesh\["):
                wrap(model)
            wrap(model, broadcast_buffers=False)(self.inputs(0)).sum().backward()
            self.assertEqual(model.table.to_local(), shard, atol=0, rtol=0, msg=name)

    def test_replaced_param_raises(self):
        """load_state_dict(assign=True) after wrapping: one clear error."""
        _, other = self.build(seed=1)
        tp_sd = {k: v for k, v in other.state_dict().items() if k.startswith("b")}
        for wrap in WRAPS:
            _, model = self.build()
            ddp = self.wrap(model, wrap)
            ddp(self.inputs(0)).sum().backward()  # replicate wraps here
            model.load_state_dict(tp_sd, strict=False, assign=True)
            with self.assertRaisesRegex(RuntimeError, "do that before (wrapping|rep)"):
                ddp(self.inputs(1))

    def test_move_and_cast_after_wrapping(self):
        """.to() and .float() after wrapping (no-ops) swap DTensor parameters."""

        def move(m, step):
            if step == 0:
                m.to(self.device_type)
            else:
                m.float()

        for wrap in WRAPS:
            self.check_parity(wrap, setup=move)
        _, model = self.build()
        ddp = self.wrap(model)
        model.double()
        with self.assertRaisesRegex(
            RuntimeError, "replaced, moved or cast after wrapping"
        ):
            ddp(self.inputs(0).double())

    def test_find_unused_output_left_out_of_loss(self):
        """find_unused_parameters: an output of a TP weight that the loss leaves out."""

        class WithAux(nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, x):
                return self.model(x), self.model.blocks[1].net2.weight * 2

        reference, model = self.build()
        for m in (model, reference):
            m.skipped = {1}
        ddp = DDP(
            WithAux(model), device_mesh=self.mesh["dp"], find_unused_parameters=True
        )
        ref_ddp = self.ref_ddp(WithAux(reference), find_unused_parameters=True)
        for step in range(2):
            for d in (ddp, ref_ddp):
                d(self.inputs(step))[0].pow(2).sum().backward()
            self.assert_grads_match(model, reference, msg=f"step {step}")
            for m in (model, reference):
                m.zero_grad()

    def test_user_hook_sets_grad_none(self):
        """A post-accumulate-grad hook of the user's that sets the gradient to None."""

        def setup(m, step):
            for name in ("blocks.0.net1.weight", "head.weight") if step == 0 else ():
                m.get_parameter(name).register_post_accumulate_grad_hook(
                    lambda p: setattr(p, "grad", None)
                )

        for find_unused in (False, True):
            self.check_parity(setup=setup, find_unused_parameters=find_unused)

    def test_fused_optimizer(self):
        """_register_fused_optim steps the TP parameters it is given."""
        names = ("blocks.0.net1.weight", "blocks.1.net2.bias", "head.weight")
        reference, model = self.build()
        before = {k: v.clone() for k, v in full_state(model).items()}
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        for d, m in ((ddp, model), (ref_ddp, reference)):
            params = [m.get_parameter(name) for name in names]
            d._register_fused_optim(torch.optim.SGD, lr=0.1, optim_params=params)
        for step in range(2):
            self.step([(ddp, None), (ref_ddp, None)], step)
        after = full_state(model)
        self.assertEqual(after, reference.state_dict())
        for name, value in before.items():
            self.assertEqual(torch.equal(after[name], value), name not in names, name)

    def test_optimizer_in_backward_raises(self):
        """_apply_optimizer_in_backward on TP parameters: one clear error."""
        _, model = self.build()
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        ddp = self.wrap(model)
        with self.assertRaisesRegex(NotImplementedError, "_register_fused_optim"):
            ddp(self.inputs(0))

    def test_python_reducer_raises(self):
        """
        The Python reducer (compiled autograd's DDP path, which cannot trace the
        gradient hooks of DTensor parameters): every rank raises at wrapping
        (replicate: at its first forward), before any collective of the backward.
        """
        for wrap, compiled_autograd in [(w, c) for w in WRAPS for c in (False, True)]:
            config = torch._dynamo.config.patch(
                optimize_ddp="python_reducer", compiled_autograd=compiled_autograd
            )
            _, model = self.build()
            error = "Python reducer .* does not support DTensor"
            with config, self.assertRaisesRegex(NotImplementedError, error):
                self.wrap(model, wrap)(self.inputs(0)).sum().backward()
        dist.barrier()  # every rank raised alike

    def test_join_uneven_inputs(self):
        """join() with one more batch on one dp rank than on the other."""
        reference, model = self.build()
        optim, ref_optim = self.optims(model, reference)
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        steps = 2 + self.mesh["dp"].get_local_rank()
        for d, o in ((ddp, optim), (ref_ddp, ref_optim)):
            with d.join():
                for step in range(steps):
                    self.step([(d, o)], step)
        self.assertEqual(full_state(model), reference.state_dict())

    def test_pre_dp_module_transform(self):
        """
        _pre_dp_module_transform still gives DDP local tensors, as DDP before
        DTensor parameters expects: DDP(process_group=...) trains alike.
        """
        reference, model = self.build()
        _pre_dp_module_transform(model)
        self.assertFalse(any(isinstance(p, DTensor) for p in model.parameters()))
        pairs = list(
            zip(
                (
                    DDP(model, process_group=self.mesh["dp"].get_group()),
                    self.ref_ddp(reference),
                ),
                self.optims(model, reference),
                strict=True,
            )
        )
        for step in range(3):
            x = self.inputs(step)
            losses = [d(x).pow(2).sum() for d, _ in pairs]
            self.assertEqual(losses[0], losses[1], msg=f"step {step}")
            for loss, (_, optim) in zip(losses, pairs, strict=True):
                loss.backward()
                optim.step()
                optim.zero_grad()

    def test_bucket_sizes_count_local_tensors(self):
        """Buckets are sized by the local tensors of DTensor parameters."""
        _, model = self.build()
        ddp = self.wrap(model)
        local = sum(
            p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes
            for p in model.parameters()
        )
        sizes = ddp._get_ddp_logging_data()["bucket_sizes"]
        self.assertEqual(sum(int(size) for size in sizes.split(", ")), local)

    def test_dcp_state_dict_helpers(self):
        """get_/set_model_state_dict and get_/set_optimizer_state_dict round-trip."""
        reference, model = self.build()
        ddp, ref_ddp = self.wrap(model), self.ref_ddp(reference)
        # foreach=True, the default on CUDA, over DTensor and plain parameters.
        adamw = functools.partial(torch.optim.AdamW, lr=0.05, foreach=True)
        optim, ref_optim = adamw(model.parameters()), adamw(reference.parameters())
        for step in range(2):
            self.step([(ddp, optim), (ref_ddp, ref_optim)], step)
        ref_msd = get_model_state_dict(ref_ddp)
        ref_osd = get_optimizer_state_dict(ref_ddp, ref_optim)
        tp_keys = {k for k in ref_msd if k.startswith("blocks.")}
        cases = [
            StateDictOptions(),
            StateDictOptions(
                full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True
            ),
        ]
        saved = []
        for options in cases:
            msd = get_model_state_dict(ddp, options=options)
            osd = get_optimizer_state_dict(ddp, optim, options=options)
            if not (options.full_state_dict and self.rank):
                # TP parameters and their states as DTensors, unless full.
                sharded = not options.full_state_dict
                states = [osd["state"][k]["exp_avg"] for k in tp_keys]
                for value in [msd[k] for k in tp_keys] + states:
                    self.assertEqual(isinstance(value, DTensor), sharded)
                self.assertEqual({k: full(v) for k, v in msd.items()}, ref_msd)
                for fqn, state in ref_osd["state"].items():
                    actual = {k: full(v) for k, v in osd["state"][fqn].items()}
                    self.assertEqual(actual, state, msg=f"{options} {fqn}")
            saved.append((options, copy.deepcopy((msd, osd))))
        self.step([(ddp, optim)], 2)
        for options, (msd, osd) in saved:
            _, fresh = self.build(seed=1)
            fresh_ddp = self.wrap(fresh)
            fresh_optim = adamw(fresh.parameters())
            set_model_state_dict(fresh_ddp, msd, options=options)
            set_optimizer_state_dict(fresh_ddp, fresh_optim, osd, options=options)
            self.step([(fresh_ddp, fresh_optim)], 2)
            self.assertEqual(full_state(fresh), full_state(model), atol=0, rtol=0)

    def test_compile_training_parity(self):
        """torch.compile(DDP(TP model)) trains like the non-TP reference, one graph."""
        for backend in ("aot_eager", "inductor"):
            counters.clear()
            reference, model = self.build()
            ddp = torch.compile(self.wrap(model), backend=backend)
            optims = self.optims(model, reference)
            pairs = list(zip((ddp, self.ref_ddp(reference)), optims, strict=True))
            graphs = []
            for step in range(3):
                self.step(pairs, step)
                graphs.append(counters["stats"]["unique_graphs"])
            self.assertEqual(full_state(model), reference.state_dict())
            self.assertEqual(graphs, [1, 1, 1], msg=backend)

    # TP plans whose gradients arrive with other placements than their
    # parameters', against TP alone on the same global batch.

    def tokens(self, step, global_batch=False):
        """The batch of this dp rank at ``step``, or all dp ranks' together."""

        def batch(dp_rank):
            gen = torch.Generator().manual_seed(1000 * step + dp_rank)
            tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
            return tokens.to(self.device_type)

        if global_batch:
            return torch.cat([batch(r) for r in range(self.mesh["dp"].size())])
        return batch(self.mesh["dp"].get_local_rank())

    def build_transformer(self, seq_parallel=False, **kwargs):
        """Upstream's test Transformer under TP: one for TP alone, one to wrap."""
        torch.manual_seed(0)
        model = Transformer(transformer_args(**kwargs)).to(self.device_type)
        return [
            # Local attention outputs: SDPA on CPU has no DTensor rule.
            Transformer.parallelize(
                copy.deepcopy(model), self.mesh["tp"], seq_parallel, True
            )
            for _ in range(2)
        ]

    def assert_replicated_over_tp(self, model, msg=""):
        """Every Replicate or plain parameter is the same on every TP rank."""
        local = [
            p.to_local() if isinstance(p, DTensor) else p
            for p in model.parameters()
            if not isinstance(p, DTensor) or all(x.is_replicate() for x in p.placements)
        ]
        flat = torch.cat([t.detach().flatten() for t in local])
        gathered = [torch.empty_like(flat) for _ in range(TP_DEGREE)]
        dist.all_gather(gathered, flat, group=self.mesh["tp"].get_group())
        for other in gathered[1:]:
            self.assertEqual(other, gathered[0], atol=0, rtol=0, msg=msg)

    def check_tp_alone_parity(
        self,
        model,
        tp_alone,
        wrap="ddp",
        steps=3,
        loss=lm_loss,
        msg="",
        backend=None,
        **options,
    ):
        """
        Train ``model`` under DDP (or replicate) and ``tp_alone`` on the global
        batch: the same step-0 gradients, the same parameters after AdamW steps
        with clip_grad_norm_, and Replicate parameters equal on every TP rank.
        """
        optim, ref_optim = self.optims(model, tp_alone)
        ddp = self.wrap(model, wrap, **options)
        if backend is not None:
            ddp = torch.compile(ddp, backend=backend)
        for step in range(steps):
            loss(ddp, self.tokens(step)).backward()
            loss(tp_alone, self.tokens(step, global_batch=True)).backward()
            if step == 0:
                self.assert_grads_match(model, tp_alone, msg=msg)
            redistribute_grads(tp_alone)
            norms = [clip_grad_norm_(m.parameters(), 0.5) for m in (model, tp_alone)]
            self.assertEqual(full(norms[0]), full(norms[1]), msg=msg)
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()
        self.assertEqual(full_state(model), full_state(tp_alone), msg=msg)
        self.assert_replicated_over_tp(model, msg=msg)
        return ddp

    def test_transformer_trains_as_tp_alone(self):
        """
        Upstream's test Transformer: vocabulary-parallel embeddings (Replicate
        gradients of Shard(0) weights), a tied output, and sequence parallel
        norms (Partial gradients of Replicate weights) or plain ones.
        """
        configs = itertools.product((False, True), WRAPS, (False, True))
        for seq_parallel, wrap, bucket_view in configs:
            tp_alone, model = self.build_transformer(seq_parallel)
            self.check_tp_alone_parity(
                model,
                tp_alone,
                wrap,
                msg=f"seq_parallel={seq_parallel} {wrap} bucket_view={bucket_view}",
                gradient_as_bucket_view=bucket_view,
            )

    def test_vocab_parallel_embedding_and_sequence_parallel_norm(self):
        """
        Each layout alone: a vocabulary-parallel embedding, then with a sequence
        parallel norm and a plain head (the clip over Partial and plain gradients).
        """
        torch.manual_seed(0)
        embedding = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
        norm = SPNormModel()
        for module, plan in (
            (embedding, {"0": RowwiseParallel(input_layouts=Replicate())}),
            (norm, SPNormModel.plan),
        ):
            for bucket_view in (False, True):
                model, tp_alone = (
                    parallelize_module(copy.deepcopy(module), self.mesh["tp"], plan)
                    for _ in range(2)
                )
                self.check_tp_alone_parity(
                    model,
                    tp_alone,
                    msg=f"{type(module[1]).__name__} bucket_view={bucket_view}",
                    gradient_as_bucket_view=bucket_view,
                )

    def test_transformer_meta_init_after_replicate(self):
        """
        A training library's flow: build on meta, apply the TP plan, replicate(),
        to_empty() and init, then the optimizer, train, and DCP's state dict.
        """
        models = []
        for wrap in (True, False):
            with torch.device("meta"):
                model = Transformer(transformer_args())
            Transformer.parallelize(model, self.mesh["tp"], True, True)
            if wrap:
                replicate(model, device_mesh=self.mesh["dp"])
            model.to_empty(device=self.device_type)
            torch.manual_seed(5)  # the same on every rank, as TP requires
            for m in model.modules():
                if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                    m.reset_parameters()
            models.append(model)
        model, tp_alone = models
        self.assertEqual(full_state(model), full_state(tp_alone), atol=0, rtol=0)
        optim, ref_optim = self.optims(model, tp_alone)
        for step in range(3):
            lm_loss(model, self.tokens(step)).backward()
            lm_loss(tp_alone, self.tokens(step, global_batch=True)).backward()
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()
        msd, ref_msd = (get_model_state_dict(m) for m in (model, tp_alone))
        self.assertEqual(list(msd), list(ref_msd))
        for key, value in msd.items():
            self.assertIsInstance(value, DTensor)
            self.assertEqual(value.full_tensor(), ref_msd[key].full_tensor(), msg=key)
        self.assert_replicated_over_tp(model)

    def test_transformer_static_graph_and_find_unused(self):
        """static_graph, and find_unused_parameters with a weight frozen mid-run."""
        frozen = "layers.0.feed_forward.w2.weight"
        for seq_parallel, options in itertools.product(
            (False, True), ({"static_graph": True}, {"find_unused_parameters": True})
        ):
            tp_alone, model = self.build_transformer(seq_parallel)
            loss = lm_loss
            if "find_unused_parameters" in options:  # frozen before step 1
                loss = freezing_loss((model, tp_alone), frozen, at_call=2)

            msg = f"seq_parallel={seq_parallel} {options}"
            self.check_tp_alone_parity(model, tp_alone, loss=loss, msg=msg, **options)

    def test_transformer_no_sync(self):
        """Gradient accumulation over micro-batches, the last one synchronized."""
        tp_alone, model = self.build_transformer(seq_parallel=True)
        ddp = self.wrap(model)
        for micro in range(3):
            with ddp.no_sync() if micro < 2 else contextlib.nullcontext():
                lm_loss(ddp, self.tokens(micro)).backward()
            lm_loss(tp_alone, self.tokens(micro, global_batch=True)).backward()
        self.assert_grads_match(model, tp_alone)

    def test_transformer_compile(self):
        """torch.compile(DDP(TP Transformer)) trains as TP alone, in one graph."""
        counters.clear()
        tp_alone, model = self.build_transformer(seq_parallel=True)
        self.check_tp_alone_parity(model, tp_alone, backend="aot_eager")
        self.assertEqual(counters["stats"]["unique_graphs"], 1)

    def test_transformer_patterns(self):
        """
        A weight read before its owner's forward (a regularizer), activation
        checkpointing, then a deep copy and functional_call of the trained module.
        """

        def regularized(module, tokens):
            layers = (module.module if isinstance(module, DDP) else module).layers
            extra = full(layers[0].feed_forward.w2.weight).pow(2).sum()
            return 0.01 * extra + lm_loss(module, tokens)

        for kwargs in ({}, {"checkpoint_activations": True}):
            tp_alone, model = self.build_transformer(True, **kwargs)
            loss = regularized if not kwargs else lm_loss
            self.check_tp_alone_parity(model, tp_alone, loss=loss, msg=str(kwargs))
        copies = copy.deepcopy(model), copy.deepcopy(tp_alone)
        for m in copies:
            lm_loss(m, self.tokens(3, global_batch=True)).backward()
        self.assert_grads_match(*copies, reduced=False)
        grads = []
        for m in (model, tp_alone):
            params = {
                n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()
            }
            tokens = self.tokens(4, global_batch=True)
            call = functools.partial(torch.func.functional_call, m, params)
            lm_loss(call, tokens).backward()
            grads.append({n: full(p.grad) for n, p in params.items()})
        self.assertEqual(grads[0], grads[1])

    def check_step_parity(self, ddp, model, tp_alone, step_fn, steps=3, average=False):
        """
        ``step_fn(module, tokens)`` (forward and backward) of ``ddp`` and of
        ``tp_alone`` on the global batch (``average``: on each dp rank's batch,
        gradients averaged): the same step-0 gradients, the same parameters
        after AdamW steps, Replicate parameters equal over TP.
        """
        optim, ref_optim = self.optims(model, tp_alone)
        dp = self.mesh["dp"].size()
        for step in range(steps):
            step_fn(ddp, self.tokens(step))
            tokens = self.tokens(step, global_batch=True)
            for batch in tokens.chunk(dp) if average else (tokens,):
                step_fn(tp_alone, batch)
            for p in tp_alone.parameters() if average else ():
                p.grad.div_(dp)
            if step == 0:
                for name, ref in tp_alone.named_parameters():
                    grad = model.get_parameter(name).grad
                    self.assertEqual(full(grad), full(ref.grad), msg=name)
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()
        self.assertEqual(full_state(model), full_state(tp_alone))
        self.assert_replicated_over_tp(model)

    def test_transformer_autocast(self):
        """
        The test Transformer (plain norms, then sequence parallel) under DDP with
        CPU bf16 torch.autocast around the forward, against TP alone run on each
        dp rank's batch (gradients averaged): 3 AdamW steps, the same step-0
        gradients and parameters, Replicate parameters equal over TP.
        """

        def step(module, tokens):
            with torch.autocast(self.device_type, dtype=torch.bfloat16):
                logits = module(tokens)
            target = tokens.roll(-1, 1).flatten()
            F.cross_entropy(logits.float().flatten(0, 1), target).backward()

        for seq_parallel in (False, True):
            tp_alone, model = self.build_transformer(seq_parallel)
            ddp = self.wrap(model)
            # Per dp batch: bf16 matmuls over a half and the whole batch round apart.
            self.check_step_parity(ddp, model, tp_alone, step, average=True)

    def test_loss_parallel(self):
        """
        loss_parallel() over logits sharded over the vocabulary (DTensor outputs
        of the forward), under DDP and under replicate, against TP alone on the
        global batch: 3 AdamW steps, the same step-0 gradients and parameters.
        """

        def step(module, tokens):
            logits = module(tokens)
            self.assertEqual(logits.placements, (Shard(2),))
            with loss_parallel():
                target = tokens.roll(-1, 1).flatten()
                F.cross_entropy(logits.flatten(0, 1), target).backward()

        torch.manual_seed(0)
        module = VocabParallelLM().to(self.device_type)
        for wrap in WRAPS:
            model, tp_alone = (
                parallelize_module(copy.deepcopy(module), self.mesh["tp"], module.plan)
                for _ in range(2)
            )
            ddp = self.wrap(model, wrap)
            self.check_step_parity(ddp, model, tp_alone, step)

    def test_dcp_resume_onto_another_mesh(self):
        """
        DDP(TP) trained 2 AdamW steps on the 2 x 2 dp x tp mesh, its model and
        optimizer state saved by DCP, then loaded into a fresh DDP(TP) on a 1 x 4
        mesh and on the 2 x 2 mesh with dp and tp swapped: the same parameters
        and AdamW state, exactly.
        """
        _, model = self.build()
        ddp = self.wrap(model)
        optim = self.optims(model)[0]
        for step in range(2):
            self.step([(ddp, optim)], step)
        saved = full_state(model)
        saved_optim = {
            fqn: {k: full(v) for k, v in state.items()}
            for fqn, state in get_optimizer_state_dict(ddp, optim)["state"].items()
        }
        with TemporaryDirectoryName() as path:
            paths = [path]
            dist.broadcast_object_list(paths)  # rank 0's directory
            dcp.save(
                {
                    "model": get_model_state_dict(ddp),
                    "optim": get_optimizer_state_dict(ddp, optim),
                },
                checkpoint_id=paths[0],
            )
            for shape, names in (((1, 4), ("dp", "tp")), ((2, 2), ("tp", "dp"))):
                mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
                torch.manual_seed(1)
                fresh = TPModel().to(self.device_type)
                parallelize_module(fresh, mesh["tp"], TP_PLAN)
                fresh_ddp = DDP(fresh, device_mesh=mesh["dp"])
                fresh_optim = self.optims(fresh)[0]
                state = {
                    "model": get_model_state_dict(fresh_ddp),
                    "optim": get_optimizer_state_dict(fresh_ddp, fresh_optim),
                }
                dcp.load(state, checkpoint_id=paths[0])
                set_model_state_dict(fresh_ddp, state["model"])
                set_optimizer_state_dict(fresh_ddp, fresh_optim, state["optim"])
                msg = f"mesh {dict(zip(names, shape, strict=True))}"
                self.assertEqual(full_state(fresh), saved, atol=0, rtol=0, msg=msg)
                fresh_osd = get_optimizer_state_dict(fresh_ddp, fresh_optim)["state"]
                for fqn, expected in saved_optim.items():
                    actual = {k: full(v) for k, v in fresh_osd[fqn].items()}
                    self.assertEqual(
                        actual, expected, atol=0, rtol=0, msg=f"{msg} {fqn}"
                    )
                dist.barrier()


if __name__ == "__main__":
    run_tests()
