# Owner(s): ["oncall: distributed"]
import contextlib
import copy
import itertools
import math
import os
import sys
import unittest
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Union
from unittest import mock

import torch
import torch.distributed.fsdp._traversal_utils as traversal_utils
import torch.distributed.fsdp._unshard_param_utils as unshard_param_utils
import torch.nn as nn
from torch import distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp._common_utils import (
    clean_tensor_name,
    HandleTrainingState,
    TrainingState,
)
from torch.distributed.fsdp._flat_param import FlatParameter, FlatParamHandle
from torch.distributed.fsdp._unshard_param_utils import _validate_unshard_params_args
from torch.distributed.fsdp.fully_sharded_data_parallel import FLAT_PARAM
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel.distributed import DistributedDataParallel as DDP
from torch.profiler import profile, ProfilerActivity
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_fsdp import (
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTest,
    FSDPTestMixin,
    get_devtype,
    NestedWrappedModule,
    TransformerWithSharedParams,
)
from torch.testing._internal.common_utils import (
    run_tests,
    TEST_WITH_DEV_DBG_ASAN,
    TestCase,
)


device_type = torch.device(get_devtype())

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print(
        "Skip dev-asan as torch + multiprocessing spawn have known issues",
        file=sys.stderr,
    )
    sys.exit(0)


class TestUnshardParamsBase(FSDPTest):
    """
    This contains any methods common to both the sharded and non-sharded cases.
    """

    def _test_unshard_params_writeback(
        self,
        writeback: bool,
        check_outer: bool,
        **fsdp_kwargs: Dict[str, Any],
    ):
        model = nn.Sequential(
            nn.Linear(5, 5, bias=False, device=device_type.type),
            nn.Linear(5, 3, bias=False, device=device_type.type),
        )
        model[0] = FSDP(model[0], **fsdp_kwargs)
        model = FSDP(model, **fsdp_kwargs)
        uses_sharded_strategy = model.sharding_strategy != ShardingStrategy.NO_SHARD
        offloading_params = model.cpu_offload.offload_params

        # Assumes depth-first `.parameters()`
        outer_param: Union[FlatParameter, nn.Parameter] = next(model.parameters())
        inner_param: Union[FlatParameter, nn.Parameter] = next(model[0].parameters())
        param_to_check = outer_param if check_outer else inner_param

        # Write a known value to all elements of the *sharded* parameter or
        # `FlatParameter` to check
        with torch.no_grad():
            param_to_check.zero_()
            param_to_check += self.rank + 2
        # Zero the *unsharded* parameters
        with FSDP.summon_full_params(model, writeback=writeback), torch.no_grad():
            for param in model.parameters():
                param.zero_()

        # Check the 0th singleton element of the sharded parameter to see if
        # the zeroing from inside the context persists
        param_elem_to_check = param_to_check[0]
        if param_elem_to_check.numel() > 1:
            # For `use_orig_params=True` and `NO_SHARD`, the parameter
            # preserves the original 2D shape, so we must access one more time
            param_elem_to_check = param_elem_to_check[0]
        if writeback or (not uses_sharded_strategy and not offloading_params):
            # When FSDP does not use a sharded strategy and is not offloading
            # parameters to CPU, it directly exposes the tensor storage that
            # serves as the unsharded source of truth, so the write is always
            # reflected regardless of `writeback`.
            self.assertEqual(param_elem_to_check, 0)
        else:
            self.assertEqual(param_elem_to_check, self.rank + 2)
        if offloading_params:
            cpu_device = torch.device("cpu")
            for param in model.parameters():
                self.assertEqual(param.device, cpu_device)

    def _get_test_unshard_params_writeback_config(self) -> Dict[str, List[Any]]:
        return {
            "writeback": [True, False],
            "check_outer": [True, False],
            "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
            "cpu_offload": [
                CPUOffload(offload_params=False),
                CPUOffload(offload_params=True),
            ],
            "use_orig_params": [True, False],
        }

    def _test_unshard_params_param_data(
        self,
        rank0_only: bool,
        offload_to_cpu: bool,
        cpu_offload: CPUOffload,
        mixed_precision: Optional[MixedPrecision],
        use_orig_params: bool,
    ):
        local_model = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            DEVICEInitMode.DEVICE_BEFORE,
            fsdp_kwargs={"device_id": device_type.type},
            deterministic=True,
        )
        # Apply FSDP such that the root module does not have FSDP applied,
        # while there are multiple FSDP root submodules (as proven later)
        fsdp_model = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            fsdp_kwargs={
                "cpu_offload": cpu_offload,
                "mixed_precision": mixed_precision,
                "use_orig_params": use_orig_params,
            },
            deterministic=True,
        )
        self.assertFalse(isinstance(fsdp_model, FSDP))
        # Hard code the following names because getting them is non-trivial
        non_fsdp_managed_param_names = {
            "module.0.weight",
            "module.0.bias",
            "module.3.weight",
            "module.3.bias",
        }

        with FSDP.summon_full_params(
            fsdp_model,
            rank0_only=rank0_only,
            writeback=not rank0_only,
            offload_to_cpu=offload_to_cpu,
        ):
            if not rank0_only or self.rank == 0:
                for p1, (n2, p2) in zip(
                    local_model.parameters(), fsdp_model.named_parameters()
                ):
                    self.assertEqual(p1.shape, p2.shape)
                    if (
                        offload_to_cpu
                        and clean_tensor_name(n2) not in non_fsdp_managed_param_names
                    ):
                        self.assertEqual(torch.device("cpu"), p2.device)
                    else:
                        self.assertEqual(p1.device, p2.device)
                    self.assertEqual(
                        p1.dtype, p2.dtype
                    )  # even if FSDP uses mixed precision
                    self.assertEqual(p1, p2)
                    self.assertTrue(isinstance(p2, nn.Parameter))
            else:
                # Check that each `FlatParameter` has the sharded size as a
                # proxy for it being resharded
                for handle in traversal_utils._get_fsdp_handles(fsdp_model):
                    if handle.uses_sharded_strategy:
                        self.assertEqual(
                            handle.flat_param.shape, handle.flat_param._sharded_size
                        )
                    else:
                        self.assertEqual(
                            handle.flat_param.shape,
                            handle.flat_param._unpadded_unsharded_size,
                        )

        # Prove the number of FSDP roots after lazy initialization
        num_fsdp_roots = 0
        for fsdp_state in traversal_utils._get_fsdp_states(fsdp_model):
            num_fsdp_roots += fsdp_state._is_root
        self.assertGreater(num_fsdp_roots, 1)

    def _get_test_unshard_params_param_data_config(self) -> Dict[str, List[Any]]:
        return {
            "rank0_only": [False, True],
            "offload_to_cpu": [False, True],
            "cpu_offload": [
                CPUOffload(offload_params=False),
                CPUOffload(offload_params=True),
            ],
            "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
            "use_orig_params": [True, False],
        }


