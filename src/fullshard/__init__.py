"""fullshard: Fully Sharded Data Parallel training for PyTorch (Zhao et al., 2023).

Its names, and its modules as attributes (`fullshard.planner`), are imported on first use
(PEP 562), so that `import fullshard` alone imports nothing heavy: `fullshard train`'s
launcher, which only starts the ranks, does without DTensor, dynamo and the library (1.5
CPU-seconds a run, and the ranks start 2 s sooner: the launcher imports before they do).
`from fullshard import X` and `fullshard.X` work as in any package."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"  # pyproject.toml's version is this (its [tool.setuptools.dynamic])

HOME = {  # each public name -> the module that defines it
    "CPUOffloadPolicy": "fullshard.policy",
    "DiLoCo": "fullshard.diloco",
    "FSDPModule": "fullshard.module",
    "FullShardError": "fullshard.errors",
    "GradScaler": "fullshard.training",
    "Hardware": "fullshard.planner",
    "MixedPrecisionPolicy": "fullshard.policy",
    "OffloadPolicy": "fullshard.policy",
    "Plan": "fullshard.planner",
    "SaveHandle": "fullshard.checkpoint.background",
    "Stats": "fullshard.accounting",
    "UnshardHandle": "fullshard.module",
    "apply_plan": "fullshard.planner",
    "checkpoint_dir": "fullshard.checkpoint.store",
    "clip_grad_norm_": "fullshard.training",
    "export": "fullshard.checkpoint.export",
    "full_params": "fullshard.training",
    "fully_shard": "fullshard.api",
    "get_state_dict": "fullshard.state_dict",
    "init_weights_from": "fullshard.state_dict",
    "load": "fullshard.checkpoint.store",
    "no_sync": "fullshard.training",
    "optim": "fullshard.optim",  # the module: fullshard.optim.Muon, MatrixOptimizer, muon_groups
    "plan": "fullshard.planner",
    "register_fsdp_forward_method": "fullshard.api",
    "replace_fsdp2": "fullshard.dropin",
    "save": "fullshard.checkpoint.store",
    "set_state_dict": "fullshard.state_dict",
    "shard_model": "fullshard.wrap",
    "share_comm_ctx": "fullshard.api",
    "stats": "fullshard.training",
}
__all__ = sorted(HOME)


def __getattr__(name: str) -> Any:
    if name in HOME:
        module = importlib.import_module(HOME[name])
        value = module if name == "optim" else getattr(module, name)
    elif importlib.util.find_spec(f"fullshard.{name}") is not None:
        value = importlib.import_module(f"fullshard.{name}")
    else:
        raise AttributeError(f"module 'fullshard' has no attribute {name!r}")
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *HOME})
