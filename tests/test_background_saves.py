"""Saves written in the background (save(block=False), Note [background saves]): what is saved
is the state at the call, whatever training does meanwhile; the next save, a load and the
interpreter's exit wait for the write; bad input is refused at the call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fullshard
from tests.models import token_batch
from tests.reference import full_state, global_batches, max_diff
from tests.test_errors import raises
from tests.test_state_dict import optimizer_values, sharded, step_on
from tests.world import child_pythonpath


def save_then_train_job(path: str) -> dict:
    """2 steps, a background save, 2 more steps while it writes, then a fresh model loads it:
    the values at the save, bitwise; trained on, it follows the straight run bitwise."""
    batches = global_batches(token_batch, 4, 8)
    straight, straight_opt = sharded(seed=0)
    want_losses = step_on(straight, straight_opt, batches)
    model, opt = sharded(seed=0)
    step_on(model, opt, batches[:2])
    at_save = full_state(model)
    opt_at_save = {key: value.clone() for key, value in optimizer_values(model, opt).items()}  # `step` is live
    handle = fullshard.save(path, model, opt, step=2, extra={"lr": [1e-3]}, block=False)
    step_on(model, opt, batches[2:])  # changes every parameter and every optimizer state while it writes
    handle.result()
    handle.result()  # again: nothing more to wait for, nothing raised
    fresh, fresh_opt = sharded(seed=5)
    meta = fullshard.load(path, fresh, fresh_opt)
    out = {"meta": meta, "params": max_diff(full_state(fresh), at_save),
           "optim": max_diff(optimizer_values(fresh, fresh_opt), opt_at_save),
           "moved on": max_diff(full_state(model), at_save)}
    losses = step_on(fresh, fresh_opt, batches[2:])
    out["resumed"] = max(abs(a - b) for a, b in zip(losses, want_losses[2:])) + max_diff(full_state(fresh),
                                                                                       full_state(straight))
    # saves back to back: each waits for the one before (nothing explicit in between)
    for step in (3, 4):
        last = fullshard.save(path, model, opt, step=step, block=False)
    out["last"] = fullshard.load(path, fresh, fresh_opt)["step"]  # waits for step 4's
    out["last done"] = last.done()
    # an export agrees over the checkpoints' group too: it waits for the save in flight
    writing = fullshard.save(path, model, opt, step=5, block=False)
    fullshard.export(model, Path(path).parent / "model.safetensors")
    out["exported after the save"] = writing.done() and (Path(path).parent / "model.safetensors").is_file()
    # under inference_mode (an evaluation loop), then outside it: the same staging buffers serve both
    with torch.inference_mode():
        fullshard.save(path, model, opt, step=6, block=False).result()
    fullshard.save(path, model, opt, step=7, block=False).result()
    out["after inference mode"] = fullshard.load(path, fresh, fresh_opt)["step"]
    out["bad block"] = raises(lambda: fullshard.save(path, model, opt, step=5, block="no"))
    return out


def test_a_background_save_saves_the_state_at_the_call(world2, tmp_path):
    for got in world2.run(save_then_train_job, path=str(tmp_path / "ckpt")):
        assert got["meta"] == {"step": 2, "extra": {"lr": [1e-3]}}
        assert got["params"] == 0.0 and got["optim"] == 0.0, got  # bitwise the state at the save
        assert got["moved on"] > 0.0  # training did change the model while the save wrote
        assert got["resumed"] == 0.0
        assert got["last"] == 4 and got["last done"] and got["exported after the save"]
        assert got["after inference mode"] == 7
        assert "save(block='no') must be True or False" in got["bad block"], got["bad block"]


EXITING = """
    import sys
    import torch, torch.distributed as dist
    import fullshard
    from fullshard.gpt import GPT, Block, GPTConfig

    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    torch.manual_seed(0)
    model = fullshard.shard_model(GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)),
                                  wrap={Block})
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(7.0)
    fullshard.save(sys.argv[1], model, step=7, block=False)
    with torch.no_grad():  # and on, while it writes
        for p in model.parameters():
            p.to_local().fill_(8.0)
"""


def read_exit_job(path: str) -> dict:
    from fullshard.gpt import GPT, Block, GPTConfig

    model = fullshard.shard_model(GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)),
                                  wrap={Block})
    meta = fullshard.load(path, model)
    return {"meta": meta, "values": sorted({v for p in model.parameters() for v in p.full_tensor().unique().tolist()})}


def test_a_script_that_ends_during_a_background_save_writes_it_first(world1, tmp_path):
    path = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXITING), str(path), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": child_pythonpath()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(path, "LATEST").is_file()
    got = world1.run(read_exit_job, path=str(path))[0]
    assert got == {"meta": {"step": 7, "extra": None}, "values": [7.0]}


def test_a_script_whose_last_background_save_fails_at_exit_exits_with_1(tmp_path):
    disk = tmp_path / "disk"  # a tmpfs smaller than the checkpoint: the write fails in the thread
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"a tmpfs cannot be mounted here ({mounted.stderr.strip() or 'mount failed'}): this test needs "
                    f"root in a mount namespace of its own")
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXITING), str(disk / "ckpt"),
                               str(tmp_path / "store")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": child_pythonpath()})
        latest = Path(disk, "ckpt", "LATEST").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "fullshard: " in done.stderr and "No space left on device" in done.stderr, done.stderr[-2000:]
    assert not latest


DESTROYING = """
    import sys, threading
    import torch, torch.distributed as dist
    import fullshard
    from fullshard.checkpoint import background
    from fullshard.gpt import GPT, Block, GPTConfig

    rank = int(sys.argv[3])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    torch.manual_seed(0)
    model = fullshard.shard_model(GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)),
                                  wrap={Block})
    start, gone = background.start, threading.Event()  # the writer waits until the groups are gone
    background.start = lambda what, write: start(what, lambda: (gone.wait(60), write()))
    handle = fullshard.save(sys.argv[1], model, step=1, block=False)
    dist.destroy_process_group()
    gone.set()
    try:
        handle.result()
        print("saved")
    except fullshard.FullShardError as e:
        print("refused:", e)
"""


def test_destroying_the_process_groups_during_a_background_save_fails_it_by_name(tmp_path):
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(DESTROYING), str(tmp_path / "ckpt"),
                               str(tmp_path / "store"), str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [rank.communicate(timeout=120) for rank in ranks]
    for (out, err), rank in zip(outs, ranks):
        assert rank.returncode in (0, 1), err[-2000:]  # 1: the failed save reported again at exit
        assert "refused:" in out and "destroy_process_group" in out and "handle.result()" in out, (out, err[-2000:])
    assert not (tmp_path / "ckpt" / "LATEST").exists()  # nothing half-written became the checkpoint
