"""Hybrid sharding (shard inside groups, replicate across them) and smaller post-forward worlds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.gpt import GPT, Block, GPTConfig
from tests.models import SEQ, VOCAB, gpt_loss, hybrid_mesh, model_spec, tiny_gpt, token_batch
from tests.reference import (ADAMW_TOL, LOSS_TOL, assert_parity, full_state, global_batches, local_slice,
                             make_optimizer, max_diff, parity, train)
from tests.test_fully_shard import padded_numel
from tests.world import child_pythonpath, free_port, rank_env


def hybrid_job(model: str, optimizer: str) -> dict:
    factory, batch_fn, loss_fn, units = model_spec(model)
    torch.manual_seed(0)
    module = factory()
    result = parity(module, lambda m: fullshard.shard_model(m, wrap=units, strategy="hybrid_shard",
                                                            mesh=hybrid_mesh(2, 2)),
                    batch_fn, loss_fn, optimizer=optimizer)
    result["placements"] = {str(p.placements) for p in module.parameters()}
    return result


@pytest.mark.parametrize("model", ["gpt", "situations", "hf_llama"])
def test_hybrid_2x2_matches_single_process(world4, model):
    for optimizer in ("sgd", "adamw"):
        results = world4.run(hybrid_job, model=model, optimizer=optimizer)
        assert_parity(results, optimizer)
        # a 0-d parameter is replicated on both dims; every other one is sharded inside the group
        assert results[0]["placements"] - {"(Replicate(), Replicate())"} == {"(Replicate(), Shard(dim=0))"}


def equivalence_job(shape: tuple[int, int], strategy: str) -> float:
    """Hybrid over `shape` against `strategy` on the same training: the largest difference."""
    torch.manual_seed(0)
    hybrid, other = tiny_gpt(), tiny_gpt()
    other.load_state_dict(hybrid.state_dict())
    fullshard.shard_model(hybrid, wrap={Block}, strategy="hybrid_shard", mesh=hybrid_mesh(*shape))
    fullshard.shard_model(other, wrap={Block}, strategy=strategy)
    batches = global_batches(token_batch, 3, 8)
    loss = gpt_loss
    world = dist.get_world_size()
    a = train(hybrid, make_optimizer("adamw", hybrid), batches, loss, world=world)
    b = train(other, make_optimizer("adamw", other), batches, loss, world=world)
    return max(abs(x - y) for x, y in zip(a, b)) + max_diff(full_state(hybrid), full_state(other))


def test_hybrid_with_f_equal_n_is_full_shard_and_f_one_is_no_shard(world4):
    # the same collectives in the same order: bitwise equal
    assert world4.run(equivalence_job, shape=(1, 4), strategy="full_shard") == [0.0] * 4
    assert world4.run(equivalence_job, shape=(4, 1), strategy="no_shard") == [0.0] * 4


def pooled_job(strategy: str, shape: tuple[int, int] | None) -> int:
    """Buffers handed back to the buffer pool during a backward that still hold a gradient."""
    from fullshard.routes import BufferPool

    torch.manual_seed(0)
    model = tiny_gpt()
    mesh = hybrid_mesh(*shape) if shape else None
    fullshard.shard_model(model, wrap={Block}, strategy=strategy, **({"mesh": mesh} if mesh else {}))
    given, give = [], BufferPool.give

    def spy(self, buffer):
        given.append(buffer.untyped_storage().data_ptr())
        give(self, buffer)

    BufferPool.give = spy
    try:
        gpt_loss(model, local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())).backward()
    finally:
        BufferPool.give = give
    grads = {p.grad._local_tensor.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    return len(grads & set(given))


def test_no_buffer_goes_back_to_the_pool_while_it_is_a_gradient(world4):
    # no_shard and hybrid with one rank per shard group: the reduced row is the shard's own
    # buffer, which becomes the gradient; the pool must never hand it out again
    assert world4.run(pooled_job, strategy="no_shard", shape=None) == [0] * 4
    assert world4.run(pooled_job, strategy="hybrid_shard", shape=(4, 1)) == [0] * 4


def bytes_job() -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=2, n_embd=30))
    units = [list(b.parameters()) for b in model.h] + [[model.wte.weight, model.wpe.weight, *model.ln_f.parameters()]]
    fullshard.shard_model(model, wrap={Block}, strategy="hybrid_shard", mesh=hybrid_mesh(2, 2))
    batch = local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())
    model(*batch).backward()  # the first step records the order
    with fullshard.stats(model) as stats:
        model(*batch).backward()
    shard = [sum(padded_numel(p.shape, 2) for p in ps) for ps in units]  # elements per rank, F = 2
    rows = [n + len(ps) for n, ps in zip(shard, units)]  # + one has-gradient flag per parameter
    gathered = shard[:3] * 2 + shard[3:]  # blocks h.0-h.2 twice; h.3 (ran last) and the root once
    F, R = 2, 2
    return {
        "got": [stats.intra_group_bytes, stats.cross_group_bytes, stats.all_reduces],
        # inside the group: a gather sends (F-1) shards, a reduce-scatter (F-1) rows;
        # across: an all-reduce of this rank's row over R replicas sends 2 (R-1)/R of it
        "want": [4 * (F - 1) * (sum(gathered) + sum(rows)), 4 * 2 * (R - 1) * sum(rows) // R, 5],
    }


def test_bytes_per_group_follow_the_formulas(world4):
    for got in world4.run(bytes_job):
        assert got["got"] == got["want"]


def smaller_world_job() -> dict:
    """full_shard over 4 ranks, keeping 1/2 after forward: backward gathers inside pairs."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=2, n_embd=30))
    block = sum(padded_numel(p.shape, 4) for p in model.h[0].parameters())  # elements per rank, N = 4

    def shard(m):
        for b in m.h:
            fullshard.fully_shard(b, reshard_after_forward=2)
        fullshard.fully_shard(m)

    result = parity(model, shard, token_batch, gpt_loss)
    batch = local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())
    with fullshard.stats(model) as stats:
        model(*batch).backward()
    # h.0-h.2 gather twice: forward over 4 ranks ((N-1) shards), backward inside a pair
    # from 2-shard blocks ((k-1) x 2 shards); h.3 (ran last) once over 4. Root excluded.
    root = stats.gather_bytes - 4 * (3 * 3 * block + 3 * 1 * 2 * block + 3 * block)
    result["root_gather"] = root
    result["root_want"] = 4 * 3 * sum(padded_numel(p.shape, 4) for p in [model.wte.weight, model.wpe.weight,
                                                                 *model.ln_f.parameters()])
    return result


