"""``make gpu-check`` (tools/gpu_check.py) where no GPU is: its dry run finds everything it would run on one, its
time limits end what runs past them, children included, and its checks judge what the scripts print."""

import json
import os
import sys
import textwrap
import time
import unittest
from pathlib import Path

from scratch_env import REPO_ROOT, clean_env, run

from tools.gpu_check import SCRIPTS, Ran, bench_rows, compare_script, shared_row
from tools.gpu_check import run as run_limited


def printed(wrapper: str, losses: list[str], ok: bool = True, device: str = "cuda (nccl)") -> Ran:
    """What a script prints on one rank, and its exit."""
    lines = [f"1 ranks on {device}, mesh dp=1 x tp=1{wrapper}"]
    lines += [f"step {i}: loss {loss}" for i, loss in enumerate(losses)]
    lines += ["OK: resumed" if ok else "FAILED: not resumed"]
    return Ran(0 if ok else 1, "\n".join(lines) + "\n", 1.0, False)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class TestGpuCheck(unittest.TestCase):
    def test_dry_run_finds_everything_and_says_so_in_one_line(self) -> None:
        env = clean_env(PYTHONPATH=str(REPO_ROOT))
        result = run([sys.executable, "-m", "tools.gpu_check", "--dry-run"], env=env)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertEqual(len(result.stdout.splitlines()), 1, result.stdout)
        self.assertRegex(result.stdout, rf"dry run only; found {len(SCRIPTS)} scripts .* \d+ tests in \d+ classes")

    def test_a_child_past_its_limit_is_killed_with_its_children(self) -> None:
        # A child that starts a grandchild (as pytest starts ranks), then hangs: both end at the limit.
        code = textwrap.dedent(
            """
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(child.pid, flush=True)
            time.sleep(600)
            """
        )
        ran = run_limited([sys.executable, "-c", code], 3, env=dict(os.environ))
        self.assertTrue(ran.timed_out)
        grandchild = int(ran.output.split()[0])
        for _ in range(100):
            if not running(grandchild):
                break
            time.sleep(0.1)
        self.assertFalse(running(grandchild), "the child's child outlived the limit")

    def test_the_data_parallel_run_must_train_as_tp_alone(self) -> None:
        script = "examples/tp_ddp_train.py"
        alone = printed(", TP alone (no DDP)", ["5.0435", "4.9000"])
        row = compare_script(script, "cuda", printed("", ["5.0435", "4.9000"]), alone)
        self.assertEqual(row.result, "ok", row.detail)
        row = compare_script(script, "cuda", printed("", ["5.0435", "4.9500"]), alone)
        self.assertEqual(row.result, "FAILED", row.detail)
        row = compare_script(script, "cuda", printed("", ["5.0435", "4.9000"], ok=False), alone)
        self.assertEqual(row.result, "FAILED", row.detail)  # its own resume check failed
        row = compare_script(script, "cuda", printed("", ["5.0435", "4.9000"], device="cpu (gloo)"), alone)
        self.assertEqual(row.result, "FAILED", row.detail)  # not on the GPU

    def test_ranks_sharing_the_device_must_train_as_the_plain_model_and_keep_dtensors(self) -> None:
        def ran(got: list[float], kept: int) -> Ran:
            ranks = [[rank, got, [5.0294, 4.9323], kept, 16] for rank in range(4)]
            return Ran(0, f"SHARED {json.dumps(ranks)}\n", 1.0, False)

        self.assertEqual(shared_row("cuda", ran([5.0294, 4.9323], 16)).result, "ok")
        self.assertEqual(shared_row("cuda", ran([5.0294, 4.9400], 16)).result, "FAILED")
        self.assertEqual(shared_row("cuda", ran([5.0294, 4.9323], 0)).result, "FAILED")  # stock: DTensors dropped
        self.assertEqual(shared_row("cuda", Ran(None, "SHARED null\n", 9.0, True)).result, "timeout")

    def test_bench_rows(self) -> None:
        ms = {"plain": 1.0, "plain_ddp": 1.5, "tp": 2.0, "tp_ddp": 2.2, "tp_ddp_stock": 2.0}
        ms |= {f"{k}_compiled": v for k, v in ms.items() if k != "tp_ddp_stock"}
        rows = bench_rows("launch-bound", ms, 1.0)
        self.assertEqual([r.check for r in rows], ["launch-bound, eager", "launch-bound, compiled"])
        self.assertIn("TP + DDP 2.200 ms: x1.100 (+0.200 ms", rows[0].detail)
        self.assertIn("plain model + DDP: x1.500", rows[0].detail)
        self.assertIn("overlay / stock DDP(TP) 1.100", rows[0].detail)


if __name__ == "__main__":
    unittest.main()
