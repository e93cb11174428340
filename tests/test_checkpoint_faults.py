"""Checkpoints that cannot be written or do not fit: a full or read-only disk, another kind of
optimizer, no optimizer state, a gather in flight, an optimizer of the parameters before
sharding. Each ends as one FullShardError on every rank that says what happened and what
to do, with the model, the optimizer and the checkpoint on disk as they were (Note
[checkpoint phases])."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard.gpt import Block
from tests.models import tiny_gpt, token_batch
from tests.reference import full_state, max_diff
from tests.test_errors import raises
from tests.test_trust import optimizer_values, plain_copy, trained


def step(model, opt, seed: int) -> None:
    model(*token_batch(torch.Generator().manual_seed(seed + dist.get_rank()), 2)).backward()
    opt.step()
    opt.zero_grad()


def checkpoint_bytes_job(root: str) -> int:
    model, opt = trained()
    fullshard.save(root, model, opt, step=1)
    return sum(f.stat().st_size for f in fullshard.checkpoint_dir(root).iterdir())


def full_disk_job(root: str) -> dict:
    """Save once (it fits), train on, save again (it does not: both versions must coexist until
    the switch), then the disk made read-only; the first checkpoint stays LATEST and loads bitwise."""
    model, opt = trained()
    fullshard.save(root, model, opt, step=1)
    want, want_opt = full_state(model), optimizer_values(opt)
    step(model, opt, 7)
    start = time.perf_counter()
    out = {"full": raises(lambda: fullshard.save(root, model, opt, step=2)), "seconds": time.perf_counter() - start}
    handle = fullshard.save(root, model, opt, step=2, block=False)  # fails in the background: named at the wait
    out["full, background"] = raises(handle.result)
    dist.barrier()
    if dist.get_rank() == 0:
        subprocess.run(["mount", "-o", "remount,ro", root], check=True)
    dist.barrier()
    out["read-only"] = raises(lambda: fullshard.save(root, model, opt, step=3))
    fullshard.save(root, model, opt, step=3, block=False)  # its failure raises at the next save
    out["read-only, background"] = raises(lambda: fullshard.save(root, model, opt, step=4))
    out["loaded"] = fullshard.load(root, model, opt)
    out["params"] = max_diff(full_state(model), want)
    out["optim"] = max(abs(a - b).max().item() for a, b in zip(optimizer_values(opt), want_opt))
    out["versions"] = sorted(p.name.startswith("v-") for p in Path(root).iterdir())
    return out


@pytest.fixture
def small_disk(tmp_path, world2):
    """A tmpfs at tmp_path/disk with room for one checkpoint of `trained()` and not two."""
    one = world2.run(checkpoint_bytes_job, root=str(tmp_path / "probe"))[0]
    disk = tmp_path / "disk"
    disk.mkdir()
    size = -(-(one * 3 // 2) // 4096) * 4096 + 16 * 4096  # 1.5 checkpoints, and the small files' pages
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"a tmpfs cannot be mounted here ({mounted.stderr.strip() or 'mount failed'}): this test needs "
                    f"root in a mount namespace of its own")
    yield disk
    subprocess.run(["umount", str(disk)], check=False)


def test_a_full_or_read_only_disk_fails_every_rank_by_name_and_keeps_the_last_checkpoint(world2, small_disk):
    for got in world2.run(full_disk_job, root=str(small_disk)):
        assert "No space left on device" in got["full"] and "Free space on" in got["full"], got["full"]
        background = got["full, background"]  # which rank finds the disk full first varies
        assert "No space left on device" in background and "Free space on" in background, background
        assert "Read-only file system" in got["read-only"], got["read-only"]
        assert "Read-only file system" in got["read-only, background"], got["read-only, background"]
        assert "the previous checkpoint at" in got["full"] and "is unchanged" in got["read-only"]
        assert got["loaded"] == {"step": 1, "extra": None} and got["params"] == 0.0 and got["optim"] == 0.0
        assert got["versions"] == [False, True]  # LATEST and the one version: the failed saves left nothing
        print(f"disk full: named error after {got['seconds']:.2f} s: {got['full'][:160]}")  # docs/reliability.md


def misfit_job(root: str) -> dict:
    """Loads that do not fit the optimizer, or find a gather in flight, or saves of an optimizer
    built before sharding: each refused by name, with nothing changed."""
    model, opt = trained()
    root = Path(root)
    fullshard.save(root / "adamw", model, opt, step=1)
    fullshard.save(root / "model only", model, step=1)
    plain = root / f"plain-{dist.get_rank()}"
    plain_copy(fullshard.checkpoint_dir(root / "adamw"), plain)
    dist.barrier()
    step(model, opt, 3)
    before, before_opt = full_state(model), optimizer_values(opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"sgd": raises(lambda: fullshard.load(root / "adamw", model, sgd)),
           "sgd from plain DCP": raises(lambda: fullshard.load(plain, model, sgd)) if dist.get_world_size() == 1
           else None,
           "no optimizer state": raises(lambda: fullshard.load(root / "model only", model, opt))}
    if dist.get_world_size() > 1:  # one rank gathers nothing: its unshard is done at once
        handle = model.h[0].unshard(async_op=True)
        out["pending unshard"] = raises(lambda: fullshard.load(root / "adamw", model, opt))
        out["pending unshard save"] = raises(lambda: fullshard.save(root / "adamw", model, opt, step=9))
        handle.wait()
        model.reshard()
    out["changed"] = max_diff(full_state(model), before) + max(
        abs(a - b).max().item() for a, b in zip(optimizer_values(opt), before_opt))
    latest = (root / "adamw" / "LATEST").read_text()
    torch.manual_seed(0)
    plain_model = tiny_gpt()
    early = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)  # before sharding: it holds the old parameters
    fullshard.shard_model(plain_model, wrap={Block})
    out["early optimizer"] = raises(lambda: fullshard.save(root / "adamw", plain_model, early, step=9))
    out["LATEST kept"] = (root / "adamw" / "LATEST").read_text() == latest
    out["loads after"] = fullshard.load(root / "adamw", model, opt)["step"]
    step(model, opt, 4)  # and trains on: the refused load left no gather behind
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoints_that_do_not_fit_the_optimizer_or_the_moment_are_refused_by_name(request, tmp_path, world):
    for got in request.getfixturevalue(f"world{world}").run(misfit_job, root=str(tmp_path)):
        assert "holds the state of a AdamW optimizer, not of a SGD" in got["sgd"], got["sgd"]
        if world == 1:  # a plain DCP directory records no class: the missing keys tell
            assert "has no 'dampening', 'momentum', 'nesterov'" in got["sgd from plain DCP"], got["sgd from plain DCP"]
        assert "holds no optimizer state" in got["no optimizer state"] and "optimizer=None" in got["no optimizer state"]
        if world > 1:
            assert "unshard(async_op=True) in flight" in got["pending unshard"]
            assert "unshard(async_op=True) in flight" in got["pending unshard save"]
        assert "not the model's" in got["early optimizer"] and "built before shard_model" in got["early optimizer"]
        assert got["changed"] == 0.0 and got["LATEST kept"] and got["loads after"] == 1
