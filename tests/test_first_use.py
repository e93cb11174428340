"""What users do first, porting from DDP, nanoGPT or Hugging Face: it works like the
unsharded model, or fails at once, on every rank, with a FullShardError that says the fix."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.gpt import Block
from tests.models import SEQ, VOCAB, hf_llama, tiny_gpt, token_batch
from tests.reference import full_state, max_diff
from tests.test_errors import raises
from tests.world import free_port, rank_env


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(torch.Generator().manual_seed(seed), 4)


def sharded_gpt(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = tiny_gpt()
    fullshard.shard_model(model, wrap={Block}, **kwargs)
    return model


def torch_save_job() -> float:
    """torch.save(model.state_dict()) of a sharded model, torch.load and load_state_dict
    bring back the saved values (every parameter but the first of a unit lies at a nonzero
    offset of nothing: each shard is a tensor of its own)."""
    model = sharded_gpt()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    saved = full_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(*batch()).backward()
    opt.step()
    assert max_diff(full_state(model), saved) > 1e-3  # the step moved the parameters
    buf.seek(0)
    model.load_state_dict(torch.load(buf, weights_only=False))  # DTensors: their mesh is not a plain type
    return max_diff(full_state(model), saved)


def test_torch_save_and_load_of_the_state_dict_round_trip(world2):
    assert world2.run(torch_save_job) == [0.0, 0.0]


def seeds_job() -> dict:
    out = {}
    torch.manual_seed(dist.get_rank())  # nanoGPT's seed_offset: each rank builds another model
    model = tiny_gpt()
    out["fully_shard"] = raises(lambda: fullshard.fully_shard(model))
    out["untouched"] = not isinstance(model, fullshard.FSDPModule)
    fullshard.shard_model(model, wrap={Block}, sync_module_states=True)  # the fix the message names
    out["synced"] = full_state(model)["wte.weight"].sum().item()
    torch.manual_seed(dist.get_rank())
    with torch.device("meta"):
        deferred = tiny_gpt()
    out["meta"] = raises(lambda: fullshard.shard_model(deferred, wrap={Block}))
    return out


def test_ranks_that_built_different_values_are_refused(world2):
    results = world2.run(seeds_job)
    for got in results:
        assert "different values" in got["fully_shard"] and "sync_module_states=True" in got["fully_shard"]
        assert "'wte.weight'" in got["fully_shard"] and got["untouched"]
        assert "different values" in got["meta"]
    assert results[0]["synced"] == results[1]["synced"]


def optimizer_job() -> dict:
    out = {}
    torch.manual_seed(0)
    model = tiny_gpt()
    early = torch.optim.AdamW(model.parameters())  # built before sharding
    fullshard.shard_model(model, wrap={Block})
    model(*batch()).backward()
    before = full_state(model)
    out["before sharding"] = raises(early.step)
    out["unchanged"] = max_diff(full_state(model), before)
    torch.manual_seed(0)
    rootless = tiny_gpt()
    for block in rootless.h:  # the root forgotten: wte, wpe, ln_f stay plain on every rank
        fullshard.fully_shard(block)
    opt = torch.optim.AdamW(rootless.parameters())
    rootless(*batch(dist.get_rank())).backward()
    out["no root"] = raises(opt.step)
    return out


def test_an_optimizer_that_would_not_train_the_sharded_model_is_refused(world2):
    for got in world2.run(optimizer_job):
        assert "after shard_model / fully_shard" in got["before sharding"] and got["unchanged"] == 0.0
        assert "no unit manages" in got["no root"] and "fully_shard on the root" in got["no root"]
        assert f"({VOCAB}, 30)" in got["no root"]  # the embedding, named by its shape


def grad_sync_job() -> dict:
    """nanoGPT's accumulation: require_backward_grad_sync off for all but the last micro-batch."""
    ddp_style, reference = sharded_gpt(), sharded_gpt()
    counts = []
    for micro in range(2):
        ddp_style.require_backward_grad_sync = micro == 1
        with fullshard.stats(ddp_style) as s:
            ddp_style(*batch(micro)).backward()
        counts.append(s.reduce_scatters)
    with fullshard.no_sync(reference):
        reference(*batch(0)).backward()
    reference(*batch(1)).backward()
    grads = {n: p.grad.full_tensor() for n, p in ddp_style.named_parameters()}
    diff = max((grads[n] - p.grad.full_tensor()).abs().max().item() for n, p in reference.named_parameters())
    return {"counts": counts, "diff": diff, "flag": ddp_style.require_backward_grad_sync}


