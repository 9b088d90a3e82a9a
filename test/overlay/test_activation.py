"""In-process activation: before and after torch is imported, exact deactivation, idempotence, threads.

Each scenario runs in a fresh interpreter that starts on stock torch, so the suite's own activation does
not interfere.
"""

import json
import sys
import textwrap
import unittest

from scratch_env import run

from torch_overlay._manifest import load_manifest

PRELUDE = textwrap.dedent(
    """
    import importlib, inspect, json, sys, threading, types
    import torch_overlay
    from torch_overlay._manifest import load_manifest, PACKAGE_DIR

    NAMES = [m.name for m in load_manifest().modules if not m.new]
    NEW = [m.name for m in load_manifest().new_modules]  # no stock module: served, then removed

    def is_ours(fn):
        return inspect.unwrap(fn).__code__.co_filename.startswith(str(PACKAGE_DIR))

    def references():
        # Every global, in every module, bound to a manifest module or to an object defined in one.
        targets = set()
        for name in NAMES:
            module = sys.modules[name]
            targets.add(id(module))
            targets |= {id(v) for v in vars(module).values() if getattr(v, "__module__", None) == name}
        return {
            (module_name, attr): value
            for module_name, module in list(sys.modules.items())
            if isinstance(module, types.ModuleType)
            for attr, value in list(vars(module).items())
            if id(value) in targets
        }
    """
)