def test_reshard_after_forward_to_a_smaller_world(world4):
    results = world4.run(smaller_world_job)
    assert_parity(results, "adamw")
    for got in results:
        assert got["root_gather"] == got["root_want"]


def accumulation_job(mode: str) -> dict:
    """4 micro-batches at 2x2 against one process on the whole batch."""
    torch.manual_seed(0)
    model = tiny_gpt()
    reference = tiny_gpt()
    reference.load_state_dict(model.state_dict())
    fullshard.shard_model(model, wrap={Block}, strategy="hybrid_shard", mesh=hybrid_mesh(2, 2))
    opt, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = []
    for step, big in enumerate(global_batches(token_batch, 2, 32)):
        with fullshard.stats(model) as stats:
            for k in range(4):
                last = k == 3
                if mode == "no_all_reduce" and last and step == 1:
                    model.set_requires_gradient_sync(True)  # as FSDP2's, it turns the all-reduce back on too
                elif mode == "no_all_reduce":
                    model.set_requires_all_reduce(last)
                elif mode == "no_sync":
                    model.set_requires_gradient_sync(last)
                part = tuple(t.chunk(4)[k] for t in big)
                (model(*local_slice(part, rank, world)) / 4).backward()
        counts.append((stats.reduce_scatters, stats.all_reduces))
        opt.step()
        opt.zero_grad()
        reference(*big).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param": max_diff(full_state(model), full_state(reference)), "counts": counts}


@pytest.mark.parametrize("mode", ["no_all_reduce", "no_sync"])
def test_accumulation_without_cross_group_traffic(world4, mode):
    for got in world4.run(accumulation_job, mode=mode):
        assert got["param"] <= ADAMW_TOL
        # 3 units: set_requires_all_reduce(False) keeps every reduce-scatter inside the
        # group and all-reduces once per step; no_sync reduces only the last micro-batch
        want = (4 * 3, 3) if mode == "no_all_reduce" else (3, 3)
        assert got["counts"] == [want, want]


def test_two_nodes_of_two_ranks_shard_inside_each_node(tmp_path):
    """Two torchrun launches on this machine, node ranks 0 and 1, meeting on 127.0.0.1."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": child_pythonpath(),
           **{k: v for k, v in rank_env(0, 4, port).items() if k in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}}
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={port}", str(Path(__file__).with_name("multinode_job.py")),
         str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [launch.communicate(timeout=180)[0] for launch in launches]
    assert all(launch.returncode == 0 for launch in launches), "\n".join(o[-3000:] for o in outputs)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for report in reports:
        node_ranks = [r for r in range(4) if reports[r]["node"] == report["node"]]
        assert report["shard_group"] == node_ranks  # parameters are sharded inside the node
        assert len(report["replicate_group"]) == 2 and report["replicate_group"] != node_ranks
        assert report["loss"] <= LOSS_TOL and report["param"] <= ADAMW_TOL
