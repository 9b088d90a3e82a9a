"""In-process activation: before and after torch is imported, exact deactivation, idempotence, threads.

Each scenario runs in a fresh interpreter that starts on stock torch, so the suite's own activation does
not interfere.
"""

import json
import sys
import textwrap
import unittest

from scratch_env import run

PRELUDE = textwrap.dedent(
    """
    import inspect, json, sys, threading, types
    import torch_overlay
    from torch_overlay._manifest import load_manifest, PACKAGE_DIR

    NAMES = [m.name for m in load_manifest().modules]

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
            before, modules, meta_path = references(), {n: sys.modules[n] for n in NAMES}, list(sys.meta_path)

            threads = [threading.Thread(target=torch_overlay.activate) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            swapped = list(sys.modules[n] for n in NAMES)
            torch_overlay.activate()
            report = {
                "finders_added": len(sys.meta_path) - len(meta_path),
                "second_activate_noop": all(sys.modules[n] is m for n, m in zip(NAMES, swapped)),
                "importers_rebound": [
                    is_ours(fsdp_api._unshard_params),
                    is_ours(fsdp_api._unshard_params_for_summon),
                    is_ours(state_dict_utils._unshard_fsdp_state_params),
                    is_ours(tp_fsdp._flatten_tensor),
                    is_ours(sys.modules["torch.distributed.tensor.parallel.ddp"]._flatten_tensor),
                ],
                "parent_attribute": sys.modules["torch.distributed.fsdp"]._unshard_param_utils is swapped[2],
                "status_active": torch_overlay.status().process.active,
            }
            torch_overlay.deactivate()
            torch_overlay.deactivate()
            after = references()
            report.update(
                same_bindings=sorted(map(str, before)) == sorted(map(str, after)),
                same_objects=all(before[key] is after[key] for key in before),
                same_modules=all(sys.modules[n] is m for n, m in modules.items()),
                same_meta_path=sys.meta_path == meta_path,
                status_active_after=torch_overlay.status().process.active,
                bindings_checked=len(before),
            )
            print(json.dumps(report))
            """
        )
        self.assertEqual(report.pop("importers_rebound"), [True] * 5)
        self.assertGreater(report.pop("bindings_checked"), 20)
        self.assertEqual(
            report,
            {
                "finders_added": 1,
                "second_activate_noop": True,
                "parent_attribute": True,
                "status_active": True,
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
            torch_overlay.deactivate()
            report["stock_after_deactivate"] = not is_ours(fsdp_api._unshard_params) and not any(
                is_ours(f) for f in (tp_fsdp._flatten_tensor, sys.modules[NAMES[2]]._unshard_params)
            )
            print(json.dumps(report))
            """
        )
        self.assertEqual(
            report, {"torch_imported_by_activate": False, "served_lazily": True, "stock_after_deactivate": True}
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
                    "torch.distributed.fsdp._unshard_param_utils",
                    "torch.distributed.tensor.parallel._data_parallel_utils",
                ],
            },
        )

    def test_a_failing_base_check_stands_down_without_breaking_imports(self):
        report = run_scenario(
            """
            import warnings
            import torch_overlay._loader as loader
            from torch_overlay._startup import boot

            def broken():
                raise PermissionError("unreadable torch file")

            loader.stand_down_reason = broken
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
        report = run_scenario(
            """
            from torch_overlay._dynamo_rules import _upstream_and_overlay_paths
            import torch

            def same_rules(trace_rules):
                return all(
                    trace_rules.check_file(up, inlined).skipped == trace_rules.check_file(ours, inlined).skipped
                    for up, ours in _upstream_and_overlay_paths()
                    for inlined in (False, True)
                )

            def registered(trace_rules):
                ours = {o for _, o in _upstream_and_overlay_paths()}
                return any(ours & s for s in (trace_rules.get_mod_skiplist(), trace_rules.get_mod_inlinelist()))

            torch_overlay.activate()
            import torch._dynamo.trace_rules as trace_rules  # imported while active
            report = {"imported_after": same_rules(trace_rules)}
            torch_overlay.deactivate()
            report["unregistered"] = not registered(trace_rules)
            torch_overlay.activate()  # trace_rules imported before activation
            report["imported_before"] = same_rules(trace_rules) and registered(trace_rules)
            print(json.dumps(report))
            """
        )
        self.assertEqual(report, {"imported_after": True, "unregistered": True, "imported_before": True})

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