class TestUnshardParams(TestUnshardParamsBase):
    @property
    def world_size(self) -> int:
        return 2

    @skip_if_lt_x_gpu(2)
    def test_unshard_params_writeback(self):
        """Tests the ``writeback`` argument (using default for all others)."""
        self.run_subtests(
            self._get_test_unshard_params_writeback_config(),
            self._test_unshard_params_writeback,
        )

    @skip_if_lt_x_gpu(2)
    def test_unshard_params_param_data(self):
        """
        Tests that parameters are exposed correctly for ``recurse=True`` and
        all other argument configs for a non-FSDP root module.
        """
        self.run_subtests(
            self._get_test_unshard_params_param_data_config(),
            self._test_unshard_params_param_data,
        )

    @skip_if_lt_x_gpu(2)
    def test_unshard_singleton_param_writeback(self):
        """
        Tests ``writeback=True`` for a singleton parameter, which includes
        testing that writing to padding does not persist.
        NOTE: This method depends on FSDP internals.
        """
        model = FSDP(nn.Linear(1, 1, bias=False, device=device_type.type))
        flat_param = model._handle.flat_param
        self.assertEqual(1, flat_param.numel())
        # Write a known value to the *sharded* `FlatParameter`
        with torch.no_grad():
            # For nonzero ranks, this write is to padding
            flat_param[0] = self.rank + 2
        with FSDP.summon_full_params(model, writeback=True):
            self.assertEqual(1, flat_param.numel())
            with torch.no_grad():
                flat_param.zero_()
        # NOTE: This checks that writes to padding did not persist, which is
        # *not* strictly required for correctness.
        if self.rank == 0:  # did not write to padding
            self.assertEqual(0, flat_param[0])
        else:  # wrote to padding
            self.assertEqual(self.rank + 2, flat_param[0])

    @skip_if_lt_x_gpu(2)
    def test_unshard_params_respects_reshard(self):
        """
        Tests that unsharding parameters respects the expected reshard behavior
        between forward and backward as well as after backward.

        For mixed precision, we should *not* respect the reshard behavior
        because the ``summon_full_params()`` forces full precision, which uses
        a different all-gather tensor than the one already in memory and will
        not persist any modifications correctly.
        """
        self.run_subtests(
            {
                "rank0_only": [False, True],
                "offload_to_cpu": [False, True],
                "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
                "use_orig_params": [False, True],
            },
            self._test_unshard_params_respects_reshard,
        )

    def _test_unshard_params_respects_reshard(
        self,
        rank0_only: bool,
        offload_to_cpu: bool,
        mixed_precision: Optional[MixedPrecision],
        use_orig_params: bool,
    ):
        """NOTE: This method depends on FSDP internals."""
        fsdp_kwargs = {
            "mixed_precision": mixed_precision,
            "use_orig_params": use_orig_params,
        }
        model = FSDP(
            nn.Sequential(
                FSDP(
                    nn.Linear(5, 5, bias=False, device=device_type.type), **fsdp_kwargs
                ),
                nn.Linear(5, 3, bias=False, device=device_type.type),
            ),
            **fsdp_kwargs,
        )
        outer_flat_param = model._handle.flat_param
        inner_flat_param = model.module[0]._handle.flat_param
        # NOTE: This assumes uniform sharding with padding across ranks.
        expected_outer_flat_param_unsharded_numel = (
            outer_flat_param.numel() * self.world_size
        )

        def _get_unsharded_storage_size(flat_param: FlatParameter):
            return flat_param._full_param_padded.storage().size()

        # Validate the expected behavior: the root does not reshard after
        # forward; the non-root reshards after forward; and both reshard after
        # backward
        output = model(torch.zeros(5, device=device_type.type))
        self.assertEqual(
            expected_outer_flat_param_unsharded_numel,
            _get_unsharded_storage_size(outer_flat_param),
        )
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))
        output.sum().backward()
        self.assertEqual(0, _get_unsharded_storage_size(outer_flat_param))
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))

        # Check that with parameter unsharding in between forward and backward
        # as well as after backward, the reshard behavior matches
        output = model(torch.zeros(5, device=device_type.type))
        with FSDP.summon_full_params(
            model,
            rank0_only=rank0_only,
            writeback=not rank0_only,
            offload_to_cpu=offload_to_cpu,
        ):
            pass
        if mixed_precision is not None:
            # After forcing full precision, we must invalidate the existing
            # unsharded low-precision flat parameter since it will not persist
            # changes from the `summon_full_params()` context, so we cannot
            # respect the reshard behavior
            expected_outer_flat_param_unsharded_numel = 0
        self.assertEqual(
            expected_outer_flat_param_unsharded_numel,
            _get_unsharded_storage_size(outer_flat_param),
        )
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))
        output.sum().backward()
        with FSDP.summon_full_params(
            model,
            rank0_only=rank0_only,
            writeback=not rank0_only,
            offload_to_cpu=offload_to_cpu,
        ):
            pass
        self.assertEqual(0, _get_unsharded_storage_size(outer_flat_param))
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))

    @skip_if_lt_x_gpu(2)
    def test_unshard_params_recurse(self):
        """Tests the ``recurse`` argument (using default for all others)."""
        self.run_subtests(
            {
                "recurse": [False, True],
                "unshard_outer": [False, True],
                "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
                "use_orig_params": [False, True],
            },
            self._test_unshard_params_recurse,
        )

    def _test_unshard_params_recurse(
        self,
        recurse: bool,
        unshard_outer: bool,
        mixed_precision: Optional[MixedPrecision],
        use_orig_params: bool,
    ):
        """NOTE: This method depends on FSDP internals."""
        fsdp_kwargs = {
            "mixed_precision": mixed_precision,
            "use_orig_params": use_orig_params,
        }
        model = FSDP(
            nn.Sequential(
                FSDP(
                    nn.Linear(5, 5, bias=False, device=device_type.type), **fsdp_kwargs
                ),
                nn.Linear(5, 3, bias=False, device=device_type.type),
            ),
            **fsdp_kwargs,
        )
        # Hard code the numel values based on the model
        unsharded_inner_numel = 5 * 5
        unsharded_outer_numel = 5 * 3
        if use_orig_params:
            # Account for unsharded padding: since each `FlatParameter` only
            # has one original parameter, we only need to pad for divisibility
            # by world size and not address alignment
            if unsharded_inner_numel % self.world_size:
                unsharded_inner_numel += self.world_size - (
                    unsharded_inner_numel % self.world_size
                )
            if unsharded_outer_numel % self.world_size:
                unsharded_outer_numel += self.world_size - (
                    unsharded_outer_numel % self.world_size
                )
        # Round up the sharded numel to account for padding
        sharded_inner_numel = int(math.ceil(unsharded_inner_numel / self.world_size))
        sharded_outer_numel = int(math.ceil(unsharded_outer_numel / self.world_size))
        inner_flat_param = model.module[0]._handle.flat_param
        outer_flat_param = model._handle.flat_param
        self.assertEqual(sharded_inner_numel, inner_flat_param.numel())
        self.assertEqual(sharded_outer_numel, outer_flat_param.numel())
        expected_outer_numel = (
            unsharded_outer_numel if unshard_outer else sharded_outer_numel
        )
        expected_inner_numel = (
            unsharded_inner_numel
            if recurse or not unshard_outer
            else sharded_inner_numel
        )
        module_to_unshard = model if unshard_outer else model[0]
        with FSDP.summon_full_params(module_to_unshard, recurse=recurse):
            self.assertEqual(expected_outer_numel, outer_flat_param.numel())
            self.assertEqual(expected_inner_numel, inner_flat_param.numel())

    @skip_if_lt_x_gpu(2)
    def test_named_parameters_and_buffers(self):
        """
        Tests that ``named_parameters()`` and ``named_buffers()`` for a
        top-level FSDP-wrapped model matches their behavior for the equivalent
        non-wrapped module.
        """
        self.run_subtests(
            {"prefix": ["", "test_prefix"], "recurse": [False, True]},
            self._test_named_parameters_and_buffers,
        )

    def _test_named_parameters_and_buffers(self, prefix: str, recurse: bool):
        model = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
        )
        model.buffer = nn.Buffer(torch.ones(1))
        # Wrap the top-level with FSDP since `named_parameters()` and
        # `named_buffers` will contain FSDP prefixes if called on a non-FSDP
        # root module
        fsdp_model = FSDP(
            NestedWrappedModule.init(
                self.process_group,
                FSDPInitMode.NO_FSDP,
                DEVICEInitMode.DEVICE_BEFORE,
                deterministic=True,
            ),
            self.process_group,
        )
        fsdp_model.buffer = nn.Buffer(torch.ones(1))
        with FSDP.summon_full_params(fsdp_model):
            for call in ["named_parameters", "named_buffers"]:
                for (n1, p1), (n2, p2) in itertools.zip_longest(
                    getattr(fsdp_model, call)(prefix=prefix, recurse=recurse),
                    getattr(model, call)(prefix=prefix, recurse=recurse),
                ):
                    self.assertEqual(n1, n2)
                    self.assertEqual(p1, p2)

    @skip_if_lt_x_gpu(2)
    def test_with_grads_core(self):
        """
        Tests the core usage of``with_grads=True`` by comparing against DDP as
        the unsharded equivalent.
        """
        self.run_subtests(
            {
                "writeback": [False, True],
                "offload_to_cpu": [False, True],
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
            },
            self._test_with_grads_core,
        )

    def _test_with_grads_core(
        self,
        writeback: bool,
        offload_to_cpu: bool,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
    ):
        def _check_grads(
            ddp_model: DDP,
            fsdp_model: FSDP,
            old_fsdp_grads: Optional[List[torch.Tensor]],
        ):
            """
            Checks that writes to the FSDP parameters' gradients persist or do
            not persist depending on ``writeback`` and the sharding strategy.
            The DDP model is used for checking gradient parity to ensure that
            FDSP all-gathers the correct gradient values.
            """
            WRITEBACK_FACTOR = 2
            with FSDP.summon_full_params(
                fsdp_model,
                writeback=writeback,
                offload_to_cpu=offload_to_cpu,
                with_grads=True,
            ):
                for (n1, p1), (n2, p2) in zip(
                    ddp_model.module.named_parameters(),
                    fsdp_model.named_parameters(),
                ):
                    self.assertEqual(n1, clean_tensor_name(n2))
                    assert p1.grad is not None
                    torch.testing.assert_close(p1.grad, p2.grad)
                    # Ensure that the tensor is not all zeros, which would
                    # mean that the multiplication is vacuous
                    assert torch.count_nonzero(p2.grad) > 0
                    p2.grad *= WRITEBACK_FACTOR
            new_fsdp_grads = [
                param.grad
                for param in fsdp_model.parameters()
                if param.grad is not None
            ]
            # With `NO_SHARD`, changes persist regardless of `writeback`, also
            # to the CPU copy of `offload_to_cpu=True`
            writeback_persists = (
                writeback or sharding_strategy == ShardingStrategy.NO_SHARD
            )
            for old_grad, new_grad in zip(old_fsdp_grads, new_fsdp_grads):
                if writeback_persists:
                    torch.testing.assert_close(old_grad * WRITEBACK_FACTOR, new_grad)
                else:
                    torch.testing.assert_close(old_grad, new_grad)
            if writeback_persists:
                # Modify the DDP gradients in the same way for parity
                for param in ddp_model.parameters():
                    param.grad *= WRITEBACK_FACTOR

        def _get_fsdp_grads(fsdp_model: FSDP):
            return [
                param.grad.clone()
                for param in fsdp_model.parameters()
                if param.grad is not None
            ]

        model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
        )
        ddp_model = DDP(model, device_ids=[device_type])
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
            fsdp_kwargs={
                "use_orig_params": use_orig_params,
                "sharding_strategy": sharding_strategy,
                "device_id": device_type.type,
            },
        )
        with FSDP.summon_full_params(fsdp_model):
            for p1, p2 in zip(ddp_model.module.parameters(), fsdp_model.parameters()):
                assert torch.all(torch.isclose(p1, p2))

        # Check calling after backward
        inp = fsdp_model.get_input(torch.device(device_type))
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        ddp_out.sum().backward()
        fsdp_out.sum().backward()
        old_fsdp_grads = _get_fsdp_grads(fsdp_model)
        _check_grads(ddp_model, fsdp_model, old_fsdp_grads)

        # Check calling between forward and backward
        inp = fsdp_model.get_input(torch.device(device_type))
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        old_fsdp_grads = _get_fsdp_grads(fsdp_model)
        _check_grads(ddp_model, fsdp_model, old_fsdp_grads)

    @skip_if_lt_x_gpu(2)
    def test_with_grads_none_grads(self):
        """
        Tests that if all ranks' ``FlatParameter`` has ``None`` gradient, then
        each original parameter sees ``None`` gradient as well.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ]
            },
            self._test_with_grads_none_grads,
        )

    def _test_with_grads_none_grads(self, sharding_strategy: ShardingStrategy):
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
            fsdp_kwargs={
                "use_orig_params": True,
                "sharding_strategy": sharding_strategy,
                "device_id": device_type.type,
            },
        )
        for fsdp_module in FSDP.fsdp_modules(fsdp_model):
            if fsdp_module._handle:
                assert fsdp_module._handle.flat_param.grad is None
        with FSDP.summon_full_params(fsdp_model, with_grads=True):
            for param in fsdp_model.parameters():
                self.assertTrue(param.grad is None)

    @skip_if_lt_x_gpu(2)
    def test_unshard_submodule(self):
        model = nn.Sequential(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
        ).to(device_type.type)
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy((nn.Sequential,)))
        with FSDP.summon_full_params(model[0]):
            # Check that the summoned module does not have its flat parameter
            for param_name, _ in model[0].named_parameters():
                self.assertFalse(FLAT_PARAM in param_name)
            self.assertGreater(len(list(model[0].parameters())), 1)


class TestUnshardParamsNoShard(TestUnshardParamsBase):
    @property
    def world_size(self) -> int:
        return 1

    @skip_if_lt_x_gpu(1)
    def test_unshard_params_writeback_no_shard(self):
        """Tests the ``writeback`` argument (using default for all others)."""
        self.run_subtests(
            self._get_test_unshard_params_writeback_config(),
            self._test_unshard_params_writeback,
        )

    @skip_if_lt_x_gpu(1)
    def test_unshard_params_param_data_no_shard(self):
        """
        Tests that parameters are exposed correctly for ``recurse=True`` and
        all other argument configs for a non-FSDP root module.
        """
        self.run_subtests(
            self._get_test_unshard_params_param_data_config(),
            self._test_unshard_params_param_data,
        )


class TestUnshardParamsErrors(TestUnshardParamsBase):
    @property
    def world_size(self) -> int:
        return 2

    @skip_if_lt_x_gpu(2)
    def test_unshard_params_from_forward_raises(self):
        class MyModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Parameter(torch.zeros(5))

            def forward(self, fsdp_module):
                with fsdp_module.summon_full_params(fsdp_module):
                    pass

        model = FSDP(MyModule()).to(device_type.type)
        with self.assertRaisesRegex(
            AssertionError, "Cannot manually unshard parameters during forward/backward"
        ):
            model(model)

    @skip_if_lt_x_gpu(2)
    def test_unshard_params_from_backward_raises(self):
        model = FSDP(nn.Linear(2, 1, device=device_type.type))
        output = model(torch.ones(2, device=device_type.type))

        def invalid_backward_hook(*args, **kwargs):
            with FSDP.summon_full_params(model):
                pass

        self.assertTrue(output.requires_grad)
        output.register_hook(invalid_backward_hook)
        with self.assertRaisesRegex(
            AssertionError, "Cannot manually unshard parameters during forward/backward"
        ):
            output.backward()

    @skip_if_lt_x_gpu(2)
    def test_rank0_only_with_writeback(self):
        """
        Tests that with ``rank0_only=True`` and ``writeback=True``, what rank 0
        changes in the parameters (and gradients, with ``with_grads=True``)
        persists on every rank, and what the other ranks change does not.
        """
        self.run_subtests(
            {"offload_to_cpu": [False, True], "with_grads": [False, True]},
            self._test_rank0_only_with_writeback,
        )

    def _test_rank0_only_with_writeback(self, offload_to_cpu: bool, with_grads: bool):
        nested_wrapped_module = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
        )
        if with_grads:
            inp = nested_wrapped_module.get_input(device_type)
            nested_wrapped_module(*inp).sum().backward()
        handles = traversal_utils._get_fsdp_handles(nested_wrapped_module)
        with (
            FSDP.summon_full_params(
                nested_wrapped_module,
                rank0_only=True,
                writeback=True,
                offload_to_cpu=offload_to_cpu,
                with_grads=with_grads,
            ),
            torch.no_grad(),
        ):
            for handle in handles:
                handle.flat_param.fill_(0 if self.rank == 0 else self.rank + 2)
                if with_grads:
                    handle.flat_param.grad.fill_(1 if self.rank == 0 else 0)
        with FSDP.summon_full_params(
            nested_wrapped_module, writeback=False, with_grads=with_grads
        ):
            for handle in handles:
                flat_param = handle.flat_param
                self.assertEqual(flat_param, torch.zeros_like(flat_param))
                if with_grads:
                    self.assertEqual(flat_param.grad, torch.ones_like(flat_param))

    @skip_if_lt_x_gpu(2)
    def test_offload_to_cpu_no_shard(self):
        """
        Tests ``offload_to_cpu=True`` with ``NO_SHARD``: rank 0 sees a CPU copy
        of the parameters, whose changes persist on every rank with
        ``rank0_only=True`` and ``writeback=True``.
        """
        nested_wrapped_module = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            {"sharding_strategy": ShardingStrategy.NO_SHARD},
        )
        handles = traversal_utils._get_fsdp_handles(nested_wrapped_module)
        with (
            FSDP.summon_full_params(
                nested_wrapped_module,
                rank0_only=True,
                writeback=True,
                offload_to_cpu=True,
            ),
            torch.no_grad(),
        ):
            for handle in handles:
                if self.rank == 0:
                    self.assertEqual(handle.flat_param.device, torch.device("cpu"))
                handle.flat_param.fill_(0 if self.rank == 0 else self.rank + 2)
        with FSDP.summon_full_params(nested_wrapped_module, writeback=False):
            for handle in handles:
                flat_param = handle.flat_param
                self.assertEqual(flat_param, torch.zeros_like(flat_param))


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


class BodyError(Exception):
    pass


def reference_model() -> nn.Module:
    torch.manual_seed(0)
    # Odd numels so that the last shard is padded
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


def batch(seed: int = 1) -> torch.Tensor:
    # The same batch on every rank: the averaged gradient equals the reference's
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))


class FSDPUnshardTest(FSDPTestMixin, MultiProcContinuousTest):
    """
    ``summon_full_params()`` checked against an unwrapped reference model, bitwise.
    The process group is created once per class; each subtest wraps a fresh copy of
    the (tiny) reference model, since the tests change the parameters. The ranks use
    one accelerator each if there are enough, else the CPU and gloo: these tests need
    none (NCCL cannot put two ranks on one GPU, nor take CPU tensors).
    """

    # A rank left waiting in a collective fails the test within this, not hangs it
    timeout = timedelta(seconds=60)

    @classmethod
    def device_type(cls) -> str:
        accelerator = torch.accelerator.current_accelerator()
        if accelerator and torch.accelerator.device_count() >= cls.world_size:
            return accelerator.type
        return "cpu"

    @classmethod
    def backend_str(cls) -> str:
        return dist.get_default_backend_for_device(cls.device_type())

    @property
    def device(self) -> torch.device:
        if self.device_type() == "cpu":
            return torch.device("cpu")
        torch.accelerator.set_device_index(self.rank)
        return torch.device(self.device_type(), self.rank)

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.pg

    def assertRaisesRegex(self, expected_exception, expected_regex, *args, **kwargs):
        # `TestCase.assertRaisesRegex()` matches no message when `device_type` is not
        # a native device's name, and `FSDPTestContinuous.device_type` is a method
        return unittest.TestCase.assertRaisesRegex(
            self, expected_exception, expected_regex, *args, **kwargs
        )

    def _wrap(self, reference: nn.Module, **kwargs) -> FSDP:
        """Nested FSDP: an inner unit for the first layer, the root for the rest."""
        if "device_mesh" not in kwargs:
            kwargs["process_group"] = self.process_group
        model = copy.deepcopy(reference)
        model[0] = FSDP(model[0], device_id=self.device, **kwargs)
        return FSDP(model, device_id=self.device, **kwargs)

    def _models(self, backward: bool, **kwargs) -> tuple[FSDP, nn.Module]:
        """The FSDP model and its reference, after a backward on the same batch."""
        reference = reference_model()
        model = self._wrap(reference, **kwargs)
        for m, device in [(model, self.device), (reference, "cpu")][: 2 * backward]:
            m(batch().to(device)).sum().backward()
        return model, reference

    def _check_idle_and_resharded(self, model: FSDP) -> None:
        for fsdp_module in FSDP.fsdp_modules(model):
            self.assertEqual(fsdp_module.training_state, TrainingState.IDLE)
            handle = fsdp_module._handle
            self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
            flat_param = handle.flat_param
            if handle.uses_sharded_strategy:
                storage = flat_param._full_param_padded.untyped_storage()
                self.assertEqual(storage.size(), 0)
                local_shard = flat_param._local_shard
                self.assertEqual(flat_param.data_ptr(), local_shard.data_ptr())

    def _check_full(self, model, reference, with_grads: bool = False) -> None:
        """Every rank's full parameters (and gradients) are the reference's, bitwise."""
        with FSDP.summon_full_params(model, writeback=False, with_grads=with_grads):
            for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
                self.assertEqual(p.cpu(), ref, atol=0, rtol=0, msg=f"rank {self.rank}")
                if with_grads and ref.grad is None:
                    self.assertIsNone(p.grad)
                elif with_grads:
                    self.assertEqual(p.grad.cpu(), ref.grad, atol=0, rtol=0)


def check_zeros_in_param_dtype(test: FSDPUnshardTest, **kwargs) -> None:
    """
    ``summon_full_params(with_grads=True)`` on bfloat16 parameters where rank 1 has
    no gradient: every rank gets bfloat16 gradients, rank 0's shard unchanged.
    """
    model = test._wrap(reference_model().to(torch.bfloat16), **kwargs)
    model(batch().to(test.device, torch.bfloat16)).sum().backward()
    handles = [m._handle for m in FSDP.fsdp_modules(model)]
    shards = [h.flat_param.grad.clone() for h in handles]
    if test.rank == 1:
        model.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model, with_grads=True):
        for p in model.parameters():
            test.assertEqual(p.grad.dtype, torch.bfloat16)
        for handle, shard in zip(handles, shards, strict=True):
            grad, n = handle.flat_param.grad, shard.numel()
            test.assertEqual(grad.dtype, torch.bfloat16)
            test.assertEqual(grad[n:], torch.zeros_like(grad[n:]))
            if test.rank == 0:
                test.assertEqual(grad[:n], shard, atol=0, rtol=0)
    test._check_idle_and_resharded(model)


class TestUnshardGradDtype(FSDPUnshardTest):
    """``FlatParamHandle.unshard_grad()`` with a rank without a gradient."""

    world_size = 2

    def test_with_grads_zeros_in_param_dtype(self):
        """
        A rank without a gradient sends zeros in the parameter's dtype (bfloat16
        here), not in float32: else the ranks' all-gathers would not match.
        """
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
                "use_orig_params": [True],
            },
            check_zeros_in_param_dtype,
            self,
        )


STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]


class TestUnshardOffloadAndGrads(FSDPUnshardTest):
    """
    ``offload_to_cpu`` with ``NO_SHARD``, and ``with_grads`` with ``offload_to_cpu`` or
    flat parameters.
    """

    world_size = 2

    def _train_step_and_compare(self, model: FSDP, reference: nn.Module) -> None:
        """
        One SGD step on both models from their current gradients, then compare the next
        loss.
        """
        for module in (model, reference):
            with torch.no_grad():
                for param in module.parameters():
                    if param.grad is not None:
                        param -= 0.1 * param.grad
                        param.grad = None
        loss = model(batch().to(self.device)).sum()
        ref_loss = reference(batch()).sum()
        self.assertEqual(loss.cpu(), ref_loss)
        loss.backward()
        ref_loss.backward()

    def test_offload_to_cpu_no_shard(self):
        """
        ``offload_to_cpu=True`` with ``NO_SHARD``: full CPU parameters inside, changes
        kept with writeback.
        """
        self.run_subtests(
            {
                "use_orig_params": [False, True],
                # (writeback, rank0_only); both together: rank-0 writeback's tests
                "options": [(True, False), (False, False), (False, True)],
            },
            self._test_offload_to_cpu_no_shard,
        )

    def _test_offload_to_cpu_no_shard(self, use_orig_params, options):
        writeback, rank0_only = options
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=ShardingStrategy.NO_SHARD,
            use_orig_params=use_orig_params,
        )
        with FSDP.summon_full_params(
            model, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=True
        ):
            if self.rank == 0 or not rank0_only:
                for param, ref_param in zip(
                    model.parameters(), reference.parameters(), strict=True
                ):
                    self.assertEqual(param.device, torch.device("cpu"))
                    self.assertEqual(param, ref_param)
                if writeback:
                    with torch.no_grad():
                        for param in model.parameters():
                            param.add_(1.0)
        self._check_idle_and_resharded(model)
        if writeback:
            with torch.no_grad():
                for ref_param in reference.parameters():
                    ref_param.add_(1.0)
        self._check_full(model, reference)
        for param in model.parameters():
            self.assertEqual(param.device, self.device)
        self._train_step_and_compare(model, reference)

    def test_with_grads_offload_or_flat_params(self):
        """
        ``with_grads=True`` with ``offload_to_cpu=True`` or ``use_orig_params=False``
        gives the full gradients.
        """
        self.run_subtests(
            {
                "sharding_strategy": STRATEGIES,
                # (use_orig_params, offload_to_cpu): the combinations that stock torch
                # rejects
                "options": [(False, False), (False, True), (True, True)],
                "writeback": [False, True],
            },
            self._test_with_grads_offload_or_flat_params,
        )

    def _test_with_grads_offload_or_flat_params(
        self, sharding_strategy, options, writeback
    ):
        use_orig_params, offload_to_cpu = options
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        model(batch().to(self.device)).sum().backward()
        reference(batch()).sum().backward()
        with FSDP.summon_full_params(
            model, writeback=writeback, offload_to_cpu=offload_to_cpu, with_grads=True
        ):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.shape, ref_param.shape)
                self.assertIsNotNone(param.grad)
                if offload_to_cpu:
                    self.assertEqual(param.grad.device, torch.device("cpu"))
                self.assertEqual(param.grad.cpu(), ref_param.grad)
                self.assertGreater(torch.count_nonzero(param.grad), 0)
                if writeback:
                    param.grad *= 2
        self._check_idle_and_resharded(model)
        if writeback:
            for ref_param in reference.parameters():
                ref_param.grad *= 2
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.cpu(), ref_param)
                self.assertEqual(param.grad.cpu(), ref_param.grad)
        self._train_step_and_compare(model, reference)

    def test_with_grads_flat_params_after_optimizer_step(self):
        """
        ``with_grads=True`` with ``use_orig_params=False`` after the flat parameter
        changed in place (an optimizer step): the full gradients are still exposed.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES, "offload_to_cpu": [False, True]},
            self._test_with_grads_flat_params_after_optimizer_step,
        )

    def _test_with_grads_flat_params_after_optimizer_step(
        self, sharding_strategy, offload_to_cpu
    ):
        reference = reference_model()
        model = self._wrap(
            reference, sharding_strategy=sharding_strategy, use_orig_params=False
        )
        for module in (model, reference):
            module(batch().to(self.device)).sum().backward()
            torch.optim.SGD(module.parameters(), lr=0.1).step()
        with FSDP.summon_full_params(
            model, writeback=False, offload_to_cpu=offload_to_cpu, with_grads=True
        ):
            for param, ref_param in zip(
                model.parameters(), reference.parameters(), strict=True
            ):
                self.assertEqual(param.cpu(), ref_param)
                self.assertEqual(param.grad.cpu(), ref_param.grad)
        self._check_idle_and_resharded(model)

    def test_summon_sequence_between_steps(self):
        """
        Any sequence of ``summon_full_params`` options between training steps leaves
        training unchanged.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES, "use_orig_params": [False, True]},
            self._test_summon_sequence_between_steps,
        )

    def _test_summon_sequence_between_steps(self, sharding_strategy, use_orig_params):
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        option_sequence = [
            {"writeback": True, "offload_to_cpu": True, "with_grads": True},
            {"writeback": False, "rank0_only": True},
            {"writeback": False, "rank0_only": True, "offload_to_cpu": True},
            {"writeback": True, "offload_to_cpu": True, "recurse": False},
            {"writeback": True},
            {"writeback": False, "with_grads": True},
            {"writeback": True, "offload_to_cpu": True},
        ]
        model(batch().to(self.device)).sum().backward()
        reference(batch()).sum().backward()
        for options in option_sequence:
            with FSDP.summon_full_params(model, **options):
                for param in model.parameters():
                    param.detach().clone()
            self._check_idle_and_resharded(model)
            self._train_step_and_compare(model, reference)
        self._check_full(model, reference)

    def test_body_raises_leaves_model_usable(self):
        """
        An exception inside the context leaves every rank idle, consistent and
        trainable.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES, "use_orig_params": [False, True]},
            self._test_body_raises_leaves_model_usable,
        )

    def _test_body_raises_leaves_model_usable(self, sharding_strategy, use_orig_params):
        reference = reference_model()
        model = self._wrap(
            reference,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        model(batch().to(self.device)).sum().backward()
        reference(batch()).sum().backward()
        option_sequence = [
            {"writeback": False, "offload_to_cpu": True, "with_grads": True},
            {"writeback": False, "rank0_only": True, "offload_to_cpu": True},
            {"writeback": True, "with_grads": True},
            {"writeback": False, "rank0_only": True},
        ]
        for options in option_sequence:
            raised = False
            try:
                with FSDP.summon_full_params(model, **options):
                    raise BodyError
            except BodyError:
                raised = True
            self.assertTrue(raised)
            self._check_idle_and_resharded(model)
            self._train_step_and_compare(model, reference)
        self._check_full(model, reference)

    def test_with_grads_zeros_in_param_dtype(self):
        """
        With flat parameters too, a rank without a gradient sends zeros in the
        parameter's dtype.
        """
        self.run_subtests(
            {"sharding_strategy": STRATEGIES[:2], "use_orig_params": [False]},
            check_zeros_in_param_dtype,
            self,
        )

    def test_skip_writeback_check_warning_logged_once(self):
        """
        ``FSDP_SKIP_WRITEBACK_CHECK=1`` logs its warning once, not once per handle.
        """
        with mock.patch.dict(os.environ, {"FSDP_SKIP_WRITEBACK_CHECK": "1"}):
            with self.assertLogs(FlatParamHandle.__module__, "WARNING") as logs:
                for _ in range(2):
                    self._wrap(reference_model())  # two handles each
        warnings = [line for line in logs.output if "FSDP_SKIP_WRITEBACK_CHECK" in line]
        self.assertEqual(len(warnings), 1)

    def test_with_grads_other_dtype_raises(self):
        """
        Gradients in another dtype than the parameter (``keep_low_precision_grads``)
        raise on every rank before any gradient moves, leaving FSDP idle.
        """
        self.run_subtests(
            {"use_orig_params": [False, True], "writeback": [False, True]},
            self._test_with_grads_other_dtype_raises,
        )

    def _test_with_grads_other_dtype_raises(self, use_orig_params, writeback):
        low = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        model, reference = self._models(
            backward=False, use_orig_params=use_orig_params, mixed_precision=low
        )
        model(batch().to(self.device)).sum().backward()
        errors = []
        for _ in range(2):
            with self.assertRaisesRegex(
                NotImplementedError, "gradient in torch.float32"
            ) as cm:
                with FSDP.summon_full_params(
                    model, writeback=writeback, with_grads=True
                ):
                    pass
            errors.append(cm.exception)
            self._check_idle_and_resharded(model)
        # A new error each time: a raised error's traceback grows with each raise
        self.assertIsNot(errors[0], errors[1])
        self._check_full(model, reference)


FULL, GRAD_OP = ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP
NO_SHARD, BOTH = ShardingStrategy.NO_SHARD, [False, True]
HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]


