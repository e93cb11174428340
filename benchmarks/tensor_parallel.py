"""2-D parallelism: bytes per mesh dim and memory of one training step, measured against
fullshard.plan(..., tp=2, tp_plan=...) and the sequence-parallel recipe's closed form.

    .venv/bin/torchrun --standalone --nproc_per_node 4 benchmarks/tensor_parallel.py

The model is tests/models.py's TPLlama (the model of tests/test_tensor_parallel.py) under
its tp_plan(): PyTorch's Llama recipe. Two meshes of the 4 ranks: dp 2 x tp 2 (fullshard's
full_shard over dp) and replicate 2 x shard 1 x tp 2 (hybrid_shard over the first two).

- dp dims: fullshard.stats' bytes of one step (in the shard group; across replicas)
  against the planner's sent_intra and sent_cross for the same candidate.
- tp dim: every collective DTensor issues in the step, logged as it is dispatched, as the
  bytes a bandwidth-optimal algorithm sends (all-gather: (n-1) x input; reduce-scatter:
  (n-1)/n x input; all-reduce: 2 (n-1)/n x input), against the closed form for L blocks,
  local batch B, sequence T, width D, vocabulary V:
    (8 L + 4) (n-1)/n B T D     the residual stream gathered before the attention and MLP
                                 and scattered after them (forward; backward the reverse),
                                 and likewise at the embedding's output and the head's input
    + (n-1)/n B T V             the head's logits gathered
    + (2 L + 1) 2 (n-1)/n D     the sequence-parallel norms' weight gradients summed
  elements of 4 bytes.
- memory: the shards fullshard allocates and the optimizer's state, against the planner's
  terms; activations saved for backward (local parts) against its estimate.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test models

import fullshard  # noqa: E402
from fullshard.hooks import units_under  # noqa: E402
from tests.models import SEQ, TP_DIM, TP_VOCAB, TPBlock, TPLlama, tensor_parallel, tp_plan, tp_token_batch  # noqa: E402

BATCH, LAYERS = 4, 2  # sequences per dp rank; TPLlama's blocks
MESHES = {"dp 2 x tp 2": ((2, 2), ("dp", "tp"), "full_shard"),
          "replicate 2 x shard 1 x tp 2": ((2, 1, 2), ("replicate", "shard", "tp"), "hybrid_shard")}


class TPBytes(TorchDispatchMode):
    """The bytes DTensor's collectives send, by kind, as they are dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in ("all_gather_into_tensor", "reduce_scatter_tensor",
                                                              "all_reduce"):
            t, n = args[0], dist.distributed_c10d._resolve_process_group(args[-1]).size()
            nbytes = t.numel() * t.element_size()
            self.sent += {"all_gather_into_tensor": (n - 1) * nbytes, "reduce_scatter_tensor": (n - 1) * nbytes // n,
                          "all_reduce": 2 * (n - 1) * nbytes // n}[name]
        return func(*args, **(kwargs or {}))


def closed_form_tp_bytes(n: int) -> int:
    B, T, D, V, L = BATCH, SEQ, TP_DIM, TP_VOCAB, LAYERS
    return 4 * ((8 * L + 4) * (n - 1) * B * T * D // n + (n - 1) * B * T * V // n + (2 * L + 1) * 2 * (n - 1) * D // n)


def measure(sizes: tuple, names: tuple, strategy: str) -> dict:
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    torch.manual_seed(0)
    model = tensor_parallel(TPLlama(LAYERS), mesh["tp"])
    dp_mesh = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
    fullshard.shard_model(model, strategy=strategy, wrap={TPBlock}, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = tp_token_batch(torch.Generator().manual_seed(dist.get_rank() // 2), BATCH)
    model(x, y).backward()  # a first step: lazy initialization, optimizer state
    optimizer.step()
    optimizer.zero_grad()
    params = {t.untyped_storage()._cdata for unit in units_under(model)
              for t in [*unit.layout.shards, *([unit.layout.full_flat] if unit.layout.full_flat is not None else [])]}
    saved: dict[int, int] = {}  # storages autograd saves, as the planner counts them

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = (t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t).untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    log = TPBytes()
    with fullshard.stats(model) as s, log:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y)
        loss.backward()
        intra, cross = s.intra_group_bytes, s.cross_group_bytes
    shards = sum(t.numel() * t.element_size() for unit in units_under(model) for t in unit.layout.shards)
    states = sum(v.to_local().numel() * v.to_local().element_size() for state in optimizer.state.values()
                 for v in state.values() if isinstance(v, torch.distributed.tensor.DTensor))
    return {"intra": intra, "cross": cross, "tp": log.sent, "shards": shards, "optimizer": states,
            "saved": sum(saved.values())}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    with torch.device("meta"):
        meta = TPLlama(LAYERS)
    rows = []
    for label, (sizes, names, strategy) in MESHES.items():
        got = measure(sizes, names, strategy)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, got)  # the benchmark's own dicts, between its own ranks
        plan = fullshard.plan(meta, world_size=4, tp=2, tp_plan=tp_plan(), memory_budget=1e15, batch=BATCH, seq=SEQ,
                              precisions=("fp32",), strategies=(strategy,))
        c = next(c for c in plan.candidates if c.wrap == "blocks" and not c.checkpointing)
        worst = {key: max(g[key] for g in everyone) for key in got}
        rows.append((label, worst, c))
    if dist.get_rank() == 0:
        print("| mesh | dp group bytes: measured / planned | across replicas: measured / planned | "
              "tp bytes: measured / closed form | shards B: measured / planned | optimizer B: measured / planned "
              "| saved activations B: measured / planned |")
        print("|---|---|---|---|---|---|---|")
        for label, got, c in rows:
            print(f"| {label} | {got['intra']} / {c.sent_intra} | {got['cross']} / {c.sent_cross} | "
                  f"{got['tp']} / {closed_form_tp_bytes(2)} | {got['shards']} / {c.memory['shards']} | "
                  f"{got['optimizer']} / {c.memory['optimizer']} | {got['saved']} / {c.memory['activations']} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
