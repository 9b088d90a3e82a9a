# Owner(s): ["oncall: distributed"]

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor, DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.testing._internal.common_utils import run_tests, TEST_WITH_DEV_DBG_ASAN
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print("Skip dev-asan as torch + multiprocessing spawn have known issues")
    sys.exit(0)

DIM = 8


class Net(nn.Module):
    """A TP block between plain layers: DTensor and plain parameters of one dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.net1 = nn.Linear(DIM, 2 * DIM)
        self.net2 = nn.Linear(2 * DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.net2(F.relu(self.net1(self.embed(x))))
        return self.head(self.norm(x))


class TestOptimizerMixedParams(DTensorContinuousTestBase):
    world_size = 2

    def test_group_tensors_keeps_dtensors_apart(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        plain = [torch.randn(4, device=self.device_type) for _ in range(3)]
        dtensors = [distribute_tensor(t, mesh, [Shard(0)]) for t in plain]
        params = [plain[0], dtensors[0], plain[1], dtensors[1], dtensors[2]]
        grads = [p.clone() for p in params]
        states = [None] * len(params)
        lists = [params, grads, states]
        grouped = _group_tensors_by_device_and_dtype(lists, with_indices=True)
        seen = []
        for (device, dtype), (tensorlists, indices) in grouped.items():
            self.assertEqual((device.type, dtype), (self.device_type, torch.float32))
            types = {type(t) for t in tensorlists[0] + tensorlists[1]}
            self.assertEqual(len(types), 1, f"a foreach group mixes {types}")
            for tensorlist, full in zip(tensorlists, lists, strict=True):
                self.assertEqual(len(tensorlist), len(indices))
                for t, i in zip(tensorlist, indices, strict=True):
                    self.assertIs(t, full[i])
            seen += indices
        self.assertEqual(len(grouped), 2)
        self.assertEqual(sorted(seen), list(range(len(params))))
        # Plain tensors only, and DTensors only: one group, as before
        for tensors in (plain, dtensors):
            grouped = _group_tensors_by_device_and_dtype([tensors])
            self.assertEqual(len(grouped), 1)
            ((key, ([group], _)),) = grouped.items()
            self.assertIs(type(key), tuple)
            self.assertEqual(list(map(id, group)), list(map(id, tensors)))

    def test_foreach_and_fused_optimizers_train_dtensor_and_plain_params(self):
        """A TP model with plain parameters trains like the non-parallel model."""
        optim = torch.optim
        configs = [
            (optim.AdamW, {"foreach": True}),
            (optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
            (optim.Adam, {"foreach": True, "amsgrad": True}),
            (optim.Adam, {"fused": True}),
            (optim.AdamW, {"fused": True}),
            (optim.AdamW, {}),  # foreach on CUDA by default
            (optim.Adagrad, {"foreach": True}),
            (optim.RMSprop, {"foreach": True, "momentum": 0.9}),
            (optim.NAdam, {"foreach": True}),
            (optim.RAdam, {"foreach": True}),
        ]
        self.run_subtests({"config": configs}, self._test_train, "tp")

    def test_optimizers_train_fsdp2_with_ignored_params(self):
        """FSDP2 leaves its ignored parameters plain."""
        configs = [
            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
            (torch.optim.AdamW, {"foreach": True}),
            (torch.optim.Adam, {"fused": True}),
        ]
        self.run_subtests({"config": configs}, self._test_train, "fsdp2")

    def _test_train(self, layout, config):
        optim_cls, kwargs = config
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        torch.manual_seed(0)
        ref = Net().to(self.device_type)
        model = copy.deepcopy(ref)
        if layout == "tp":
            plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
            parallelize_module(model, mesh, plan)
        else:
            ignored = set(model.norm.parameters()) | set(model.head.parameters())
            fully_shard(model, mesh=mesh, ignored_params=ignored)
        params = list(model.parameters())
        self.assertEqual(len({type(p) for p in params}), 2)
        ref_optim = optim_cls(ref.parameters(), **kwargs)
        optim = optim_cls(params, **kwargs)
        torch.manual_seed(1)  # the same batches on every rank
        for _ in range(3):
            x = torch.randn(4, DIM, device=self.device_type)
            for m, o in ((ref, ref_optim), (model, optim)):
                o.zero_grad()
                m(x).pow(2).sum().backward()
                o.step()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                p = p.full_tensor()
            self.assertEqual(p, ref_params[name], atol=1e-5, rtol=1e-5, msg=name)


if __name__ == "__main__":
    run_tests()