def _edits(params, grads: bool = False) -> list[torch.Tensor]:
    """What rank 0 writes into the full parameters (or gradients): new values."""
    scale, offset = (-0.125, 1.0) if grads else (0.25, -3.0)
    return [torch.arange(p.numel()).view(p.shape) * scale + offset for p in params]


def _edit(params, with_grads: bool = False) -> None:
    with torch.no_grad():
        edits = zip(params, _edits(params), _edits(params, True), strict=True)
        for p, value, grad in edits:
            p.copy_(value.to(p.device))
            if with_grads:
                p.grad.copy_(grad.to(p.device))


def _summon_rank0(model: FSDP, **kwargs):
    return FSDP.summon_full_params(model, writeback=True, rank0_only=True, **kwargs)


# What the other ranks raise when the writeback failed on one rank
FAILED_ELSEWHERE = "failed on another rank .*: nothing was written back"


class _Rank0WritebackTest(FSDPUnshardTest):
    def _check_writeback(self, model, reference, with_grads: bool, **kwargs) -> None:
        """Rank 0's edits reach every rank bitwise; training goes on as reference's."""
        with _summon_rank0(model, with_grads=with_grads, **kwargs):
            params = list(model.parameters())
            if self.rank == 0:
                _edit(params, with_grads)
            else:
                # The other ranks never hold the unsharded parameters, and their
                # changes are discarded
                for handle in [m._handle for m in FSDP.fsdp_modules(model)]:
                    if handle.uses_sharded_strategy:
                        storage = handle.flat_param._full_param_padded.untyped_storage()
                        self.assertEqual(storage.size(), 0)
                with torch.no_grad():
                    for t in params + [p.grad for p in params if p.grad is not None]:
                        t.fill_(123.0)
        self._check_idle_and_resharded(model)
        _edit(list(reference.parameters()), with_grads)
        self._check_full(model, reference, with_grads)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        inp = batch(2)
        for _ in range(2):
            # With gradients, the first step uses the written-back ones
            if with_grads:
                optim.step()
                ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            loss, ref_loss = model(inp.to(self.device)).sum(), reference(inp).sum()
            self.assertEqual(loss.cpu(), ref_loss)
            loss.backward()
            ref_loss.backward()
            with_grads = True

    def _test_rank0_writeback(self, with_grads, offload_to_cpu, **kwargs):
        model, reference = self._models(with_grads, **kwargs)
        if not with_grads:
            # A forward without backward leaves the root's unsharded parameter
            # allocated: it must not go stale on the ranks that did not edit it
            with torch.no_grad():
                model(torch.randn(4, 5, device=self.device))
        self._check_writeback(
            model, reference, with_grads, offload_to_cpu=offload_to_cpu
        )

    def _test_body_raises(self, with_grads, **kwargs):
        """
        Rank 1 changes what it holds while rank 0's body raises after its edit: every
        rank raises and nothing is written back. With ``NO_SHARD``, every rank has the
        parameters from before again (rank 0's); with sharding, rank 1 keeps its change
        to its shard, as with ``writeback=False``. Then FSDP is still usable.
        """
        model, reference = self._models(with_grads, **kwargs)
        before = [p.detach().clone() for p in model.parameters()]
        raises = self.assertRaisesRegex(BodyError, "after the edit")
        if self.rank != 0:
            raises = self.assertRaisesRegex(RuntimeError, FAILED_ELSEWHERE)
        with raises:
            with _summon_rank0(model, with_grads=with_grads), torch.no_grad():
                params = list(model.parameters())
                if self.rank == 0:
                    _edit(params, with_grads)
                    raise BodyError("after the edit")
                for p in params:
                    p.fill_(123.0)
        self._check_idle_and_resharded(model)
        if kwargs["sharding_strategy"] == NO_SHARD:
            self._check_full(model, reference, with_grads)
        else:
            if self.rank != 0:
                before = [torch.full_like(p, 123.0) for p in before]
            for p, expected in zip(model.parameters(), before, strict=True):
                self.assertEqual(p, expected, atol=0, rtol=0)
        self._check_writeback(model, reference, with_grads)

    def _test_rank0_allocation_fails(self, with_grads, fail_at, **kwargs):
        """
        Rank 0 fails to allocate a unit's unsharded parameter (out of memory), the
        first unit's or the second's: every rank raises before that unit's gather,
        with nothing changed and FSDP idle again.
        """
        model, reference = self._models(with_grads, **kwargs)
        alloc, calls = FlatParamHandle._alloc_padded_unsharded_flat_param, []

        def failing_alloc(handle):
            if handle not in calls:  # a unit's first allocation
                calls.append(handle)
                if len(calls) == fail_at + 1:
                    raise torch.OutOfMemoryError("rank 0 is out of memory")
            return alloc(handle)

        name = "_alloc_padded_unsharded_flat_param"
        fails = mock.patch.object(FlatParamHandle, name, failing_alloc)
        if self.rank == 0:
            raises = self.assertRaisesRegex(torch.OutOfMemoryError, "out of memory")
        else:
            raises = self.assertRaisesRegex(RuntimeError, FAILED_ELSEWHERE)
        with fails if self.rank == 0 else contextlib.nullcontext(), raises:
            with _summon_rank0(model, with_grads=with_grads):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        self._check_idle_and_resharded(model)
        self._check_full(model, reference, with_grads)
        self._check_writeback(model, reference, with_grads)

    def _test_padding_stays_zeros(self, with_grads, **kwargs):
        model, _ = self._models(backward=True, **kwargs)
        handles = [m._handle for m in FSDP.fsdp_modules(model)]
        if self.rank == 1 and not kwargs["use_orig_params"]:
            self.assertTrue(any(h.flat_param._shard_numel_padded for h in handles))
        with _summon_rank0(model, with_grads=with_grads):
            for flat_param in [h.flat_param for h in handles if self.rank == 0]:
                numel = flat_param._unpadded_unsharded_size.numel()
                flat_param._full_param_padded[numel:].fill_(float("nan"))
                if with_grads:  # a view into the padded unsharded gradient
                    storage = flat_param.grad.untyped_storage()
                    flat_param.grad.new_empty(0).set_(storage)[numel:].fill_(1.0)
        self._check_idle_and_resharded(model)
        paddings = []
        for flat_param in [h.flat_param for h in handles]:
            for shard in [flat_param._local_shard, flat_param.grad][: 1 + with_grads]:
                paddings.append(shard[shard.numel() - flat_param._shard_numel_padded :])
        zeros = torch.tensor([int(all(not p.any() for p in paddings))])
        # Every rank fails together, so that none blocks in the next collective
        dist.all_reduce(zeros := zeros.to(self.device), op=dist.ReduceOp.MIN)
        self.assertTrue(zeros.item(), f"rank {self.rank}: paddings {paddings}")

    def _test_allocate_at_most_a_shard(self, with_grads: bool, **kwargs) -> None:
        """No allocation on the other ranks exceeds a shard; one unit dwarfs others."""
        torch.manual_seed(0)
        model = self._wrap(
            nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 3)), **kwargs
        )
        if with_grads:
            model(torch.randn(2, 256, device=self.device)).sum().backward()
        # Lazy initialization allocates on its own: keep it out of the measurement
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            pass
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
        with profile(activities=activities, profile_memory=True) as prof:
            with _summon_rank0(model, with_grads=with_grads):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        usage = "cpu" if self.device.type == "cpu" else "device"
        events = [e for e in prof.events() if e.name == "[memory]"]
        largest = max([getattr(e, f"{usage}_memory_usage") for e in events] + [0])
        handles = [m._handle for m in FSDP.fsdp_modules(model)]
        itemsize = handles[0].flat_param.element_size()
        shard = max(h.flat_param._local_shard.numel() for h in handles) * itemsize
        full = max(h.flat_param._padded_unsharded_size.numel() for h in handles)
        if self.rank == 0:
            self.assertGreaterEqual(largest, full * itemsize)
        else:
            self.assertLessEqual(largest, shard, f"rank {self.rank} (full: {full})")

    def _test_hybrid_shard(self, with_grads: bool, **kwargs) -> None:
        # Rank 2, rank 0 of the other replica, must not keep a full copy either
        self._test_rank0_writeback(with_grads, offload_to_cpu=True, **kwargs)
        # Nor allocate one: only rank 0's replica gathers, to rank 0
        self._test_allocate_at_most_a_shard(with_grads, **kwargs)

    def _test_needs_unshard_on_one_rank(self, free_rank: int) -> None:
        """A forward leaves the units unsharded (``SHARD_GRAD_OP``) but on ``free_rank``:
        only it needs to unshard, yet every rank gathers, as the ranks agreed."""
        model, reference = self._models(False, sharding_strategy=GRAD_OP)
        with torch.no_grad():
            model(batch().to(self.device))
        handles = [m._handle for m in FSDP.fsdp_modules(model)]
        self.assertFalse(any(h.needs_unshard() for h in handles))
        if self.rank == free_rank:
            for m in FSDP.fsdp_modules(model):
                unshard_param_utils._reshard(m, m._handle, True)
        self._check_writeback(model, reference, with_grads=False)


