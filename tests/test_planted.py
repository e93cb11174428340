"""Checkpoint and run directories planted or changed by someone else: links, FIFOs, /proc
names, edited manifests and DCP metadata. Each is refused by name, at once, with nothing
read or written outside the directory and the model unchanged (Note [confined files],
Note [manifest], Note [pickles as data])."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

import fullshard
from fullshard import FullShardError
from fullshard.cli.launcher import hold_run_dir
from fullshard.cli.run_log import open_log, plot
from tests.reference import full_state, max_diff
from tests.test_errors import raises
from tests.test_trust import plain_copy, trained

SECRET = "precious bytes outside the checkpoint"

# each edit of a valid fullshard.json, and what the refusal says
MANIFEST_EDITS = {
    "files name /proc/kmsg": (lambda m: m["files"].update({"/proc/kmsg": {"size": 0, "crc32": 0}}),
                              "not a file of the checkpoint's own directory"),
    "files name ..": (lambda m: m["files"].update({"../ckpt2/LATEST": {"size": 14, "crc32": 0}}),
                      "not a file of the checkpoint's own directory"),
    "chunk file absolute": (lambda m: first_chunk(m).update(file="/proc/kmsg"),
                            "not a file of the checkpoint's own directory"),
    "chunk file unlisted": (lambda m: first_chunk(m).update(file="__7_0.distcp"), "which the manifest's files do not"),
    "step string": (lambda m: m.update(step="7"), "step must be an integer"),
    "step negative": (lambda m: m.update(step=-5), "step must be an integer"),
    "step huge": (lambda m: m.update(step=1e30), "step must be an integer"),
    "step list": (lambda m: m.update(step=[1]), "step must be an integer"),
    "step bool": (lambda m: m.update(step=True), "step must be an integer"),
    "format": (lambda m: m.update(format=1), "this fullshard reads format 2"),
    "missing field": (lambda m: m.pop("tensors"), "must have the fields"),
    "unknown field": (lambda m: m.update(code="os.system('id')"), "must have the fields"),
    "dtype": (lambda m: first_tensor(m).update(dtype="os.system"), "is not a dtype fullshard loads"),
    "huge size": (lambda m: first_chunk(m).update(sizes=[2**40] * len(first_chunk(m)["sizes"])),
                  "lies outside the tensor's shape"),
    "huge shape": (lambda m: first_tensor(m).update(shape=[2**40] * len(first_tensor(m)["shape"])),
                   "has chunks of"),
    "stride 0": (lambda m: first_chunk(m).update(storage_numel=1, stride=[0] * len(first_chunk(m)["stride"])),
                 "more than its storage's 1"),
    "bytes past the file": (lambda m: first_chunk(m).update(length=2**40), "which holds"),
    "not JSON": (None, "is not JSON"),
}


def first_tensor(manifest: dict) -> dict:
    return next(t for t in manifest["tensors"].values() if t["chunks"] and len(t["shape"]) == 2)


def first_chunk(manifest: dict) -> dict:
    return first_tensor(manifest)["chunks"][0]


def planted_checkpoint_job(root: str) -> dict:
    """One rank: a checkpoint with every plant in turn; what each load or save said."""
    model, opt = trained()
    root = Path(root)
    ckpt, outside = root / "ckpt", root / "outside.txt"
    outside.write_text(SECRET)
    fullshard.save(ckpt, model, opt, step=1)
    fullshard.save(root / "other", model, opt, step=1)
    before = full_state(model)
    out: dict = {}

    def attempt(name: str, call) -> None:
        start = time.perf_counter()
        out[name] = {"message": raises(call), "seconds": time.perf_counter() - start,
                     "changed": max_diff(full_state(model), before)}

    # links at the names a save writes through: the save writes around them, never through
    for name in ("LATEST.tmp", ".LATEST.tmp", "fullshard.json.tmp", ".lock"):
        (ckpt / name).symlink_to(outside)
    (ckpt / "LATEST").unlink()
    (ckpt / "LATEST").symlink_to(outside)  # LATEST itself a link: refused by load, replaced by the next save
    attempt("LATEST a link", lambda: fullshard.load(ckpt, model, opt))
    fullshard.save(ckpt, model, opt, step=2)
    out["LATEST replaced"] = not (ckpt / "LATEST").is_symlink() and fullshard.load(ckpt, model, opt)["step"] == 2
    version = fullshard.checkpoint_dir(ckpt)
    for text in ("../other/" + fullshard.checkpoint_dir(root / "other").name, "/etc", "v-0123456789ab"):
        (ckpt / "LATEST").write_text(text)
        attempt(f"LATEST names {text}", lambda: fullshard.load(ckpt, model, opt))
    (ckpt / "v-aaaaaaaaaaaa").symlink_to(fullshard.checkpoint_dir(root / "other"), target_is_directory=True)
    (ckpt / "LATEST").write_text("v-aaaaaaaaaaaa")
    attempt("version a link", lambda: fullshard.load(ckpt, model, opt))
    (ckpt / "LATEST").write_text(version.name)
    # files of the version replaced by links to copies of themselves, or by a FIFO
    data = sorted(version.glob("*.distcp"))[0]
    for target in (data, version / "fullshard.json"):
        keep = root / f"copy-{target.name}"
        shutil.copy(target, keep)
        target.unlink()
        target.symlink_to(keep)
        attempt(f"{target.name} a link", lambda: fullshard.load(ckpt, model, opt))
        target.unlink()
        shutil.copy(keep, target)
    shutil.move(data, root / "data")
    os.mkfifo(data)
    attempt("data a FIFO", lambda: fullshard.load(ckpt, model, opt))
    data.unlink()
    shutil.move(root / "data", data)
    # the manifest edited, or gone
    manifest = version / "fullshard.json"
    good = manifest.read_text()
    for name, (edit, _) in MANIFEST_EDITS.items():
        if edit is None:
            manifest.write_text(good[: len(good) // 2])
        else:
            doc = json.loads(good)
            edit(doc)
            manifest.write_text(json.dumps(doc))
        attempt(f"manifest: {name}", lambda: fullshard.load(ckpt, model, opt))
    manifest.unlink()
    attempt("manifest deleted", lambda: fullshard.load(ckpt, model, opt))
    manifest.write_text(good)
    out["still loads"] = fullshard.load(ckpt, model, opt)["step"]
    out["outside"] = outside.read_text() == SECRET and not any(p.is_symlink() and p.resolve() == outside
                                                                 for p in version.iterdir())
    return out


def test_planted_links_fifos_and_manifests_are_refused_with_nothing_outside_touched(world1, tmp_path):
    got = world1.run(planted_checkpoint_job, root=str(tmp_path))[0]
    assert got.pop("LATEST replaced") and got.pop("still loads") == 2 and got.pop("outside")
    says = {"LATEST a link": "which is not a version directory", "version a link": "which is not a version directory",
            "__0_0.distcp a link": "could not be read", "fullshard.json a link": "that is not a regular file",
            "data a FIFO": "could not be read", "manifest deleted": "has no fullshard.json",
            **{f"LATEST names {t}": "which is not a version directory" for t in ("/etc", "v-0123456789ab")},
            **{f"manifest: {name}": text for name, (_, text) in MANIFEST_EDITS.items()}}
    for name, result in got.items():
        want = says.get(name, "which is not a version directory")
        assert want in result["message"], (name, result["message"])
        assert result["changed"] == 0.0 and result["seconds"] < 5, (name, result)
        print(f"{name}: refused in {result['seconds'] * 1000:.1f} ms")  # docs/reliability.md


def planted_dcp_job(root: str) -> dict:
    """A plain DCP directory whose metadata (re-pickled here with torch's own classes) names
    files outside, uses transforms, or claims sizes its records cannot hold."""
    model, opt = trained()
    root = Path(root)
    fullshard.save(root / "ckpt", model, opt, step=1)
    before = full_state(model)
    plain = plain_copy(fullshard.checkpoint_dir(root / "ckpt"), root / "plain")
    good = (plain / ".metadata").read_bytes()
    out = {"plain loads": fullshard.load(plain, model, opt) == {"step": None, "extra": None}}

    def edited(change) -> None:
        metadata = pickle.loads(good)  # the test's own file, unpickled by the test
        change(metadata)
        (plain / ".metadata").write_bytes(pickle.dumps(metadata))
        out[change.__name__] = raises(lambda: fullshard.load(plain, model, opt))

    def first_record(metadata):
        return next(info for index, info in metadata.storage_data.items() if index.offset is not None)

    def absolute_path(metadata):
        first_record(metadata).relative_path = "/proc/kmsg"

    def dotdot_path(metadata):
        first_record(metadata).relative_path = "../ckpt/LATEST"

    def transformed(metadata):
        first_record(metadata).transform_descriptors = ["zstd"]

    def huge_optimizer_state(metadata):
        item = next(v for k, v in metadata.state_dict_metadata.items() if k.endswith(".exp_avg") and len(v.size) == 1)
        item.size = item.chunks[0].sizes = torch.Size([2**40])  # one rank: one chunk, at offset 0

    for change in (absolute_path, dotdot_path, transformed, huge_optimizer_state):
        edited(change)
    out["changed"] = max_diff(full_state(model), before)
    return out


def test_planted_dcp_metadata_names_nothing_outside_and_allocates_nothing_it_claims(world1, tmp_path):
    got = world1.run(planted_dcp_job, root=str(tmp_path))[0]
    assert got["plain loads"] and got["changed"] == 0.0
    assert "not a file of the checkpoint's own directory" in got["absolute_path"]
    assert "not a file of the checkpoint's own directory" in got["dotdot_path"]
    assert "through transforms" in got["transformed"]
    assert "more than its record of" in got["huge_optimizer_state"]


def test_a_run_directorys_planted_links_are_refused_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text(SECRET)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(outside)
    with pytest.raises(FullShardError, match="a .lock there must be a regular file, not a link"):
        hold_run_dir(out)
    (out / ".lock").unlink()
    (out / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(FullShardError, match="must be a regular file, not a link"):
        open_log(out, 5)
    (out / "metrics.jsonl").unlink()
    (out / "loss.png").symlink_to(outside)
    plot([{"step": 1, "loss": 2.0, "peak_mem_mb": [1.0]}], out / "loss.png")  # replaces the link
    assert outside.read_text() == SECRET and not (out / "loss.png").is_symlink()