def test_require_backward_grad_sync_is_honoured(world2):
    for got in world2.run(grad_sync_job):
        assert got["counts"] == [0, 3]  # 2 blocks and the root reduce once, at the last micro-batch
        assert got["diff"] == 0.0 and got["flag"] is True


def replaced_job() -> dict:
    model = sharded_gpt()
    model(*batch())  # a forward before the change, as training would have run
    model.wpe.weight = nn.Parameter(torch.zeros(SEQ // 2, 30))  # nanoGPT's crop_block_size after sharding
    x, y = batch()
    return {"replaced": raises(lambda: model(x[:, : SEQ // 2], y[:, : SEQ // 2]))}


def test_a_parameter_replaced_after_sharding_is_refused(world2):
    for got in world2.run(replaced_job):
        assert "'wpe.weight'" in got["replaced"] and "replaced after sharding" in got["replaced"]


def top_down_job() -> str:
    torch.manual_seed(0)
    model = tiny_gpt()
    fullshard.fully_shard(model)
    return raises(lambda: fullshard.fully_shard(model.h[0]))


def test_top_down_sharding_says_bottom_up(world2):
    for got in world2.run(top_down_job):
        assert "bottom-up" in got and "the root last" in got


def rank0_eval_job() -> dict:
    """nanoGPT's `if master_process: estimate_loss()` before the first step, twice (a notebook
    that caught the first error and ran the cell again)."""
    model = sharded_gpt()
    start = time.perf_counter()
    errors = []
    for _ in range(2):
        if dist.get_rank() == 0:
            with torch.no_grad():
                errors.append(raises(lambda: model(*batch())))
        else:
            errors.append(raises(lambda: model(*batch()).backward()))
    return {"errors": errors, "seconds": time.perf_counter() - start}


def full_params_eval_job() -> dict:
    """The fix the messages name: rank 0 evaluates alone inside full_params(rank0_only=True)."""
    torch.manual_seed(0)
    plain = tiny_gpt()
    model = copy.deepcopy(plain)
    fullshard.shard_model(model, wrap={Block})
    with fullshard.stats(model) as s, fullshard.full_params(model, rank0_only=True, writeback=False):
        if dist.get_rank() == 0:
            with torch.no_grad():
                got = (model(*batch()) - plain(*batch())).abs().item()
        else:
            got = raises(lambda: model(*batch()))
        gathers = s.gathers
    model(*batch()).backward()  # training goes on: no collective was left half-done
    return {"got": got, "gathers": gathers}


def test_evaluating_on_rank_0_alone_fails_at_once_and_full_params_is_the_way(world2):
    results = world2.run(rank0_eval_job)
    for got in results:
        for error in got["errors"]:
            assert "first forward differently" in error and "rank0_only=True" in error
        assert got["seconds"] < 10  # not after the 300 s timeout
    results = world2.run(full_params_eval_job)
    assert results[0]["got"] == 0.0 and "rank other than 0" in results[1]["got"]
    assert results[0]["gathers"] == results[1]["gathers"] == 0  # no unit gathered for the evaluation
    world2.run(dist.barrier)  # the world is whole


def diverging_job(evaluate: bool) -> str:
    """With debug checks, ranks that part (rank 1 skips a block, or rank 0 evaluates while rank 1
    trains) all raise, naming what each was about to do, and leave nothing in flight."""
    model = sharded_gpt()
    model.set_debug_checks(True)
    model(*batch()).backward()
    if dist.get_rank() == 1 and not evaluate:
        model.h = nn.ModuleList([model.h[0]])
    if dist.get_rank() == 0 and evaluate:
        with torch.no_grad():
            return raises(lambda: model(*batch()))
    return raises(lambda: model(*batch()).backward())


def test_debug_checks_name_ranks_that_part_and_leave_nothing_in_flight(world2):
    for got in world2.run(diverging_job, evaluate=False):
        assert "ranks disagree on the next collective" in got and "'h.1'" in got
    for got in world2.run(diverging_job, evaluate=True):
        assert "without gradients" in got
    world2.run(dist.barrier)  # every rank came back and the group still works


def torch_optim_dict_job() -> dict:
    model = sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    model(*batch()).backward()
    opt.step()
    sd = opt.state_dict()  # torch's layout: parameters by position
    model_sd, _ = fullshard.get_state_dict(model)
    out = {"error": raises(lambda: fullshard.set_state_dict(model, opt, model_sd=model_sd, optim_sd=sd))}
    names = [n for n, _ in model.named_parameters()]  # the conversion the message gives
    converted = {"state": {names[i]: s for i, s in sd["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}
    fullshard.set_state_dict(model, opt, model_sd=model_sd, optim_sd=converted)
    return out


def test_a_torch_layout_optimizer_dict_is_refused_with_the_conversion(world2):
    for got in world2.run(torch_optim_dict_job):
        assert "by position" in got["error"] and "named_parameters" in got["error"]


def full_params_forward_job() -> dict:
    """Inside full_params a forward computes with the fp32 masters, not the bf16 compute copy,
    and gathers nothing: generation there runs like the unsharded model."""
    torch.manual_seed(0)
    plain = hf_llama()
    model = copy.deepcopy(plain)
    fullshard.shard_model(model, wrap={type(model.model.layers[0])},
                          mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    prompt = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with fullshard.stats(model) as s, fullshard.full_params(model, writeback=False):
            logits = model(prompt).logits
            tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
            gathers = s.gathers
        want = plain(prompt).logits
        want_tokens = plain.generate(prompt, max_new_tokens=6, do_sample=False)
        bf16 = model(prompt).logits  # outside: the bf16 compute copy
    return {"diff": (logits - want).abs().max().item(), "dtype": str(logits.dtype), "gathers": gathers,
            "tokens": torch.equal(tokens, want_tokens), "bf16": (bf16.float() - want).abs().max().item()}


def test_a_forward_inside_full_params_is_the_unsharded_fp32_model(world2):
    for got in world2.run(full_params_forward_job):
        assert got["diff"] == 0.0 and got["dtype"] == "torch.float32" and got["tokens"]
        assert got["gathers"] == 0  # no unit gathers, for any token
        assert got["bf16"] > 1e-4  # the check can tell bf16 compute from fp32


STUCK_PEER = """
import os, sys, time, torch, torch.distributed as dist, fullshard
from tests.models import tiny_gpt, token_batch
dist.init_process_group("gloo")
torch.manual_seed(0)
model = fullshard.shard_model(tiny_gpt(), wrap={type(tiny_gpt().h[0])})
if dist.get_rank() == 1:
    time.sleep(300)  # stuck, as a stopped rank or one waiting in another collective
model.set_timeout(1)
model(*token_batch(torch.Generator().manual_seed(0), 2)).backward()
"""


def test_a_rank_whose_collective_timed_out_exits_while_its_peer_is_stuck():
    """The raising rank's exit must not wait for its unfinished collective (gloo's group
    destructor would, for the group's 30-minute timeout), nor for the stuck peer."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", STUCK_PEER], stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **rank_env(rank, 2, int(port))}) for rank in range(2)]
    try:
        _, err = procs[0].communicate(timeout=120)  # seconds: imports on busy cores, then the 1 s timeout
        assert procs[0].returncode == 1 and "FullShardError" in err and "did not finish" in err, err[-2000:]
        assert procs[1].poll() is None  # rank 0 did not wait for its peer
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
