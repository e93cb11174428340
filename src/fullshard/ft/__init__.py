"""Fault tolerance across replica groups, on torchft: fullshard shards inside each replica
group, torchft's Manager keeps training when a group dies and heals it when it returns.

The recipe (docs/fault-tolerance.md) is FSDP2's with torchft, with fullshard's names:
`Lighthouse` (torchft's, on one address), `replica_store` (the group's TCPStore on that
address), `Manager` (torchft's, its server on that address, healing over `HealTransport`),
and `attach(manager, model, optimizer)` (the cross-replica all-reduce as the units' all-reduce
hook, the shards as the state a joining group heals from).

Files, each importing only those before it: `network` (the version pin, addresses, listeners
on them), `transport` (the heal: a checked JSON header, raw bytes), `manager` (Manager, attach),
`diloco` (ManagedReplicas: fullshard.DiLoCo's syncs on the Manager, Note [managed syncs]).
"""

from fullshard.ft.network import Lighthouse, ProcessGroupGloo, check_torchft, replica_env, replica_store
from fullshard.ft.transport import HealTransport
from fullshard.ft.manager import Manager, attach
from fullshard.ft.diloco import ManagedReplicas

__all__ = ["HealTransport", "Lighthouse", "ManagedReplicas", "Manager", "ProcessGroupGloo", "attach", "check_torchft",
           "replica_env", "replica_store"]
