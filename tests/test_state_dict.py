"""State dicts and checkpoints: round trips, any world size and strategy, atomic saves, interop."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fullshard
from tests.models import gpt_loss, hybrid_mesh, model_spec, tiny_gpt, token_batch
from tests.reference import full_state, global_batches, make_optimizer, max_diff, train
from tests.test_errors import raises
from tests.world import JOB_TIMEOUT_S, World, child_pythonpath


def sharded(strategy: str = "full_shard", seed: int = 0, model: str = "gpt"):
    factory, _, _, units = model_spec(model)
    torch.manual_seed(seed)
    module = factory()
    mesh = hybrid_mesh(2, 2) if strategy == "hybrid_shard" else None
    fullshard.shard_model(module, wrap=units, strategy=strategy, mesh=mesh)
    return module, make_optimizer("adamw", module)


def step_on(model, optimizer, batches) -> list[float]:
    return train(model, optimizer, batches, gpt_loss, world=dist.get_world_size())


def optimizer_values(model, optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor by name, full (all ranks must call)."""
    _, optim_sd = fullshard.get_state_dict(model, optimizer, full=True)
    return {f"{name}.{key}": value for name, values in optim_sd["state"].items() for key, value in values.items()}


def round_trip_job(full: bool) -> dict:
    """Trained state into a differently-initialized model, then both keep training."""
    batches = global_batches(token_batch, 4, 8)
    model, opt = sharded(seed=0)
    step_on(model, opt, batches[:2])
    model_sd, optim_sd = fullshard.get_state_dict(model, opt, full=full)
    other, other_opt = sharded(seed=1)
    fullshard.set_state_dict(other, other_opt, model_sd=model_sd, optim_sd=optim_sd, full=full)
    equal = max_diff(full_state(other), full_state(model)) + max_diff(optimizer_values(other, other_opt),
                                                                     optimizer_values(model, opt))
    a, b = step_on(model, opt, batches[2:]), step_on(other, other_opt, batches[2:])
    plain = tiny_gpt()
    return {"equal": equal, "resumed": max(abs(x - y) for x, y in zip(a, b)) + max_diff(full_state(model),
                                                                                         full_state(other)),
            "keys": list(model_sd) == list(plain.state_dict()),
            "types": {type(v).__name__ for v in model_sd.values()}, "devices": {v.device.type for v in model_sd.values()}}


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_state_dict_round_trip(request, world, full):
    for got in request.getfixturevalue(f"world{world}").run(round_trip_job, full=full):
        assert got["equal"] == 0.0 and got["resumed"] == 0.0  # copies of the same bits
        assert got["keys"]  # the unwrapped model's names, in its order
        assert got["types"] == ({"Tensor"} if full else {"DTensor"})
        assert got["devices"] == {"cpu"}


def rank0_only_job() -> list[int]:
    model, opt = sharded()
    step_on(model, opt, global_batches(token_batch, 1, 8))
    model_sd, optim_sd = fullshard.get_state_dict(model, opt, rank0_only=True)
    return [len(model_sd), len(optim_sd)]


def test_rank0_only(world2):
    assert world2.run(rank0_only_job) == [[len(tiny_gpt().state_dict()), 2], [0, 0]]


def save_job(path: str, strategy: str, model: str = "gpt") -> dict:
    """Train 2 steps, save, and return what was saved (full, for comparison)."""
    module, opt = sharded(strategy, model=model)
    step_on(module, opt, global_batches(model_spec(model)[1], 2, 8))
    fullshard.save(path, module, opt, step=2, extra={"note": "two steps", "lr": [3e-4]})
    return {"params": full_state(module), "optim": optimizer_values(module, opt)}


def load_job(path: str, strategy: str, want: dict, model: str = "gpt") -> dict:
    module, opt = sharded(strategy, seed=1, model=model)
    meta = fullshard.load(path, module, opt)
    return {"meta": meta, "params": max_diff(full_state(module), want["params"]),
            "optim": max_diff(optimizer_values(module, opt), want["optim"])}


@pytest.mark.parametrize("model", ["gpt", "situations"])
def test_save_at_two_load_at_one_and_four(world1, world2, world4, tmp_path, model):
    path = str(tmp_path / "ckpt")
    want = world2.run(save_job, path=path, strategy="full_shard", model=model)[0]
    for pool in (world1, world4):
        for got in pool.run(load_job, path=path, strategy="full_shard", want=want, model=model):
            assert got == {"meta": {"step": 2, "extra": {"note": "two steps", "lr": [3e-4]}}, "params": 0.0, "optim": 0.0}


