"""2-D parallelism: fullshard over the data-parallel dims of a mesh whose other dim runs
PyTorch's tensor parallelism (parallelize_module), at world 4 as dp 2 x tp 2 and as HSDP x
TP on a 3-D mesh. The reference is one process training the same model, unparallelized,
on the whole global batch; tensor parallelism splits every matrix product of a forward
and sums the parts, so the tolerances are parity's (tests/reference.py)."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fullshard
from fullshard.hooks import units_under
from tests.models import SEQ, TPBlock, TPLlama, tensor_parallel, tp_plan, tp_token_batch
from tests.reference import ADAMW_TOL, LOSS_TOL, global_batches, make_optimizer
from tests.test_errors import raises


SHAPES = {"2x2": ((2, 2), ("dp", "tp")), "hsdp 2x1x2": ((2, 1, 2), ("replicate", "shard", "tp")),
          "flattened 2x1x2": ((2, 1, 2), ("a", "b", "tp"))}  # dp: dims a and b flattened into one


def build(shape: str | None, seed: int | str = 0, meta: bool = False, **options) -> tuple[torch.nn.Module, tuple]:
    """A TPLlama, tensor-parallel over the mesh's last dim (shape None: not at all) and sharded
    over the others; returns it with (dp size, this rank's dp index)."""
    torch.manual_seed(dist.get_rank() // 2 if seed == "dp" else seed)  # "dp": a model per dp index of 2x2
    with torch.device("meta" if meta else "cpu"):
        model = TPLlama()
    if shape is None:
        dp_mesh, dp, index = None, dist.get_world_size(), dist.get_rank()
    else:
        sizes, names = SHAPES.get(shape, (None, None)) if shape in SHAPES else (shape, ("dp", "tp"))
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        tensor_parallel(model, mesh["tp"])
        dp_mesh = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
        if shape == "flattened 2x1x2":
            dp_mesh = dp_mesh._flatten("dp")
        coordinate = mesh.get_coordinate()
        dp, index = sizes[0] * (sizes[1] if len(sizes) > 2 else 1), coordinate[0] * (sizes[1] if len(sizes) > 2 else 1)
        index += coordinate[1] if len(sizes) > 2 else 0
    strategy = "hybrid_shard" if dp_mesh is not None and dp_mesh.ndim == 2 else "full_shard"
    fullshard.shard_model(model, strategy=strategy, wrap={TPBlock}, mesh=dp_mesh, **options)
    return model, (dp, index)


def parity_job(shape: str, offload: bool = False) -> dict:
    """Three AdamW steps with clip_grad_norm_, against one process on the whole batch."""
    options = {"offload_policy": fullshard.CPUOffloadPolicy()} if offload else {}
    model, (dp, index) = build(shape, **options)
    torch.manual_seed(0)
    reference = TPLlama()
    optimizer, ref_optimizer = make_optimizer("adamw", model), make_optimizer("adamw", reference)
    losses, norms = [], []
    for x, y in global_batches(tp_token_batch, 3, 8):
        loss = model(x.chunk(dp)[index], y.chunk(dp)[index])
        loss.backward()
        norm = fullshard.clip_grad_norm_(model, 0.5)
        optimizer.step()
        optimizer.zero_grad()
        want = reference(x, y)
        want.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(abs(total.item() / dist.get_world_size() - want.item()))
        norms.append(abs(norm.item() - ref_norm.item()))
    sd, _ = fullshard.get_state_dict(model)
    return {"loss": max(losses), "norm": max(norms),
            "param": max((sd[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "placements": {n: [repr(p) for p in param.placements] for n, param in model.named_parameters()}}


def test_2d_and_hybrid_2d_train_like_one_process(world4):
    for shape in SHAPES:
        results = world4.run(parity_job, shape=shape, offload=shape == "hsdp 2x1x2")
        for rank, got in enumerate(results):
            assert got["loss"] <= LOSS_TOL and got["param"] <= ADAMW_TOL, (shape, rank, got)
            assert got["norm"] <= 1e-6, (shape, rank, got["norm"])  # the norm over every mesh dim
        if shape.startswith("flattened"):  # the norm counts each piece once, whatever the dims' names
            continue
        placements = results[0]["placements"]
        dp = ["Replicate()", "Shard(dim=0)"] if shape.startswith("hsdp") else ["Shard(dim=0)"]
        strided = dp[:-1] + ["_StridedShard(dim=0, sf=2)"]
        assert placements["layers.0.attention.wq.weight"] == strided + ["Shard(dim=0)"]  # colwise: rows of rows
        assert placements["layers.0.attention.wo.weight"] == dp + ["Shard(dim=1)"]  # rowwise
        assert placements["layers.0.ffn_norm.weight"] == dp + ["Replicate()"]  # sequence parallel


def planned_job() -> dict:
    """One step's bytes over the dp dim and the shards' bytes of a 2-D model sharded by
    apply_plan, and what fullshard.plan predicted for them."""
    with torch.device("meta"):
        meta = TPLlama()
    plan = fullshard.plan(meta, world_size=4, tp=2, tp_plan=tp_plan(), memory_budget=1e15, batch=4, seq=SEQ,
                          hardware="a100", precisions=("fp32",), strategies=("full_shard",))  # a100: no probe
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = fullshard.apply_plan(tensor_parallel(TPLlama(), mesh["tp"]), plan, mesh=mesh["dp"])
    x, y = tp_token_batch(torch.Generator().manual_seed(mesh.get_coordinate()[0]), 4)
    model(x, y).backward()
    with fullshard.stats(model) as s:
        model(x, y).backward()
    c = plan.chosen
    return {"sent": (s.intra_group_bytes, c.sent_intra), "cross": s.cross_group_bytes,
            "shards": (sum(t.nbytes for unit in units_under(model) for t in unit.layout.shards), c.memory["shards"])}


def test_the_planner_predicts_a_2d_steps_dp_bytes_and_shards_exactly(world4):
    # gathers and reductions run over the dp ranks only, on each rank's TP part
    for got in world4.run(planned_job):
        assert got["sent"][0] == got["sent"][1] > 0 and got["cross"] == 0, got
        assert got["shards"][0] == got["shards"][1], got


def checkpoint_job(directory: str) -> dict:
    """Save at dp 2 x tp 2; load at 4 x 1, 1 x 4, into 1-D fullshard without TP, and at 2 x 2."""
    model, (dp, index) = build("2x2")
    optimizer = make_optimizer("adamw", model)
    x, y = tp_token_batch(torch.Generator().manual_seed(0), 8)
    model(x.chunk(dp)[index], y.chunk(dp)[index]).backward()
    optimizer.step()
    optimizer.zero_grad()
    fullshard.save(directory, model, optimizer, step=1)
    want, want_optim = fullshard.get_state_dict(model, optimizer)
    diffs = {}
    for shape in ((4, 1), (1, 4), None, "2x2"):
        other, (dp, index) = build(shape, seed=5)
        other_optimizer = make_optimizer("adamw", other)
        other(x.chunk(dp)[index], y.chunk(dp)[index]).backward()
        other_optimizer.step()  # state to overwrite
        fullshard.load(directory, other, other_optimizer)
        got, got_optim = fullshard.get_state_dict(other, other_optimizer)
        diffs[str(shape)] = max([(got[k] - want[k]).abs().max().item() for k in want] +
                                [(got_optim["state"][k][s] - v).abs().max().item()
                                 for k, state in want_optim["state"].items() for s, v in state.items()])
    return diffs


def test_2d_checkpoints_load_at_other_mesh_shapes_and_without_tensor_parallelism(world4, tmp_path):
    directory = tempfile.mkdtemp(dir=tmp_path)
    for diffs in world4.run(checkpoint_job, directory=directory):
        assert diffs == {"(4, 1)": 0.0, "(1, 4)": 0.0, "None": 0.0, "2x2": 0.0}, diffs
    shutil.rmtree(directory)


def views_job() -> dict:
    """Deferred initialization, sync_module_states, full_params, sharded state dicts and gradient
    accumulation of a 2-D model."""
    torch.manual_seed(0)
    reference = TPLlama()
    eager, (dp, index) = build("2x2")
    meta, _ = build("2x2", meta=True)
    x, y = tp_token_batch(torch.Generator().manual_seed(0), 4)
    synced, _ = build("2x2", seed="dp", sync_module_states=True)  # dp index 0's values win
    synced_sd, _ = fullshard.get_state_dict(synced)
    meta_sd, _ = fullshard.get_state_dict(meta)
    sharded_sd, _ = fullshard.get_state_dict(eager, full=False)
    with fullshard.full_params(eager, writeback=False):
        inside = eager(x, y).item()
    for micro in range(2):  # accumulation without sync, then with
        eager.set_requires_gradient_sync(micro == 1)
        eager(x[2 * micro: 2 * micro + 2].chunk(dp)[index], y[2 * micro: 2 * micro + 2].chunk(dp)[index]).backward()
    (reference(x[:2], y[:2]) / 1 + reference(x[2:], y[2:])).backward()
    grads = {n: p.grad.full_tensor() / 2 for n, p in eager.named_parameters()}  # 2 micro-batches, summed
    return {"meta": max((meta_sd[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "synced": max((synced_sd[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "sharded": max((sharded_sd[k].full_tensor() - v).abs().max().item()
                           for k, v in reference.state_dict().items()),
            "full_params": abs(inside - reference(x, y).item()),
            "accumulated": max((grads[n] - p.grad / 2).abs().max().item() for n, p in reference.named_parameters())}


def test_2d_models_initialize_from_meta_or_rank_0_show_full_params_and_accumulate(world4):
    for got in world4.run(views_job):
        assert got["meta"] == got["sharded"] == got["synced"] == 0.0, got  # deferred init: eager's values
        assert got["full_params"] <= LOSS_TOL, got
        assert got["accumulated"] <= 1e-6, got


def accumulation_job() -> dict:
    """bf16 compute, fp32 reduce_dtype, gradient sync off for all but the last micro-batch: the
    held gradients (sequence-parallel weights' summed over TP first) equal syncing each one."""
    mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    grads = {}
    for sync_each in (True, False):
        model, (dp, index) = build("2x2", mp_policy=mp)
        for micro in range(3):
            model.set_requires_gradient_sync(sync_each or micro == 2)
            x, y = tp_token_batch(torch.Generator().manual_seed(10 * micro + index), 2)
            model(x, y).backward()
        grads[sync_each] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"diff": max((grads[True][n] - grads[False][n]).abs().max().item() for n in grads[True]),
            "scale": max(g.abs().max().item() for g in grads[True].values())}


def test_2d_micro_batches_without_sync_accumulate_in_the_reduce_dtype(world4):
    for got in world4.run(accumulation_job):
        assert got["diff"] <= 1e-5 * got["scale"], got  # fp32 sums of the same bf16 gradients, regrouped


def refusals_job() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    model = tensor_parallel(TPLlama(), mesh["tp"])
    out["same dim"] = raises(lambda: fullshard.fully_shard(model.layers[0], mesh=mesh["tp"]))
    two_d = torch.nn.Linear(4, 4)
    two_d.weight = torch.nn.Parameter(distribute_tensor(two_d.weight.detach(), mesh, [Shard(0), Shard(1)]))
    out["2-D TP"] = raises(lambda: fullshard.fully_shard(two_d, mesh=mesh["dp"]))
    out["differ"] = raises(lambda: build("2x2", seed="dp"))
    sharded, _ = build("2x2")
    out["rank0_only"] = raises(lambda: fullshard.full_params(sharded, rank0_only=True, writeback=False).__enter__())
    return out


def test_what_2d_sharding_cannot_do_is_refused(world4):
    got = world4.run(refusals_job)[0]
    assert "not distinct dims of one mesh" in got["same dim"], got
    assert "1-D tensor parallelism" in got["2-D TP"], got
    assert "tensor-parallel model" in got["rank0_only"], got
    assert "ranks hold different values" in got["differ"], got  # compared within dp groups only


def tp_hang_job() -> dict:
    """Rank 0 asks for a full state dict of a TP-only model (dp 1 x tp 2) and rank 1 does not:
    DTensor's all-gather over the TP group, which takes no timeout of its own, gives up after
    the unit's and names itself; the TP group's own timeout is back as it was."""
    import time

    from fullshard.collectives import pg_timeout

    model, _ = build((1, 2))
    model.set_timeout(1.0)
    mesh = next(model.parameters()).device_mesh  # dp and tp
    group = mesh.get_group(mesh.ndim - 1)
    before = pg_timeout(group)
    if dist.get_rank() != 0:
        return {}
    start = time.perf_counter()
    message = raises(lambda: fullshard.get_state_dict(model))
    return {"message": message, "seconds": time.perf_counter() - start, "timeout back": pg_timeout(group) == before}


def test_dtensor_collectives_give_up_within_the_units_timeout_and_name_themselves(world2):
    got = world2.run_unmatched(tp_hang_job)[0]  # gloo closed the group's connections when its collective gave up
    assert "tensor-parallel collective of parameter" in got["message"] and "within 1 s" in got["message"], got
    assert got["seconds"] < 10 and got["timeout back"], got