class TestUnshardRank0Writeback(_Rank0WritebackTest):
    """``summon_full_params(writeback=True, rank0_only=True)`` on two ranks."""

    world_size = 2

    def test_rank0_writeback(self):
        """Rank 0's edits reach every rank, and training goes on from there."""
        strategies = [FULL, GRAD_OP, NO_SHARD]
        config = dict(
            sharding_strategy=strategies, use_orig_params=BOTH, offload_to_cpu=BOTH
        )
        self.run_subtests(config, self._test_rank0_writeback, with_grads=False)

    def test_rank0_writeback_body_raises(self):
        config = {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_body_raises, with_grads=False)

    def test_rank0_writeback_padding_stays_zeros(self):
        """The last rank's shard padding stays zeros, whatever rank 0's holds there."""
        config = {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_padding_stays_zeros, with_grads=False)

    def test_rank0_writeback_rank0_allocation_fails(self):
        config = {"sharding_strategy": [FULL, GRAD_OP], "fail_at": [0, 1]}
        self.run_subtests(config, self._test_rank0_allocation_fails, with_grads=False)

    def test_rank0_writeback_other_ranks_allocate_at_most_a_shard(self):
        config = {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_allocate_at_most_a_shard, with_grads=False)

    def test_rank0_writeback_needs_unshard_on_one_rank(self):
        self.run_subtests({"free_rank": [0, 1]}, self._test_needs_unshard_on_one_rank)

    def test_rank0_writeback_single_state(self):
        """``_unshard_fsdp_state_params()`` (state-dict paths) writes back one state."""
        for sharding_strategy in [FULL, NO_SHARD]:
            reference = reference_model()
            kwargs = {"device_id": self.device, "sharding_strategy": sharding_strategy}
            model = FSDP(copy.deepcopy(reference), self.process_group, **kwargs)
            with FSDP.summon_full_params(model):  # lazy initialization
                pass
            with unshard_param_utils._unshard_fsdp_state_params(
                model, model, True, True, offload_to_cpu=False, with_grads=False
            ):
                if self.rank == 0:
                    _edit(list(model.parameters()))
            self._check_idle_and_resharded(model)
            _edit(list(reference.parameters()))
            self._check_full(model, reference)

    def test_rank0_writeback_no_shard_cpu_offload_on_accelerator_raises(self):
        """
        ``NO_SHARD`` with ``CPUOffload(offload_params=True)`` on an accelerator: every
        rank refuses it before any collective (faked on the handle, which is checked).
        """
        model, reference = self._models(backward=False, sharding_strategy=NO_SHARD)
        handle, names = model._handle, ["all_reduce", "broadcast", "gather", "scatter"]
        fake_offload = {"_offload_params": True, "device": torch.device("cuda")}
        no_collectives = {n: mock.Mock(side_effect=AssertionError) for n in names}
        with (
            mock.patch.multiple(handle, **fake_offload),
            mock.patch.multiple(dist, **no_collectives),
            self.assertRaisesRegex(NotImplementedError, "is not supported yet"),
            _summon_rank0(model),
        ):
            pass
        self.assertEqual(handle._training_state, HandleTrainingState.IDLE)
        self._check_writeback(model, reference, with_grads=False)


