"""The sharding strategies by name (shard_model's `strategy=`, `fullshard train --strategy`),
as plain data without torch: the launcher of a run checks its options before any rank starts."""

# Strategy name -> how shard_model calls fully_shard. "mesh_dims" names the roles of the
# data-parallel mesh: parameters are sharded over "shard" and replicated over "replicate".
STRATEGIES = {
    "full_shard": {"reshard_after_forward": True, "mesh_dims": ("shard",)},
    "shard_grad_op": {"reshard_after_forward": False, "mesh_dims": ("shard",)},
    "hybrid_shard": {"reshard_after_forward": True, "mesh_dims": ("replicate", "shard")},
    "no_shard": {"reshard_after_forward": False, "mesh_dims": ("replicate",)},
}
