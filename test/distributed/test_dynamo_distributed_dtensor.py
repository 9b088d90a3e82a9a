# Owner(s): ["module: dynamo"]
import copy
import logging

import torch
import torch._dynamo.test_case
import torch._dynamo.testing
import torch.distributed as dist
from torch import nn
from torch._dynamo.backends.distributed import DDPOptimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.testing._internal.distributed.fake_pg import FakeStore


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class TestDDPOptimizerDTensor(torch._dynamo.test_case.TestCase):
    """
    DDPOptimizer's bucketing of graphs that compute on DTensors (tensor
    parallel models), in one process: a fake process group of two ranks.
    """

    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        self.addCleanup(dist.destroy_process_group)
        self.mesh = init_device_mesh("cpu", (2,))

    def compile(self, model):
        # A bucket per parameter: split wherever the graph can be split.
        cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        ddp_optimizer = DDPOptimizer(
            bucket_bytes_cap=1, backend_compile_fn=cnt, first_bucket_cap=1
        )
        return torch.compile(model, backend=ddp_optimizer.compile_fn), cnt

    def test_split_between_parallel_modules(self):
        """
        No split where a DTensor or the device mesh would pass from one split
        graph to the next (AOT autograd fails on them there): a tensor parallel
        model splits between its parallel modules, which take and give plain
        tensors.
        """
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(16, 16),
            nn.Linear(16, 32),
            nn.ReLU(),
            nn.Linear(32, 16),
            nn.Linear(16, 16),
        )
        plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
        parallelize_module(model, self.mesh, plan)
        eager_model = copy.deepcopy(model)
        opt_model, cnt = self.compile(model)
        inputs = torch.randn(4, 16)
        opt_outputs = opt_model(inputs)
        correct_outputs = eager_model(inputs)
        self.assertEqual(opt_outputs, correct_outputs)
        opt_outputs.sum().backward()
        correct_outputs.sum().backward()
        for p, ref in zip(model.parameters(), eager_model.parameters(), strict=True):
            self.assertEqual(local(p.grad), local(ref.grad))
        # One split graph per linear layer.
        self.assertEqual(cnt.frame_count, 4)

    def test_no_split_point_compiles_one_graph(self):
        """
        A model on DTensors from end to end has no point where its graph can
        be split: it compiles as one graph, whose gradients DDP cannot reduce
        while backward runs. DDPOptimizer warns of that once, naming the first
        value in graph order that crosses the split points: here the input made
        a DTensor.
        """
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        plan = {
            "0": ColwiseParallel(use_local_output=False),
            "2": RowwiseParallel(use_local_output=False),
        }
        parallelize_module(model, self.mesh, plan)
        torch._logging._internal.warning_once.cache_clear()
        self.addCleanup(torch._logging._internal.warning_once.cache_clear)
        messages, graphs = [], []
        for _ in range(2):
            torch._dynamo.reset()
            cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
            ddp_optimizer = DDPOptimizer(
                bucket_bytes_cap=1, backend_compile_fn=cnt, first_bucket_cap=1
            )

            def compile_fn(gm, example_inputs, ddp_optimizer=ddp_optimizer):
                graphs.append(gm)
                return ddp_optimizer.compile_fn(gm, example_inputs)

            opt_model = torch.compile(model, backend=compile_fn)
            with self.assertLogs(DDPOptimizer.__module__, level="INFO") as captured:
                opt_model(torch.randn(4, 16))
            self.assertEqual(cnt.frame_count, 1)
            # Expected for such a model: no warning of buckets extended past
            # their capacity, only the lost overlap.
            messages += [
                r.getMessage() for r in captured.records if r.levelno >= logging.WARNING
            ]
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("did not split this graph", messages[0])
        self.assertIn("DTensor", messages[0])
        first = next(
            n.name
            for n in graphs[0].graph.nodes
            if n.op != "placeholder"
            and isinstance(n.meta.get("example_value"), DTensor)
        )
        self.assertIn(f"such as {first} (the first in graph order)", messages[0])


if __name__ == "__main__":
    from torch._dynamo.test_case import run_tests

    run_tests()
