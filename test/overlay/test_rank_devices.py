"""Where the multi-rank tests run (tools/rank_devices.py): on CPU with gloo wherever the machine has fewer GPUs
than the test's ranks, on the GPUs where it has enough. Checked on fake machines: this one has no GPU."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path
from unittest import mock

import torch
from scratch_env import REPO_ROOT, clean_env, run
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorContinuousTestBase, DTensorTestBase

from tools.rank_devices import HIDE_GPUS, rank_env, rank_env_here, world_size

ONE_GPU_PLUGIN = """
import torch

torch.accelerator.current_accelerator = lambda: torch.device("cuda")
torch.accelerator.device_count = lambda: 1
"""

SYNTHETIC_TESTS = textwrap.dedent(
    """
    import os
    import unittest


    class MultiProcessTestCase(unittest.TestCase):  # named as upstream's base class: the suite goes by the name
        world_size = 4


    class FourRanks(MultiProcessTestCase):
        def test_ranks_see_no_gpu(self):
            self.assertEqual(os.environ.get("CUDA_VISIBLE_DEVICES"), "")


    class SingleProcess(unittest.TestCase):
        def test_sees_the_gpu(self):
            self.assertNotIn("CUDA_VISIBLE_DEVICES", os.environ)
    """
)


class TwoRanks(DTensorContinuousTestBase):
    world_size = 2


class FourRanks(DTensorContinuousTestBase):
    world_size = 4


class OneRankPerGpu(MultiProcContinuousTest):
    pass  # world_size unset: one rank per GPU


class SingleProcess(TestCase):
    pass


def machine(accelerator: str | None, count: int):
    """A fake machine with ``count`` devices of ``accelerator`` (None: no accelerator), as torch sees it."""
    device = None if accelerator is None else torch.device(accelerator)
    return mock.patch.multiple(
        torch.accelerator, current_accelerator=lambda: device, device_count=lambda: count if device else 0
    )


class TestRankDevices(unittest.TestCase):
    def test_world_size_of_a_test_class(self) -> None:
        self.assertEqual([world_size(c) for c in (TwoRanks, FourRanks)], [2, 4])
        self.assertEqual(world_size(DTensorTestBase), 4)  # a property of the instance, NUM_DEVICES below 2 GPUs
        self.assertEqual([world_size(c) for c in (OneRankPerGpu, SingleProcess, None)], [None, None, None])

    def test_fewer_gpus_than_ranks_hide_them(self) -> None:
        for gpus, two, four in ((0, {}, {}), (1, HIDE_GPUS, HIDE_GPUS), (2, {}, HIDE_GPUS), (4, {}, {}), (8, {}, {})):
            with self.subTest(gpus=gpus), machine("cuda" if gpus else None, gpus):
                self.assertEqual(rank_env_here(TwoRanks), two)
                self.assertEqual(rank_env_here(FourRanks), four)
                self.assertEqual(rank_env_here(OneRankPerGpu), {})
                self.assertEqual(rank_env_here(SingleProcess), {})
        self.assertEqual(rank_env(4, "xpu", 1), {}, "only CUDA (and ROCm) GPUs are hidden")

    def test_a_hidden_gpu_makes_a_rank_pick_cpu_and_gloo(self) -> None:
        """What a rank of a 4-rank test does on a one-GPU machine: it sees no GPU, so the DTensor harness of
        every base picks CPU and gloo, where 2.13's and 2.14's would skip with the GPU in sight. (On a machine
        with a GPU this also shows that the variable hides it.)"""
        env = {**os.environ, **HIDE_GPUS, "PYTHONPATH": os.pathsep.join(sys.path)}
        code = (
            "from torch.testing._internal.distributed._tensor import common_dtensor as c\n"
            "class T(c.DTensorContinuousTestBase):\n    world_size = 4\n"
            "print(T.backend_str(), T.__new__(T).device_type)\n"  # an instance's, as a test reads it
        )
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(result.stdout.split(), ["gloo", "cpu"], result.stderr)

    def test_the_suite_hides_the_gpu_from_a_red_test_with_more_ranks(self) -> None:
        """The suite's conftest on a fake one-GPU machine: a listed red test of 4 ranks runs (a skip would fail
        the run) with the GPU hidden while it runs, and a single-process test keeps it."""
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "test" / "overlay").mkdir(parents=True)
            (root / "test" / "conftest.py").write_text((REPO_ROOT / "test" / "conftest.py").read_text())
            harness = Path("overlay", "boot", "_torch_harness.py")  # the conftest's glue, without the start-up hook
            (root / "test" / harness).parent.mkdir()
            (root / "test" / harness).write_text((REPO_ROOT / "test" / harness).read_text())
            (root / "test" / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
            red = "test/test_synthetic.py::FourRanks::test_ranks_see_no_gpu a pattern\n"
            (root / "test" / "overlay" / "red_on_stock.txt").write_text(red)
            (root / "one_gpu.py").write_text(ONE_GPU_PLUGIN)
            (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = '-p no:cacheprovider'\n")
            env = clean_env(PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{root}")
            env.pop("CUDA_VISIBLE_DEVICES", None)
            result = run([sys.executable, "-m", "pytest", "-p", "one_gpu", "-rA", "test"], env=env, cwd=root)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertRegex(result.stdout, r"2 passed")


if __name__ == "__main__":
    unittest.main()