def run_scenario(body: str) -> dict:
    result = run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)])
    if result.returncode != 0:
        raise AssertionError(f"scenario failed (rc {result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


class ActivationTest(unittest.TestCase):
    def test_after_import_round_trip_restores_every_object(self):
        report = run_scenario(
            """
            import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_api
            import torch.distributed.fsdp._state_dict_utils as state_dict_utils
            import torch.distributed.tensor.parallel.fsdp as tp_fsdp
            import torch.distributed.tensor.parallel.ddp  # noqa: F401
            import torch._dynamo.backends.distributed  # noqa: F401
            import torch.distributed._composable.replicate  # noqa: F401
            import torch.distributed.algorithms._optimizer_overlap.optimizer_overlap  # noqa: F401
            import torch.distributed.checkpoint.state_dict  # noqa: F401
            before, modules, meta_path = references(), {n: sys.modules[n] for n in NAMES}, list(sys.meta_path)

            threads = [threading.Thread(target=torch_overlay.activate) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            swapped = {n: sys.modules[n] for n in NAMES}
            torch_overlay.activate()
            report = {
                "finders_added": len(sys.meta_path) - len(meta_path),
                "second_activate_noop": all(sys.modules[n] is m for n, m in swapped.items()),
                "importers_rebound": [
                    is_ours(fsdp_api._unshard_params),
                    is_ours(fsdp_api._unshard_params_for_summon),
                    is_ours(state_dict_utils._unshard_fsdp_state_params),
                    is_ours(tp_fsdp._flatten_tensor),
                    is_ours(sys.modules["torch.distributed.tensor.parallel.ddp"]._flatten_tensor),
                ],
                "parent_attribute": (
                    sys.modules["torch.distributed.fsdp"]._unshard_param_utils
                    is swapped["torch.distributed.fsdp._unshard_param_utils"]
                ),
                "status_active": torch_overlay.status().process.active,
                "new_modules_served": [
                    importlib.import_module(n).__file__.startswith(PACKAGE_DIR) for n in NEW
                ],
                # DTensor registered itself on import, before the swap
                "registry_kept": torch.distributed.tensor.DTensor
                in sys.modules["torch.utils._foreach_utils"]._foreach_supported_types,
            }
            torch_overlay.deactivate()
            torch_overlay.deactivate()
            gone = []
            for n in NEW:
                parent, _, child = n.rpartition(".")
                try:
                    importlib.import_module(n)
                except ModuleNotFoundError:
                    gone.append(n not in sys.modules and not hasattr(sys.modules[parent], child))
            after = references()
            report.update(
                same_bindings=sorted(map(str, before)) == sorted(map(str, after)),
                same_objects=all(before[key] is after[key] for key in before),
                same_modules=all(sys.modules[n] is m for n, m in modules.items()),
                same_meta_path=sys.meta_path == meta_path,
                status_active_after=torch_overlay.status().process.active,
                bindings_checked=len(before),
                new_modules_gone=gone,
            )
            print(json.dumps(report))
            """
        )
        self.assertEqual(report.pop("importers_rebound"), [True] * 5)
        self.assertGreater(report.pop("bindings_checked"), 20)
        new = len(load_manifest().new_modules)
        self.assertEqual(report.pop("new_modules_served"), [True] * new)
        self.assertEqual(report.pop("new_modules_gone"), [True] * new)
        self.assertEqual(
            report,
            {
                "finders_added": 1,
                "second_activate_noop": True,
                "parent_attribute": True,
                "status_active": True,
                "registry_kept": True,
                "same_bindings": True,
                "same_objects": True,
                "same_modules": True,
                "same_meta_path": True,
                "status_active_after": False,
            },
        )

    def test_before_import_is_lazy_and_reversible(self):
        report = run_scenario(
            """
            torch_overlay.activate()
            report = {"torch_imported_by_activate": "torch" in sys.modules}
            import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_api
            import torch.distributed.tensor.parallel.fsdp as tp_fsdp
            report["served_lazily"] = is_ours(fsdp_api._unshard_params) and is_ours(tp_fsdp._flatten_tensor)

            def ddp_classes():
                parallel = sys.modules["torch.nn.parallel"]
                ddp = parallel.DistributedDataParallel
                return is_ours(ddp.__init__), parallel.DistributedDataParallelCPU.__bases__ == (ddp,)

            report["ddp_served_with_its_subclass"] = ddp_classes()
            torch_overlay.deactivate()
            report["ddp_stock_with_its_subclass"] = ddp_classes()
            unshard = sys.modules["torch.distributed.fsdp._unshard_param_utils"]
            report["stock_after_deactivate"] = not is_ours(fsdp_api._unshard_params) and not any(
                is_ours(f) for f in (tp_fsdp._flatten_tensor, unshard._unshard_params)
            )
            print(json.dumps(report))
            """
        )
        self.assertEqual(
            report,
            {
                "torch_imported_by_activate": False,
                "served_lazily": True,
                "ddp_served_with_its_subclass": [True, True],
                "stock_after_deactivate": True,
                "ddp_stock_with_its_subclass": [False, True],
            },
        )

    def test_models_built_before_activation_keep_their_classes(self):
        report = run_scenario(
            """
            import torch.distributed.fsdp as fsdp
            cls = fsdp.FullyShardedDataParallel
            torch_overlay.activate()
            print(json.dumps({
                "same_fsdp_class": fsdp.FullyShardedDataParallel is cls,
                "served": sorted(n for n, s in torch_overlay.status().process.modules if s.value == "overlay"),
            }))
            """
        )
        self.assertEqual(
            report,
            {
                "same_fsdp_class": True,
                "served": [
                    "torch.distributed._composable.replicate",  # imported by torch.distributed.fsdp
                    "torch.distributed.fsdp._flat_param",
                    "torch.distributed.fsdp._unshard_param_utils",
                    "torch.distributed.tensor.parallel._data_parallel_utils",
                    "torch.nn.parallel.distributed",  # imported by torch
                    "torch.nn.utils.clip_grad",  # imported by torch
                    "torch.utils._foreach_utils",  # imported by torch
                ],
            },
        )

    def test_a_file_whose_classes_others_hold_keeps_them(self):
        """``_flat_param.py`` (``keep_classes``): served after import, its classes stay the stock objects, with
        our methods (a subclass defined before activation gets them too), and deactivation restores their
        namespaces exactly; ``_init_utils``'s table of its enum members keeps working."""
        report = run_scenario(
            """
            import torch
            from torch.distributed.fsdp import ShardingStrategy
            import torch.distributed.fsdp._flat_param as flat_param
            import torch.distributed.fsdp._init_utils as init_utils
            module = flat_param
            classes = {k: v for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__}
            namespaces = {k: dict(vars(v)) for k, v in classes.items()}
            stock_unshard_grad = flat_param.FlatParamHandle.unshard_grad

            class UserHandle(flat_param.FlatParamHandle):  # a subclass outside torch
                pass

            def state():
                served = sys.modules[module.__name__]
                return {
                    "served": is_ours(served.FlatParamHandle.unshard_grad),
                    "subclass_served": is_ours(UserHandle.unshard_grad),
                    "same_classes": all(getattr(served, k) is v for k, v in classes.items()),
                    "table": init_utils.SHARDING_STRATEGY_MAP[ShardingStrategy.NO_SHARD]
                    is served.HandleShardingStrategy.NO_SHARD,
                }

            torch_overlay.activate()
            active = state()
            torch_overlay.deactivate()
            after = state()
            after["namespaces_restored"] = all(
                dict(vars(classes[k])).keys() == ns.keys() and all(vars(classes[k])[a] is v for a, v in ns.items())
                for k, ns in namespaces.items()
            )
            after["stock_method"] = flat_param.FlatParamHandle.unshard_grad is stock_unshard_grad
            print(json.dumps({"active": active, "after": after}))
            """
        )
        self.assertEqual(
            report["active"], {"served": True, "subclass_served": True, "same_classes": True, "table": True}
        )
        self.assertEqual(
            report["after"],
            {
                "served": False,
                "subclass_served": False,
                "same_classes": True,
                "table": True,
                "namespaces_restored": True,
                "stock_method": True,
            },
        )

    def test_a_file_whose_classes_others_hold_first_imported_while_active(self):
        """Imported first while active, ``_flat_param.py`` is executed from torch's file, then from ours onto
        its classes: deactivation and activation again keep the same class objects, and so do a reload and a
        new import while active."""
        report = run_scenario(
            """
            torch_overlay.activate()
            import torch
            from torch.distributed.fsdp import ShardingStrategy
            import torch.distributed.fsdp._flat_param as flat_param
            import torch.distributed.fsdp._init_utils as init_utils
            name, handle = flat_param.__name__, flat_param.FlatParamHandle

            def state():
                served = sys.modules[name]
                return [
                    served.FlatParamHandle is handle,
                    is_ours(handle.unshard_grad),
                    init_utils.SHARDING_STRATEGY_MAP[ShardingStrategy.NO_SHARD]
                    is served.HandleShardingStrategy.NO_SHARD,
                ]

            report = [state()]
            torch_overlay.deactivate()
            report.append(state())
            torch_overlay.activate()
            report.append(state())
            importlib.reload(flat_param)  # onto the same classes again
            del sys.modules[name]
            importlib.import_module(name)
            report.append(state())
            torch_overlay.deactivate()
            report.append(state())
            print(json.dumps(report))
            """
        )
        on, off = [True, True, True], [True, False, True]
        self.assertEqual(report, [on, off, on, on, off])

    def test_ddp_after_import_keeps_its_classes_and_is_restored(self):
        """DDP's module is served with ``keep_classes``: every reference to DistributedDataParallel (the package's,
        replicate's, torch's subclass DistributedDataParallelCPU) stays the stock class object, with the overlay's
        methods while active and stock's after deactivate(); the module object is served, then restored."""
        report = run_scenario(
            """
            from torch_overlay._guard import check_base
            import torch.distributed._composable.replicate  # noqa: F401

            def ddp_objects():
                parallel = sys.modules["torch.nn.parallel"]
                return {
                    "module": sys.modules["torch.nn.parallel.distributed"],
                    "class": parallel.distributed.DistributedDataParallel,
                    "torch.nn.parallel.DistributedDataParallel": parallel.DistributedDataParallel,
                    "DistributedDataParallelCPU": parallel.DistributedDataParallelCPU,
                    "replicate's": sys.modules["torch.distributed._composable.replicate"].DistributedDataParallel,
                }

            before = ddp_objects()
            torch_overlay.activate()
            during = ddp_objects()
            manifest = load_manifest()
            served = manifest.payload_file(manifest.module("torch.nn.parallel.distributed"), check_base().matched)
            report = {
                "served_for_this_base": during["module"].__file__ == served,
                "new": [k for k in before if during[k] is not before[k]],
                "overlay_methods": is_ours(before["class"].forward) and is_ours(before["class"].__init__),
                "subclass_on_it": during["DistributedDataParallelCPU"].__bases__ == (before["class"],),
            }
            torch_overlay.deactivate()
            after = ddp_objects()
            report["restored"] = [k for k in before if after[k] is not before[k]]
            report["stock_methods"] = not is_ours(before["class"].forward) and not is_ours(before["class"].__init__)
            print(json.dumps(report))
            """
        )
        self.assertEqual(
            report,
            {
                "served_for_this_base": True,
                "new": ["module"],  # the module object; every class stays the stock one
                "overlay_methods": True,
                "subclass_on_it": True,
                "restored": [],
                "stock_methods": True,
            },
        )

    def test_a_ddp_class_captured_before_activation_trains_as_tp_alone(self):
        """A DistributedDataParallel kept from before activate() (a framework's registry, a default argument) is the
        served class: over 2 ranks (dp) it keeps the TP parameters as DTensors in named_parameters() and averages
        their gradients; after deactivate() the same object is stock DDP again, which drops them at the forward."""
        report = run_scenario(
            """
            import copy, multiprocessing, os, tempfile
            import torch, torch.distributed as dist, torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel
            registry = {"ddp": DistributedDataParallel}
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            def train(rank, world_size, init, queue):
                dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
                mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
                torch.manual_seed(0)
                plain = nn.Linear(4, 4)
                model = parallelize_module(nn.Sequential(copy.deepcopy(plain)), mesh["tp"], {"0": ColwiseParallel()})
                ddp = registry["ddp"](model, device_mesh=mesh["dp"])
                inputs = [torch.full((2, 4), 1.0 + r) for r in range(world_size)]
                ddp(inputs[rank]).sum().backward()
                for x in inputs:  # the plain model's gradient, summed over every rank's input
                    plain(x).sum().backward()
                grad = model[0].weight.grad
                queue.put({
                    "names": [n for n, p in ddp.named_parameters() if isinstance(p, DTensor)],
                    "averaged": grad is not None and torch.allclose(grad.full_tensor(), plain.weight.grad / world_size),
                })
                dist.destroy_process_group()

            def run(world_size):
                init, queue = tempfile.mktemp(), multiprocessing.get_context("fork").Queue()
                ranks = [
                    multiprocessing.get_context("fork").Process(target=train, args=(r, world_size, init, queue))
                    for r in range(world_size)
                ]
                for p in ranks:
                    p.start()
                reports = [queue.get(timeout=120) for _ in ranks]
                for p in ranks:
                    p.join()
                return reports

            torch_overlay.activate()
            report = {"same_class": registry["ddp"] is torch.nn.parallel.DistributedDataParallel, "active": run(2)}
            torch_overlay.deactivate()
            report["after"] = run(1)
            report["still_same_class"] = registry["ddp"] is torch.nn.parallel.DistributedDataParallel
            print(json.dumps(report))
            """
        )
        trained = {"names": ["module.0.weight", "module.0.bias"], "averaged": True}
        self.assertEqual(report["active"], [trained, trained])
        self.assertEqual(report["after"], [{"names": [], "averaged": False}], "stock DDP drops the TP parameters")
        self.assertEqual((report["same_class"], report["still_same_class"]), (True, True))

    def test_models_wrapped_before_activation_refuse_and_change_nothing(self):
        """A DDP built by stock code cannot run the overlay's methods (nor one built while active stock's): activate()
        (and deactivate()) refuse while one is alive, naming the fix, and change nothing; once it is gone, they go
        ahead. A user's subclass of DDP, defined before activation, gets the overlay's methods."""
        report = run_scenario(
            """
            import gc, os, socket
            import torch, torch.distributed as dist, torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel

            class MyDDP(DistributedDataParallel):  # a subclass outside torch
                pass

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=0, world_size=1)

            def attempt(action):
                modules, meta_path = dict(sys.modules), list(sys.meta_path)
                try:
                    action()
                    refused = None
                except torch_overlay.LiveInstancesError as e:
                    refused = str(e)
                unchanged = all(sys.modules[n] is m for n, m in modules.items()) and sys.meta_path == meta_path
                return refused, unchanged

            early = MyDDP(nn.Linear(4, 4))
            report = {"activate": attempt(torch_overlay.activate), "active": torch_overlay.status().process.active}
            del early
            report["then"] = attempt(torch_overlay.activate)
            late = MyDDP(nn.Linear(4, 4))
            late(torch.ones(2, 4)).sum().backward()
            report["subclass_served"] = is_ours(MyDDP.forward)
            report["deactivate"] = attempt(torch_overlay.deactivate)
            del late
            report["finally"] = attempt(torch_overlay.deactivate)
            dist.destroy_process_group()
            print(json.dumps(report))
            """
        )
        refused, unchanged = report.pop("activate")
        self.assertEqual(
            refused,
            "torch_overlay: refusing to activate the overlay: 1 object(s) of __main__.MyDDP were built before "
            "activation, and would run the overlay's methods on what stock torch built; nothing was changed. Activate "
            "before wrapping models: `python -m torch_overlay.activate` (every process), or torch_overlay.activate() "
            "before building them.",
        )
        self.assertTrue(unchanged)
        refused, unchanged = report.pop("deactivate")
        self.assertIn(
            "refusing to deactivate the overlay: 1 object(s) of __main__.MyDDP were built while active", refused
        )
        self.assertTrue(unchanged)
        self.assertEqual(
            report, {"active": False, "then": [None, False], "subclass_served": True, "finally": [None, False]}
        )

    def test_a_subclass_of_a_served_class_outside_torch_refuses_and_changes_nothing(self):
        """A module served as a new module (not ``keep_classes``) makes new classes: a user's subclass would keep
        the class it was defined on, so activate() after it, and deactivate() after one defined while active,
        refuse in one line naming the fix, having changed nothing."""
        report = run_scenario(
            """
            import torch
            from torch.distributed.algorithms._optimizer_overlap.optimizer_overlap import OverlappedOptimizer

            class MyOverlapped(OverlappedOptimizer):
                pass

            modules, meta_path = dict(sys.modules), list(sys.meta_path)
            try:
                torch_overlay.activate()
                refused = None
            except torch_overlay.SubclassedError as e:
                refused = str(e)
            report = {
                "refused": refused,
                "unchanged": all(sys.modules[n] is m for n, m in modules.items()) and sys.meta_path == meta_path,
                "active": torch_overlay.status().process.active,
            }
            del MyOverlapped
            import gc
            gc.collect()
            torch_overlay.activate()  # the subclass is gone
            served = sys.modules["torch.distributed.algorithms._optimizer_overlap.optimizer_overlap"]

            class Later(served.OverlappedOptimizer):
                pass

            modules = dict(sys.modules)
            try:
                torch_overlay.deactivate()
            except torch_overlay.SubclassedError as e:
                report["deactivate_refused"] = str(e)
            report["still_active"] = torch_overlay.status().process.active and all(
                sys.modules[n] is m for n, m in modules.items()
            )
            print(json.dumps(report))
            """
        )
        self.assertEqual(
            report.pop("refused"),
            "torch_overlay: refusing to activate the overlay: __main__.MyOverlapped subclasses "
            "torch.distributed.algorithms._optimizer_overlap.optimizer_overlap.OverlappedOptimizer, which the overlay "
            "serves, and would keep the stock class; nothing was changed. Activate before that class is defined: "
            "`python -m torch_overlay.activate` (every process), or torch_overlay.activate() before importing it.",
        )
        self.assertIn("refusing to deactivate the overlay: __main__.Later subclasses", report.pop("deactivate_refused"))
        self.assertEqual(report, {"unchanged": True, "active": False, "still_active": True})

    def test_a_failing_base_check_stands_down_without_breaking_imports(self):
        report = run_scenario(
            """
            import warnings
            import torch_overlay._finder as finder
            from torch_overlay._startup import boot

            def broken():
                raise PermissionError("unreadable torch file")

            finder.first_use_check = broken
            boot()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                import torch.distributed.tensor.parallel.ddp as ddp
                import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_api
            try:
                torch_overlay.activate()
                raised = None
            except torch_overlay.BaseMismatchError as e:
                raised = str(e)
            print(json.dumps({
                "stock": not is_ours(ddp._localize_dtensor) and not is_ours(fsdp_api._unshard_params),
                "warnings": [str(w.message) for w in caught if "torch_overlay" in str(w.message)],
                "activate_raised": raised,
            }))
            """
        )
        self.assertTrue(report["stock"])
        self.assertEqual(len(report["warnings"]), 1, report)
        self.assertIn("the base check failed: PermissionError('unreadable torch file')", report["warnings"][0])
        self.assertIn("stood down in this process: the base check failed", report["activate_raised"])

    def test_torch_compile_treats_overlay_files_as_the_upstream_ones(self):
        """Dynamo's own predicates answer alike for each overlay file and its upstream file, on this base."""
        report = run_scenario(
            """
            import inspect
            from torch_overlay._dynamo_rules import path_lists, upstream_and_overlay_paths
            import torch

            def predicates(trace_rules):
                # Every predicate of trace_rules that takes a file name: check_file, is_torch_inline_allowed,
                # and from torch 2.14 on is_ngb_suppressed_inline (nested graph breaks in torch.distributed).
                # Not is_torch, which asks whether a file lies inside the torch package (ours do not, by design)
                # and which nothing in torch calls.
                found = {}
                for name, fn in vars(trace_rules).items():
                    if name == "is_torch":
                        continue
                    if inspect.isfunction(fn) and fn.__module__ == trace_rules.__name__:
                        params = list(inspect.signature(fn).parameters)
                        if params[:1] == ["filename"] and (name.startswith("is_") or name == "check_file"):
                            found[name] = fn
                return found

            def answers(trace_rules, path):
                out = {}
                for name, fn in predicates(trace_rules).items():
                    if name == "check_file":
                        out[name] = [fn(path, inlined).skipped for inlined in (False, True)]
                    else:
                        out[name] = fn(path)
                return out

            def differences(trace_rules):
                return [
                    (name, up)
                    for up, ours in upstream_and_overlay_paths()
                    for name, value in answers(trace_rules, up).items()
                    if answers(trace_rules, ours)[name] != value
                ]

            torch_overlay.activate()
            import torch._dynamo.trace_rules as trace_rules  # imported while active
            # A file under torch/distributed: the nested-graph-break list holds those (from torch 2.14 on).
            upstream = next(up for up, _ in upstream_and_overlay_paths() if "/torch/distributed/" in up)
            report = {
                "predicates": sorted(predicates(trace_rules)),
                "lists": sorted(path_lists(trace_rules)),
                "upstream_answers": answers(trace_rules, upstream),
                "imported_after": differences(trace_rules),
            }
            # init_process_group calls it: it rebuilds MOD_INLINELIST but not MOD_SKIPLIST.
            trace_rules.clear_lru_cache()
            report["after_clear_lru_cache"] = differences(trace_rules)
            torch_overlay.deactivate()
            report["unregistered"] = differences(trace_rules) != []
            trace_rules.clear_lru_cache()
            report["clear_restored"] = not hasattr(trace_rules.clear_lru_cache, "_overlay_original")
            torch_overlay.activate()  # trace_rules imported before activation
            report["imported_before"] = differences(trace_rules)
            print(json.dumps(report))
            """
        )
        self.assertEqual(report["imported_after"], [])
        self.assertEqual(report["imported_before"], [])
        self.assertEqual(report["after_clear_lru_cache"], [])
        self.assertTrue(report["clear_restored"], "deactivate() leaves trace_rules.clear_lru_cache wrapped")
        self.assertTrue(report["unregistered"], "without the overlay's registration, dynamo treats our files apart")
        self.assertIn("check_file", report["predicates"])
        self.assertIn("is_torch_inline_allowed", report["predicates"])
        # Not vacuous where dynamo has the nested-graph-break list: the upstream files are in it, and so are ours.
        if "get_ngb_suppress_inlinelist" in report["lists"]:
            self.assertIn("is_ngb_suppressed_inline", report["predicates"])
            self.assertTrue(report["upstream_answers"]["is_ngb_suppressed_inline"], report)

    def test_env_kill_switch_wins_over_activate(self):
        result = run(
            [
                sys.executable,
                "-c",
                "import warnings, torch_overlay\n"
                "with warnings.catch_warnings(record=True) as w:\n"
                "    warnings.simplefilter('always'); torch_overlay.activate()\n"
                "print(torch_overlay.status().process.active, [str(x.message) for x in w])",
            ],
            env={**__import__("scratch_env").clean_env(), "TORCH_OVERLAY": "0"},
        )
        self.assertEqual(result.stdout.strip(), "False ['torch_overlay.activate() ignored: TORCH_OVERLAY=0 is set']")


if __name__ == "__main__":
    unittest.main()
