"""Trust in the library's promises under attack and failure: no code runs from a checkpoint,
a failed load changes nothing, every wait has a deadline, nothing is left behind."""

from __future__ import annotations

import importlib
import os
import pathlib
import pickle
import shutil
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


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A sharded GPT and its AdamW after one step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = fullshard.shard_model(tiny_gpt(), wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(*token_batch(torch.Generator().manual_seed(seed + dist.get_rank()), 2)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def optimizer_values(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of every optimizer state tensor, full."""
    return [v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v.clone()
            for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# ---- no code runs from a checkpoint --------------------------------------------------------


def command(marker: Path) -> str:
    return f"touch {marker}"


class Planted:
    """An object whose unpickling would run a command (the classic __reduce__ payload)."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


# what the unpickler of the previous version admitted, (module, name), and what each BUILD
# payload below tries to plant on it
OLD_ALLOWLIST = [
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "Path"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("torch", "float32"),  # every dtype was admitted; one stands for them
]


def payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that would run `touch marker` if the unpickler let them, one per trick, from
    every module the unpickler admits names of."""
    cmd = command(marker)
    out = {}
    for module in sorted({module for module, _ in OLD_ALLOWLIST}):
        for name in ("os.system", "os", "sys", "__builtins__.exec"):
            # STACK_GLOBAL with a dotted name (protocol 4 resolves it attribute by attribute)
            out[f"STACK_GLOBAL {module}:{name}"] = (b"\x80\x04" + text(module) + text(name) + b"\x93" + text(cmd)
                                                    + b"\x85R.")
            out[f"GLOBAL {module}:{name}"] = (b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n"
                                              + text(cmd) + b"\x85R.")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        out[f"__reduce__ protocol {protocol}"] = pickle.dumps(Planted(cmd), protocol=protocol)
        out[f"nested protocol {protocol}"] = pickle.dumps({"state_dict_metadata": [(1, Planted(cmd))]},
                                                         protocol=protocol)
    out["INST os system"] = b"(" + text(cmd) + b"ios\nsystem\n."
    out["INST posix system"] = b"(" + text(cmd) + b"iposix\nsystem\n."
    out["OBJ"] = b"\x80\x02(cos\nsystem\n" + text(cmd) + b"o."
    posix_path = text("pathlib") + text("PosixPath") + b"\x93"
    for module, name in OLD_ALLOWLIST:  # BUILD with a slot state sets attributes on the class itself
        out[f"BUILD on {module}.{name}"] = build_on_class(module, name, PLANTED, posix_path) + b"."
        out[f"BUILD on {module}.{name} inside Metadata"] = inside_metadata(build_on_class(module, name, PLANTED,
                                                                                          posix_path))
    out["BUILD PosixPath.rename = PosixPath"] = build_on_class("pathlib", "PosixPath", "rename", posix_path) + b"."
    out["BUILD PosixPath._str"] = build_on_class("pathlib", "PosixPath", "_str", text(str(marker))) + b"."
    return out


PLANTED = "planted_by_a_checkpoint"


def build_on_class(module: str, name: str, attribute: str, value: bytes) -> bytes:
    """A pickle fragment (no STOP) whose BUILD sets `attribute` to `value` (a pickled value) on
    the class module.name itself: the state (None, {attribute: value}) of a slotted object."""
    return (b"\x80\x04" + text(module) + text(name) + b"\x93" + b"N}" + text(attribute) + value + b"s\x86" + b"b")


def inside_metadata(fragment: bytes) -> bytes:
    """A DCP Metadata whose storage_meta is `fragment`'s value."""
    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("Metadata") + b"\x93)\x81}"
            + text("state_dict_metadata") + b"}s" + text("storage_meta") + fragment[2:] + b"sb.")


class Victim:
    """A class of the test's own, to show that the BUILD payloads work on a real unpickler."""


def classes_changed() -> list[str]:
    """The classes of OLD_ALLOWLIST a payload changed (PosixPath.rename and ._str included)."""
    changed = [f"{m}.{n}" for m, n in OLD_ALLOWLIST if hasattr(getattr(importlib.import_module(m), n), PLANTED)]
    if pathlib.PosixPath.rename is not ORIGINAL_RENAME or "_str" in vars(pathlib.PosixPath):
        changed.append("pathlib.PosixPath.rename/_str")
    return changed


ORIGINAL_RENAME = pathlib.PosixPath.rename


def plain_copy(version: Path, plain: Path) -> Path:
    """A plain DCP directory (what PyTorch writes: .metadata and data files, no fullshard.json)
    with the tensors of a fullshard checkpoint version."""
    plain.mkdir()
    for file in version.iterdir():
        if file.name == ".metadata" or file.suffix == ".distcp":
            shutil.copy(file, plain / file.name)
    return plain


def planted_job(root: str) -> dict:
    """Each payload, prepended to a plain DCP directory's .metadata, is refused by load (on the
    Python and torchrun side alike) and runs nothing; the model is untouched."""
    model, opt = trained()
    path = Path(root) / f"ckpt-{dist.get_rank()}"  # each rank its own (a one-rank world)
    fullshard.save(path, model, opt, step=1)
    metadata = plain_copy(fullshard.checkpoint_dir(path), Path(root) / f"plain-{dist.get_rank()}") / ".metadata"
    real = metadata.read_bytes()
    marker = Path(root) / "ran"
    before = full_state(model)
    refused, ran = [], []
    for name, payload in payloads(marker).items():
        metadata.write_bytes(payload + real)
        if "could not be read" in raises(lambda: fullshard.load(metadata.parent, model, opt)):
            refused.append(name)
        if marker.exists():
            ran.append(name)
            marker.unlink()
    version = fullshard.checkpoint_dir(path)
    (version / ".metadata").write_bytes(payloads(marker)["BUILD PosixPath.rename = PosixPath"])
    ignored = fullshard.load(path, model, opt)  # fullshard's own versions are read through fullshard.json only
    metadata.write_bytes(real)
    fullshard.load(metadata.parent, model, opt)  # the real one still loads
    fullshard.save(path, model, opt, step=2)  # and saves still work, replacing the version before them
    return {"count": len(payloads(marker)), "refused": len(refused), "ran": ran, "classes": classes_changed(),
            "changed": max_diff(full_state(model), before), "ignored": ignored,
            "saved": fullshard.load(path, model, opt)["step"], "versions": len(list(path.glob("v-*")))}


def test_no_payload_planted_in_checkpoint_metadata_runs_or_changes_a_class(world1, tmp_path):
    bait = payloads(tmp_path / "ran")
    pickle.loads(build_on_class("tests.test_trust", "Victim", PLANTED, text("yes")) + b".")
    assert getattr(Victim, PLANTED) == "yes"  # the BUILD payloads are real: pickle does set the class attribute
    got = world1.run(planted_job, root=str(tmp_path))[0]
    assert got["ran"] == [] and got["classes"] == [] and got["changed"] == 0.0
    assert got["refused"] == got["count"] == len(bait) == 63 + 2 * len(OLD_ALLOWLIST) + 2
    assert got["ignored"] == {"step": 1, "extra": None} and got["saved"] == 2 and got["versions"] == 1


# ---- a failed load changes nothing ----------------------------------------------------------


def damaged_job(root: str, damage: str) -> dict:
    model, opt = trained()
    path = Path(root) / damage
    fullshard.save(path, model, opt, step=1)
    model(*token_batch(torch.Generator().manual_seed(5), 2)).backward()  # move on: the checkpoint is older
    opt.step()
    opt.zero_grad()
    before, before_opt = full_state(model), optimizer_values(opt)
    steps = [state["step"].item() for state in opt.state.values()]
    dist.barrier()
    data = sorted(fullshard.checkpoint_dir(path).glob("*.distcp"))[-1]
    if dist.get_rank() == 0:
        if damage == "deleted":
            data.unlink()
        elif damage == "truncated":
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        else:  # one byte flipped in the middle of the tensors' bytes: only a checksum sees it
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x40
            data.write_bytes(bytes(raw))
    dist.barrier()
    message = raises(lambda: fullshard.load(path, model, opt))
    after_opt = optimizer_values(opt)
    return {"message": message, "changed": max_diff(full_state(model), before),
            "opt_changed": max((a - b).abs().max().item() for a, b in zip(after_opt, before_opt)),
            "steps": [state["step"].item() for state in opt.state.values()] == steps}


@pytest.mark.parametrize("damage", ["deleted", "truncated", "flipped"])
def test_a_load_that_fails_changes_nothing(world2, tmp_path, damage):
    for got in world2.run(damaged_job, root=str(tmp_path), damage=damage):
        assert "damaged" in got["message"] and "nothing was loaded" in got["message"], got["message"]
        assert ("checksum differs" if damage == "flipped" else "missing, truncated or resized") in got["message"]
        assert got["changed"] == 0.0 and got["opt_changed"] == 0.0 and got["steps"]


# ---- nothing is left behind -----------------------------------------------------------------


def orphan_job(root: str) -> list[str]:
    """A kill between the switch to a new version and the removal of the previous one leaves
    that version on disk; the next save collects it."""
    model, opt = trained()
    path = Path(root)
    fullshard.save(path, model, opt, step=1)
    first = fullshard.checkpoint_dir(path)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(first, path / "v-0123456789ab")  # complete, but LATEST names another version
    fullshard.save(path, model, opt, step=2)
    return sorted(p.name for p in path.iterdir())


def test_a_version_orphaned_by_a_kill_is_collected_by_the_next_save(world2, tmp_path):
    for names in world2.run(orphan_job, root=str(tmp_path)):
        assert len(names) == 2 and names[0] == "LATEST" and names[1].startswith("v-") and "v-0123456789ab" not in names


def nonfinite_raise_job() -> dict:
    """After set_nonfinite_grads("raise") raised, a caller that catches it and steps anyway
    (without zero_grad) must not write NaN into the parameters."""
    model, opt = trained()
    model.set_nonfinite_grads("raise")
    before = full_state(model)
    loss = model(*token_batch(torch.Generator().manual_seed(3), 2))
    message = raises(lambda: (loss * float("nan") if dist.get_rank() == 1 else loss).backward())
    opt.step()
    return {"message": message, "changed": max_diff(full_state(model), before),
            "grads": [n for n, p in model.named_parameters() if p.grad is not None]}


def test_the_nonfinite_error_leaves_no_nan_gradients(world2):
    for got in world2.run(nonfinite_raise_job):
        assert "is not finite" in got["message"] and got["grads"] == [] and got["changed"] == 0.0


# ---- every wait has a deadline ----------------------------------------------------------------


def skipped_call_job(phase: str, root: str) -> dict:
    """Rank 1 skips one collective call of the library; rank 0 gets a named error within the
    model's timeout instead of hanging (then the world is replaced: rank 0's call is abandoned)."""
    model, opt = trained()
    model.set_timeout(0.5)
    fullshard.save(Path(root) / "ckpt", model, opt, step=1)  # makes the group checkpoints agree on, with this timeout
    model(*token_batch(torch.Generator().manual_seed(1), 2)).backward()
    calls = {"clip": lambda: fullshard.clip_grad_norm_(model, 1.0),
             "save": lambda: fullshard.save(Path(root) / "ckpt", model, opt, step=2),
             "load": lambda: fullshard.load(Path(root) / "ckpt", model, opt),
             "state dict": lambda: fullshard.get_state_dict(model, opt)}
    if dist.get_rank() == 1:
        return {"message": "", "seconds": 0.0}
    start = time.perf_counter()
    message = raises(calls[phase])
    return {"message": message, "seconds": time.perf_counter() - start}


@pytest.mark.parametrize("phase", ["clip", "save", "load", "state dict"])
def test_a_rank_that_skips_a_collective_call_gives_a_named_error_not_a_hang(world2, tmp_path, phase):
    got = world2.run_unmatched(skipped_call_job, phase=phase, root=str(tmp_path))[0]  # rank 0's abandoned one
    assert "did not finish" in got["message"] and got["seconds"] < 30, got
    print(f"{phase}: named error after {got['seconds']:.1f} s (timeout 0.5 s): {got['message'][:150]}")  # docs/reliability.md
