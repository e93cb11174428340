"""fullshard: Fully Sharded Data Parallel training for PyTorch (Zhao et al., 2023)."""

from fullshard.api import fully_shard, register_fsdp_forward_method, share_comm_ctx
from fullshard.module import FSDPModule, UnshardHandle
from fullshard.errors import FullShardError
from fullshard.planner import Hardware, Plan, apply_plan, plan
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.checkpoint import SaveHandle, checkpoint_dir, export, load, save
from fullshard.dropin import replace_fsdp2
from fullshard.state_dict import get_state_dict, init_weights_from, set_state_dict
from fullshard.stats import Stats
from fullshard.training import GradScaler, clip_grad_norm_, full_params, no_sync, stats
from fullshard.wrap import shard_model
from fullshard.diloco import DiLoCo
from fullshard import optim  # fullshard.optim.Muon, MatrixOptimizer, muon_groups

__all__ = [
    "CPUOffloadPolicy",
    "DiLoCo",
    "FSDPModule",
    "FullShardError",
    "GradScaler",
    "Hardware",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Plan",
    "SaveHandle",
    "Stats",
    "UnshardHandle",
    "apply_plan",
    "checkpoint_dir",
    "clip_grad_norm_",
    "export",
    "full_params",
    "fully_shard",
    "get_state_dict",
    "init_weights_from",
    "load",
    "no_sync",
    "optim",
    "plan",
    "register_fsdp_forward_method",
    "replace_fsdp2",
    "save",
    "set_state_dict",
    "shard_model",
    "share_comm_ctx",
    "stats",
]