@pytest.mark.parametrize("saved, loaded", [("hybrid_shard", "full_shard"), ("full_shard", "hybrid_shard"),
                                           ("shard_grad_op", "no_shard"), ("no_shard", "full_shard")])
def test_any_strategy_loads_any_other(world4, tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    want = world4.run(save_job, path=path, strategy=saved)[0]
    for got in world4.run(load_job, path=path, strategy=loaded, want=want):
        assert got["params"] == 0.0 and got["optim"] == 0.0


def resume_job(path: str) -> float:
    """4 steps in one go against 2 steps, save, a fresh model and optimizer, load, 2 more."""
    batches = global_batches(token_batch, 4, 8)
    model, opt = sharded()
    straight = step_on(model, opt, batches)
    first, first_opt = sharded(seed=0)  # the same start as `model`
    resumed = step_on(first, first_opt, batches[:2])
    fullshard.save(path, first, first_opt, step=2)
    second, second_opt = sharded(seed=3)
    assert fullshard.load(path, second, second_opt)["step"] == 2
    resumed += step_on(second, second_opt, batches[2:])
    return max(abs(a - b) for a, b in zip(straight, resumed)) + max_diff(full_state(model), full_state(second))


def test_resume_is_exact(world2, tmp_path):
    assert world2.run(resume_job, path=str(tmp_path / "ckpt")) == [0.0, 0.0]


def read_job(path: str) -> dict:
    model, _ = sharded()
    meta = fullshard.load(path, model)
    values = {p.to_local().unique().tolist().__repr__() for p in model.parameters() if p.to_local().numel()}
    return {"meta": meta, "values": values}


def save_steps_job(path: str, ready: str, first: int, last: int, block: bool = True) -> None:
    """Save a checkpoint for each step from `first` to `last` of a model whose every parameter
    equals the step; an empty file ready/rank<N> says the first is complete. In the background
    (block=False) each save is followed by parameters of step + 0.5 while it writes: the
    checkpoint must hold the step's values."""
    model = fullshard.shard_model(tiny_gpt())
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(first, last + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float(step))
        handle = fullshard.save(path, model, optimizer, step=step, extra={"step": step}, block=block)
        if not block:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().fill_(step + 0.5)
        if step == first:
            if handle is not None:
                handle.result()
            Path(ready, f"rank{dist.get_rank()}").touch()


@pytest.mark.parametrize("block", [True, False], ids=["blocking", "background"])
def test_a_killed_save_leaves_the_previous_checkpoint_readable(world1, world2, tmp_path, block):
    """SIGKILL a rank at a random moment of a run of saves, several times (in the background:
    mostly while the thread writes, since the loop only stages); every time the checkpoint at
    the path is a complete one whose parameters all equal its step."""
    path = str(tmp_path / "ckpt")
    (tmp_path / "ready0").mkdir()
    world2.run(save_steps_job, path=path, ready=str(tmp_path / "ready0"), first=0, last=0)
    rng = random.Random(0)
    with World(2, forked=True) as savers:  # replaced after every kill
        for trial in range(1, 5):
            ready = tmp_path / f"ready{trial}"
            ready.mkdir()
            savers.submit(save_steps_job, path=path, ready=str(ready), first=100 * trial, last=100 * trial + 1000,
                          block=block)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while len(list(ready.iterdir())) < 2:
                assert savers.results.empty(), "a rank failed before its first save"
                assert time.monotonic() < deadline, "the first save of the trial did not complete"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.1, 0.5))  # the ranks spend this time saving, again and again
            os.kill(savers.procs[rng.randrange(2)].pid, signal.SIGKILL)
            savers.restart()  # the other rank may be waiting for the dead one in a collective
            got = world1.run(read_job, path=path)[0]
            step = got["meta"]["step"]
            assert got["meta"]["extra"] == {"step": step}
            assert got["values"] == {repr([float(step)])}, (trial, step, got["values"])
            assert step >= 100 * trial  # never older than a save that had returned