class TestUnshardRank0WritebackHybrid(_Rank0WritebackTest):
    """
    Hybrid sharding on a 2 x 2 mesh: only rank 0's replica gathers, to rank 0, and
    every replica gets rank 0's edits.
    """

    world_size = 4

    def test_rank0_writeback_hybrid_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        config = {"sharding_strategy": HYBRID, "use_orig_params": BOTH}
        self.run_subtests(
            config, self._test_hybrid_shard, device_mesh=mesh, with_grads=False
        )


class Injected(Exception):
    """A failure forced on one rank."""


def _fail_once(point, owner, name: str, after: bool, fired: list):
    """
    Patches ``owner.name`` to raise ``Injected(point)`` at its first call, before it
    runs, or ``after`` it ran (a collective or a free, which must run on every rank).
    """
    original = getattr(owner, name)

    def failing(*args, **kwargs):
        if fired:
            return original(*args, **kwargs)
        fired.append(point)
        if not after:
            raise Injected(point)
        result = original(*args, **kwargs)
        if result is None:
            raise Injected(point)

        def wait():  # an asynchronous collective: it raises once finished
            result.wait()
            raise Injected(point)

        return mock.Mock(wait=wait)

    return mock.patch.object(owner, name, failing)


class _Rank0FailureTest(_Rank0WritebackTest):
    # Where a rank fails, in order: (owner, attribute, fails after running, the
    # ranks that reach it)
    points = {
        "pre_unshard": (FlatParamHandle, "pre_unshard", False, (0, 1)),
        "alloc": (FlatParamHandle, "_alloc_padded_unsharded_flat_param", False, (0,)),
        "gather": (dist, "gather", True, (0, 1)),
        "post_unshard": (FlatParamHandle, "post_unshard", False, (0, 1)),
        "to_cpu": (FlatParamHandle, "to_cpu", False, (0,)),
        "unflatten": (FlatParamHandle, "unflatten_as_params", False, (0,)),
        # The other ranks free the unsharded parameter before the body
        "early_free": (unshard_param_utils, "_reshard", False, (1,)),
        "body": (None, None, False, (0, 1)),
        "scatter": (dist, "scatter", True, (0, 1)),
        "free": (unshard_param_utils, "_reshard", True, (0,)),
    }
    # The points after the ranks agreed to write back: only the failed rank raises
    after_agreement = ("scatter", "free")

    def _failures(self, *points: str) -> list[tuple[str, int]]:
        """Each point and each rank that reaches it."""
        return [(p, rank) for p in points for rank in self.points[p][-1]]

    def _test_failure_at(self, failure, nested, with_grads, **kwargs):
        """
        ``failure``: a point fails on a rank, in the first unit it reaches (of two if
        ``nested``). Before the ranks agree to write back, every rank raises with
        nothing changed; after, only that rank raises, and each has rank 0's edits.
        Either way FSDP is idle and trains on; a hang fails at the group's timeout.
        """
        (point, fail_rank), kwargs = failure, {**kwargs, "use_orig_params": False}
        if point == "to_cpu" and self.device.type == "cpu":
            return  # ``offload_to_cpu`` copies nothing on a CPU compute device
        if nested:
            model, reference = self._models(with_grads, **kwargs)
        else:
            reference = reference_model()
            kwargs["device_id"] = self.device
            model = FSDP(copy.deepcopy(reference), self.process_group, **kwargs)
            if with_grads:
                for m, device in [(model, self.device), (reference, "cpu")]:
                    m(batch().to(device)).sum().backward()
        fails, fired = self.rank == fail_rank, []
        owner, name, after, _ = self.points[point]
        raises = self.assertRaisesRegex(RuntimeError, FAILED_ELSEWHERE)
        if fails:
            raises = self.assertRaisesRegex(Injected, point)
        elif point in self.after_agreement:
            raises = contextlib.nullcontext()
        failing = contextlib.nullcontext()
        if fails and owner is not None:
            failing = _fail_once(point, owner, name, after, fired)
        offload_to_cpu = point == "to_cpu"
        with failing, raises:
            with _summon_rank0(
                model, with_grads=with_grads, offload_to_cpu=offload_to_cpu
            ):
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
                if fails and point == "body":
                    raise Injected(point)
        self.assertEqual(fired, [point] if fails and point != "body" else [])
        self._check_idle_and_resharded(model)
        if point in self.after_agreement:
            _edit(list(reference.parameters()), with_grads)
        self._check_full(model, reference, with_grads)
        self._check_writeback(model, reference, with_grads)

    def _test_collectives(self, fail, with_grads: bool) -> None:
        """
        Every unit's scatter starts before any is waited for, and the units are freed
        once all finished, also if one failed (it raises once every unit is idle again).
        """
        model, reference = self._models(backward=with_grads, use_orig_params=True)
        if self.rank != 0:
            model.zero_grad(set_to_none=True)
        scatter, reshard, events = dist.scatter, unshard_param_utils._reshard, []

        def recording_scatter(*args, **kwargs):
            n, work = events.count("scatter"), scatter(*args, **kwargs)
            events.append("scatter")
            # The first unit's parameter scatter fails, or each gradient scatter
            fails = fail == "scatter" and (n % 2 == 1 if with_grads else n == 0)

            def wait():
                work.wait()
                events.append("wait")
                if fails:
                    raise BodyError("scatter failed")

            return mock.Mock(wait=wait)

        def recording_reshard(*args):
            events.append("reshard")
            return reshard(*args)

        with (
            mock.patch.object(dist, "scatter", recording_scatter),
            mock.patch.object(unshard_param_utils, "_reshard", recording_reshard),
            self.assertRaises(BodyError) if fail else contextlib.nullcontext(),
        ):
            with _summon_rank0(model, with_grads=with_grads):
                events.clear()  # the other ranks reshard early, on entry
                if self.rank == 0:
                    _edit(list(model.parameters()), with_grads)
        n, frees = 2 + 2 * with_grads, 2
        self.assertEqual(events, ["scatter"] * n + ["wait"] * n + ["reshard"] * frees)
        self._check_idle_and_resharded(model)
        # What the (recorded) collectives delivered
        _edit(list(reference.parameters()), with_grads)
        self._check_full(model, reference, with_grads)


