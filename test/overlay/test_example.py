"""examples/tp_ddp_train.py as a user runs it: torchrun, 4 CPU ranks (gloo), its own process tree.

With the overlay it trains, checkpoints and resumes where it saved; on stock torch (``pytest --stock``) it fails
the way the README says, so the README's account of stock stays true on every base. The ranks get the overlay
(or not) from the environment conftest sets, as any torchrun rank does.
"""

import re
import subprocess
import sys
import unittest
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tp_ddp_train.py"


def torchrun(*command: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (a free port: other jobs on the machine may hold torchrun's default)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def said(result: subprocess.CompletedProcess) -> str:
    """One line: the exit code, rank 0's last traceback lines (its exception) and what the script printed."""
    lines = result.stdout.splitlines()
    rank0 = [line.removeprefix("[rank0]:").strip() for line in lines if line.startswith("[rank0]:")]
    printed = [line for line in lines if re.match(r"(\d+ ranks|step|saved|resumed|one more|OK|FAILED)", line)]
    return f"exit {result.returncode}; rank 0: {' | '.join(rank0[-4:])}; printed: {' | '.join(printed)}"


class TestTpDdpExample(unittest.TestCase):
    def test_example_resumes_where_it_saved(self):
        result = torchrun(str(EXAMPLE))
        self.assertEqual(result.returncode, 0, said(result))
        # Checked here from what it prints, not only from its exit code: an example whose own check was broken
        # would still exit 0.
        saved = re.search(r"^saved to .*: loss (\S+)$", result.stdout, re.MULTILINE)
        resumed = re.search(r"^resumed: loss (\S+)$", result.stdout, re.MULTILINE)
        after = re.search(r"^one more step: loss (\S+) \(saved model\), (\S+) \(resumed\)$", result.stdout, re.M)
        self.assertTrue(saved and resumed and after, said(result))
        self.assertEqual(saved[1], resumed[1], said(result))
        self.assertEqual(after[1], after[2], said(result))
        self.assertIn("\nOK: ", result.stdout)

    def test_example_fails_when_the_checkpoint_does_not_restore(self):
        # The example's own check must be able to fail: here DCP loads nothing, so the fresh model keeps its
        # initial weights, and the run must end with the script's message and exit 1, not hang.
        skip_load = (
            "import runpy, torch.distributed.checkpoint as dcp; dcp.load = lambda *args, **kwargs: None; "
            f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')"
        )
        result = torchrun("--no-python", sys.executable, "-c", skip_load)
        self.assertNotEqual(result.returncode, 0, said(result))
        self.assertIn("FAILED: the checkpoint did not restore the model", result.stdout, said(result))


if __name__ == "__main__":
    unittest.main()