def torch_side_job(path: str, direction: str) -> dict:
    """PyTorch's own FSDP2 + torch.distributed.checkpoint on one side, fullshard on the other."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    batches = global_batches(token_batch, 3, 8)
    torch.manual_seed(7)
    theirs = tiny_gpt()
    for block in theirs.h:
        fully_shard(block)
    fully_shard(theirs)
    their_opt = make_optimizer("adamw", theirs)
    ours, our_opt = sharded(seed=0)
    if direction == "fullshard->torch":
        step_on(ours, our_opt, batches[:2])
        fullshard.save(path, ours, our_opt, step=2)
        model_sd, optim_sd = get_state_dict(theirs, their_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=fullshard.checkpoint_dir(path))
        set_state_dict(theirs, their_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        step_on(theirs, their_opt, batches[:2])
        model_sd, optim_sd = get_state_dict(theirs, their_opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        fullshard.load(path, ours, our_opt)
    same = max_diff(full_state(ours), full_state(theirs))
    a, b = step_on(ours, our_opt, batches[2:]), step_on(theirs, their_opt, batches[2:])
    return {"same": same, "next": abs(a[0] - b[0]) + max_diff(full_state(ours), full_state(theirs))}


@pytest.mark.parametrize("direction", ["fullshard->torch", "torch->fullshard"])
def test_interop_with_torch_fsdp2_and_dcp(world2, tmp_path, direction):
    for got in world2.run(torch_side_job, path=str(tmp_path / "ckpt"), direction=direction):
        assert got["same"] == 0.0
        assert got["next"] == 0.0  # optimizer state came across too: the next step agrees to the bit


def export_job(path: str, outputs: str) -> None:
    factory, batch_fn, loss_fn, units = model_spec("hf_gpt2")
    torch.manual_seed(0)
    model = factory()
    fullshard.shard_model(model, wrap=units)
    opt = make_optimizer("adamw", model)
    train(model, opt, global_batches(batch_fn, 2, 8), loss_fn, world=dist.get_world_size())
    fullshard.export(model, path)
    x = global_batches(batch_fn, 1, 4, seed=9)[0][0]
    with torch.no_grad():
        logits = model(input_ids=x).logits
    if dist.get_rank() == 0:
        torch.save({"x": x, "logits": logits}, outputs)


PLAIN_LOAD = """
import sys, torch
torch.set_num_threads(1)  # as the ranks that computed the saved logits: the same kernels, so bitwise the same
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=8, n_embd=24, n_layer=2, n_head=2,  # tests.models.hf_gpt2
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
model.load_state_dict(load_file(sys.argv[1]), strict=True)
saved = torch.load(sys.argv[2])
with torch.no_grad():
    diff = (model(input_ids=saved["x"]).logits - saved["logits"]).abs().max().item()
assert not any(name.startswith("fullshard") for name in sys.modules), "fullshard was imported"
print(diff)
"""


def test_safetensors_export_loads_without_fullshard(world2, tmp_path):
    weights, outputs = tmp_path / "model.safetensors", tmp_path / "outputs.pt"
    world2.run(export_job, path=str(weights), outputs=str(outputs))
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    done = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(weights), str(outputs)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) == 0.0  # the same weights compute the same logits


def errors_job(path: str) -> dict[str, str]:
    model, opt = sharded()
    fullshard.save(path, model, opt, step=1)
    from fullshard.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    other = fullshard.shard_model(GPT(GPTConfig(block_size=8, vocab_size=61, n_layer=3, n_head=2, n_embd=32)))
    out = {"mismatch": raises(lambda: fullshard.load(path, other)),
           "not a checkpoint": raises(lambda: fullshard.load(os.path.dirname(path), model)),
           "extra": raises(lambda: fullshard.save(path, model, extra={"fn": print}))}
    dist.barrier()
    if dist.get_rank() == 0:
        latest = Path(path, Path(path, "LATEST").read_text())
        (latest / "COMPLETE").unlink()
    dist.barrier()
    out["incomplete"] = raises(lambda: fullshard.load(path, model))
    return out


def test_checkpoint_errors_are_clear(world2, tmp_path):
    for got in world2.run(errors_job, path=str(tmp_path / "ckpt")):
        assert "missing: ['h.2." in got["mismatch"] and "wrong shape" in got["mismatch"]
        assert "h.0.ln_1.weight: checkpoint (30,), model (32,)" in got["mismatch"]
        assert "not a checkpoint" in got["not a checkpoint"]
        assert "JSON-serializable" in got["extra"]
        assert "incomplete" in got["incomplete"]
