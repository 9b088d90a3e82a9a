# Owner(s): ["oncall: distributed"]

from types import SimpleNamespace

from torch.distributed.fsdp._unshard_param_utils import _validate_unshard_params_args
from torch.testing._internal.common_utils import run_tests, TestCase


class TestUnshardOffloadWarning(TestCase):
    def test_offload_to_cpu_warning_text(self):
        """
        The warning for ``offload_to_cpu=True, rank0_only=False`` reads as a sentence.
        """
        with self.assertWarnsRegex(UserWarning, "may result in the unsharded"):
            _validate_unshard_params_args(
                SimpleNamespace(_handle=None),  # an FSDP state without parameters
                writeback=False,
                rank0_only=False,
                offload_to_cpu=True,
                with_grads=False,
            )


if __name__ == "__main__":
    run_tests()
