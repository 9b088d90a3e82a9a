"""What is active where: the base check, the persistent hook, this process. Reads only, changes nothing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch_overlay import __version__
from torch_overlay._env import ENV_VAR, EnvMode, EnvValueError, env_mode
from torch_overlay._fork import ForkState, active_state, fork_problems
from torch_overlay._guard import BaseCheck, BaseMismatchError, check_base
from torch_overlay._loader import ModuleState, ProcessState, process_state
from torch_overlay._manifest import load_manifest
from torch_overlay._persistent import hook_is_current, installed_hook


@dataclass(frozen=True)
class OverlayStatus:
    base: BaseCheck | None
    """The installed torch against the manifest; None when torch cannot be found."""
    base_error: str | None
    persistent_hook: Path | None
    persistent_hook_current: bool
    env_value: str | None
    env_mode: EnvMode | None
    """What ``TORCH_OVERLAY`` asks; None when it holds a value the overlay does not take (``env_error``)."""
    env_error: str | None
    """Why ``TORCH_OVERLAY`` holds a value the overlay does not take, else None."""
    process: ProcessState
    fork: ForkState | None = None
    """Fork mode's state when the series is applied in place to the installed torch, else None."""

    @property
    def ok(self) -> bool:
        """The base matches (or fork mode patched it), the persistent hook, if any, is the one this package writes,
        and ``TORCH_OVERLAY`` holds a value it takes: ``--status`` and ``--check`` exit 1 otherwise."""
        return not self.problems()

    def problems(self) -> list[str]:
        lines = [self.base_error] if self.base_error else []
        if self.base is not None and self.fork is None:  # fork mode's files are the patched ones, on purpose
            lines += self.base.problems()
        if self.base is not None and self.fork is not None:
            lines += fork_problems(self.fork, self.base.torch_dir)
        if self.env_error is not None:
            lines.append(self.env_error)
        if self.persistent_hook is not None and not self.persistent_hook_current:
            lines.append(
                f"{self.persistent_hook} is not the hook this torch-overlay writes; "
                "rewrite it with `python -m torch_overlay.activate`"
            )
        return lines

    def fix(self) -> str | None:
        """The command that fixes a base mismatch (the one ``activate()``'s refusal names), else None."""
        if self.base is None or self.fork is not None or self.base.ok:
            return None
        return self.base.fix()

    def format(self) -> str:
        """The table ``python -m torch_overlay.activate --status`` prints."""
        rows = [("torch-overlay", f"{__version__} at {Path(__file__).parent}")]
        if self.base is not None:
            rows.append(("torch", f"{self.base.found_version} at {self.base.torch_dir}"))
            if self.fork is not None:  # the files are the patched ones, on purpose
                base = f"torch {self.fork.base_version}, {len(self.base.found)} files: patched by fork mode"
            else:
                base = self.base.summary()
            rows.append(("base", base))
        else:
            rows.append(("torch", f"not found ({self.base_error})"))
        manifest = self.base.manifest if self.base is not None else load_manifest()
        rows.append(("bases", ", ".join(manifest.versions)))
        if self.fork is not None:
            rows.append(("served", f"by fork mode: {len(self.fork.patches)} patches applied in place to torch's files"))
        else:
            rows.append(("served", f"{len(manifest.runtime_modules)} modules at run time (below)"))
        docstring_only = [m.name for m in manifest.modules if not m.runtime]
        if docstring_only:
            rows.append(("not served", f"{', '.join(docstring_only)} (docstrings only: fork mode, series)"))
        hook = self.persistent_hook
        rows.append(("persistent", f"installed ({hook})" if hook else "not installed"))
        fork = self.fork
        rows.append(("fork mode", f"applied ({len(fork.patches)} patches in place)" if fork else "not applied"))
        rows.append((ENV_VAR, self._env_row()))
        if self.fork is not None:
            process = "served by fork mode (torch's own files are patched; nothing to activate)"
        elif self.process.active and not self.process.base_checked:
            process = "active (the base is checked at the first import of a replaced module)"
        elif self.process.active:
            process = "active"
        elif self.process.disabled_reason:
            process = f"stood down ({self.process.disabled_reason})"
        else:
            process = "not active"
        rows.append(("this process", process))
        width = max(len(k) for k, _ in rows) + 2
        lines = [f"{k + ':':<{width}}{v}" for k, v in rows]
        name_width = max(len(name) for name, _ in self.process.modules) + 2
        lines += [f"  {name:<{name_width}}{self._module_state(state)}" for name, state in self.process.modules]
        lines += [f"problem: {p}" for p in self.problems()]
        if self.fix() is not None:
            lines.append(f"fix: {self.fix()}")
        if self.base is not None and self.base.warning:
            lines.append(f"warning: {self.base.warning}")
        return "\n".join(lines)

    def _module_state(self, state: ModuleState) -> str:
        if self.fork is not None and state is ModuleState.STOCK:
            return "patched by fork mode"
        return state.value

    def _env_row(self) -> str:
        if self.env_mode is None:
            return f"{self.env_value} (not a value it takes: see the problem below)"
        row = {
            EnvMode.DEFAULT: "unset" if not (self.env_value or "").strip() else f"{self.env_value!r} (as unset)",
            EnvMode.OFF: f"{self.env_value} (off: the start-up hook and activate() do nothing in this process)",
            EnvMode.REQUIRE: f"{self.env_value} (strict: where the overlay cannot serve, importing torch raises)",
        }[self.env_mode]
        if self.fork is not None:
            row += "; fork mode ignores it (the series is applied in place: `torch-overlay revert-patches`)"
        return row


def status() -> OverlayStatus:
    try:
        mode, env_error = env_mode(), None
    except EnvValueError as e:
        mode, env_error = None, str(e)
    try:
        base, base_error = check_base(), None
    except BaseMismatchError as e:
        base, base_error = None, str(e)
    hook = installed_hook()
    return OverlayStatus(
        base=base,
        base_error=base_error,
        persistent_hook=hook,
        persistent_hook_current=hook is not None and hook_is_current(hook),
        fork=active_state(base.torch_dir if base is not None else None),
        env_value=os.environ.get(ENV_VAR),
        env_mode=mode,
        env_error=env_error,
        process=process_state(),
    )
