"""replace_fsdp2: run code that calls torch's fully_shard (Accelerate, the HF Trainer,
torchtitan's recipes) on fullshard.

# Note [replacing FSDP2]: frameworks reach torch's fully_shard in two ways: by attribute at
# call time (`from torch.distributed.fsdp import fully_shard` inside a function: Accelerate,
# the HF Trainer) and by a name bound when their module was imported (torchtitan's
# parallelize files). replace_fsdp2 rebinds both: the names in torch's public FSDP2
# namespaces, and every module-level name (an alias too) in an already-imported module
# outside torch that is bound to one of torch's functions. torch's own internals keep
# torch's (its FSDP2 modules made before, or beside, still work). Modules imported while it is active bind fullshard's through torch's names.
# On restore each name it changed gets torch's object back (names bound by imports made
# meanwhile stay fullshard's). torch's FSDPModule needs no replacing: fullshard's
# subclasses it (Note [torch's FSDPModule]), and torch's policy objects are taken as they are.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch.distributed.fsdp as torch_fsdp

from fullshard.api import fully_shard, register_fsdp_forward_method, share_comm_ctx

REPLACED = {"fully_shard": fully_shard, "register_fsdp_forward_method": register_fsdp_forward_method,
            "share_comm_ctx": share_comm_ctx}
PUBLIC = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")


class replace_fsdp2:  # noqa: N801 (used as a function and as a context manager)
    """Make torch's ``fully_shard`` (and ``register_fsdp_forward_method``, ``share_comm_ctx``)
    fullshard's, until ``restore()`` or the end of the ``with`` block.

    ``with fullshard.replace_fsdp2(): trainer.train()`` shards what the framework shards with
    fullshard; ``fullshard.replace_fsdp2()`` alone does so for the rest of the process. See
    Note [replacing FSDP2] and docs/integrations.md.
    """

    def __init__(self) -> None:
        theirs = {id(getattr(torch_fsdp, name)): name for name in REPLACED if hasattr(torch_fsdp, name)}
        self.changed: list[tuple[ModuleType, str, object]] = []
        for module in list(sys.modules.values()):
            if not isinstance(module, ModuleType) or module.__name__.split(".")[0] in ("torch", "fullshard") \
                    and module.__name__ not in PUBLIC:
                continue
            for attr, value in list(vars(module).items()):
                name = theirs.get(id(value))
                if name is not None:
                    self.changed.append((module, attr, value))
                    setattr(module, attr, REPLACED[name])

    def restore(self) -> None:
        """Give torch's names back (in the reverse order they were changed)."""
        for module, attr, value in reversed(self.changed):
            setattr(module, attr, value)
        self.changed = []

    def __enter__(self) -> replace_fsdp2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