class TestUnshardRank0WritebackFailures(_Rank0FailureTest):
    """
    ``summon_full_params(writeback=True, rank0_only=True)`` on two ranks: the units'
    writebacks run concurrently, and a failure anywhere leaves no rank waiting.
    """

    world_size = 2

    def test_rank0_writeback_failure(self):
        """
        A rank fails at any point of the writeback: no rank hangs, and all agree.
        """
        config = {"failure": self._failures(*self.points), "nested": BOTH}
        self.run_subtests(config, self._test_failure_at, with_grads=False)

    def test_rank0_writeback_collectives(self):
        config = {"fail": [None, "scatter"]}
        self.run_subtests(config, self._test_collectives, with_grads=False)


class TestUnshardRank0WritebackGrads(_Rank0FailureTest):
    """
    ``summon_full_params(writeback=True, rank0_only=True, with_grads=True)`` on two
    ranks: rank 0's changes to the gradients reach every rank too.
    """

    world_size = 2
    points = {
        **_Rank0FailureTest.points,
        "grad_views": (FlatParamHandle, "_use_unsharded_grad_views", False, (0,)),
        "grad_free": (unshard_param_utils, "_reshard_grads", True, (0, 1)),
    }
    after_agreement = (*_Rank0FailureTest.after_agreement, "grad_free")

    def test_rank0_writeback_grads(self):
        """Rank 0's edits reach every rank, and training goes on from there."""
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP, NO_SHARD],
                "use_orig_params": BOTH,
                "offload_to_cpu": BOTH,
            },
            self._test_rank0_writeback,
            with_grads=True,
        )

    def test_rank0_writeback_grads_on_some_ranks(self):
        """
        A rank without a gradient receives rank 0's, with mixed precision too; without a
        gradient on any rank, the parameters are written back and no rank gets one.
        """
        self.run_subtests(
            {
                "sharding_strategy": [FULL, NO_SHARD],
                "use_orig_params": BOTH,
                "grad_on_rank0": BOTH,
                "mixed_precision": [None, MixedPrecision(param_dtype=torch.bfloat16)],
            },
            self._test_rank0_writeback_grads_on_some_ranks,
        )

    def _test_rank0_writeback_grads_on_some_ranks(self, grad_on_rank0, **kwargs):
        model, reference = self._models(backward=True, **kwargs)
        if self.rank != 0 or not grad_on_rank0:
            model.zero_grad(set_to_none=True)
        with _summon_rank0(model, with_grads=True):
            params = list(model.parameters())
            if self.rank == 0:
                self.assertEqual(
                    [p.grad is None for p in params], [not grad_on_rank0] * 3
                )
                _edit(params, with_grads=grad_on_rank0)
        self._check_idle_and_resharded(model)
        ref_params = list(reference.parameters())
        _edit(ref_params, with_grads=False)
        for ref, grad in zip(ref_params, _edits(ref_params, grads=True), strict=True):
            ref.grad = grad if grad_on_rank0 else None
        self._check_full(model, reference, with_grads=True)

    def test_rank0_writeback_grads_none_stays_none(self):
        """
        A rank whose gradient is None keeps None where rank 0 writes nothing into
        its shard, as with ``rank0_only=False``, and rank 0 keeps its gradient.
        """
        self.run_subtests(
            {"sharding_strategy": [FULL, GRAD_OP], "use_orig_params": BOTH},
            self._test_rank0_writeback_grads_none_stays_none,
        )

    def _test_rank0_writeback_grads_none_stays_none(self, **kwargs):
        grads = []
        for rank0_only in (True, False):
            model, _ = self._models(backward=True, **kwargs)
            if self.rank != 0:
                model.zero_grad(set_to_none=True)
            with FSDP.summon_full_params(
                model, writeback=True, rank0_only=rank0_only, with_grads=True
            ):
                pass
            self._check_idle_and_resharded(model)
            grads.append([p.grad for p in model.parameters()])
        self.assertEqual(grads[0], grads[1])
        nones = [g is None for g in grads[0]]
        self.assertTrue(all(nones) if self.rank else not all(nones))

    def test_rank0_writeback_grads_body_raises(self):
        config = {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH}
        self.run_subtests(config, self._test_body_raises, with_grads=True)

    def test_rank0_writeback_grads_rank0_allocation_fails(self):
        config = {"sharding_strategy": [FULL], "fail_at": [0, 1]}
        self.run_subtests(config, self._test_rank0_allocation_fails, with_grads=True)

    def test_rank0_writeback_grads_other_dtype_raises(self):
        """
        A rank without a gradient would send zeros in the parameter's dtype, others
        theirs in bfloat16 (``keep_low_precision_grads``): every rank raises before
        any collective that moves data, with nothing changed and FSDP idle again.
        """
        self.run_subtests(
            {"sharding_strategy": [FULL, NO_SHARD], "use_orig_params": BOTH},
            self._test_rank0_writeback_grads_other_dtype_raises,
        )

    def _test_rank0_writeback_grads_other_dtype_raises(self, **kwargs):
        low = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        model, reference = self._models(backward=False, mixed_precision=low, **kwargs)
        model(batch().to(self.device)).sum().backward()
        if self.rank != 0:
            model.zero_grad(set_to_none=True)
        with self.assertRaisesRegex(NotImplementedError, "gradient in torch.float32"):
            with _summon_rank0(model, with_grads=True):
                if self.rank == 0:
                    _edit(list(model.parameters()))
        self._check_idle_and_resharded(model)
        self._check_full(model, reference)

    def test_rank0_writeback_grads_other_ranks_allocate_at_most_a_shard(self):
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP],
                "use_orig_params": BOTH,
            },
            self._test_allocate_at_most_a_shard,
            with_grads=True,
        )

    def test_rank0_writeback_grads_padding_stays_zeros(self):
        """The padding of the last rank's gradient shard stays zeros too."""
        self.run_subtests(
            {
                "sharding_strategy": [FULL, GRAD_OP],
                "use_orig_params": BOTH,
            },
            self._test_padding_stays_zeros,
            with_grads=True,
        )

    def test_rank0_writeback_grads_failure(self):
        """
        A rank fails where gradients add a step: no rank hangs, and all agree on the
        gradients too.
        """
        failures = [("gather", 1), ("post_unshard", 0), ("early_free", 1)]
        failures += [("body", 1), ("scatter", 0)]
        failures += self._failures("grad_views", "grad_free")
        config = {"failure": failures, "nested": BOTH}
        self.run_subtests(config, self._test_failure_at, with_grads=True)

    def test_rank0_writeback_grads_collectives(self):
        config = {"fail": [None, "scatter"]}
        self.run_subtests(config, self._test_collectives, with_grads=True)


class TestUnshardRank0WritebackGradsHybrid(_Rank0WritebackTest):
    """Hybrid sharding on a 2 x 2 mesh: every replica gets rank 0's gradients."""

    world_size = 4

    def test_rank0_writeback_grads_hybrid_shard(self):
        mesh = init_device_mesh(self.device.type, (2, 2))
        config = {"sharding_strategy": HYBRID, "use_orig_params": BOTH}
        self.run_subtests(
            config, self._test_hybrid_shard, device_mesh=mesh, with_grads=True
        )


if __name__ == "__main__":
    run_tests()
