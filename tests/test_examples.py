"""examples/ run as a user runs them: each `main(argv)` on 2 ranks at a tiny size, end to end."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import fullshard

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NANOGPT_TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
                "--grad-accum", "2", "--warmup", "2", "--lr-decay-steps", "6", "--eval-iters", "2",
                "--sample-len", "40", "--device", "cpu"]
HF_TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
           "--steps", "6", "--device", "cpu"]


def example(name: str):
    """examples/<name>.py as a module (examples/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_job(argv: list[str]) -> dict:
    return example("nanogpt").main(argv)


def hf_finetune_job(argv: list[str]) -> dict:
    """The example's result, and the trained model's full weights as fullshard gathers them (rank 0)."""
    result = example("hf_finetune").main(argv)
    state_dict, _ = fullshard.get_state_dict(result.pop("model"), rank0_only=True)
    return {**result, "state_dict": state_dict}


@pytest.fixture(scope="module")
def nanogpt_6_steps(world2, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("nanogpt")
    return world2.run(nanogpt_job, argv=[*NANOGPT_TINY, "--steps", "6", "--out", str(out)])


def test_nanogpt_ranks_agree_the_loss_falls_and_rank0_samples(nanogpt_6_steps):
    first, second = nanogpt_6_steps
    assert len(first["losses"]) == 6 and first["resumed_from"] == 0
    # each rank reports the all-reduced loss of the whole global batch
    assert first["losses"] == second["losses"] and first["val_loss"] == second["val_loss"]
    assert first["losses"][-1] < first["losses"][0] - 0.2  # from ~ln(256) = 5.5, visibly down in 6 steps
    assert math.isfinite(first["val_loss"]) and first["val_loss"] < first["losses"][0]
    assert first["sample"].startswith("def ") and len(first["sample"]) > 20
    assert second["sample"] == ""  # only rank 0 generates


def test_nanogpt_on_one_rank_trains_the_same(nanogpt_6_steps, world1, tmp_path):
    (alone,) = world1.run(nanogpt_job, argv=[*NANOGPT_TINY, "--steps", "6", "--out", str(tmp_path)])
    # the same global batches from the same weights; 2 ranks only add the halves'
    # gradients in another order, a few fp32 roundings that AdamW carries along 6 steps
    torch.testing.assert_close(alone["losses"], nanogpt_6_steps[0]["losses"], rtol=1e-5, atol=0)
    assert alone["sample"].startswith("def ")


def test_nanogpt_resume_continues_the_curve(nanogpt_6_steps, world2, tmp_path):
    args = [*NANOGPT_TINY, "--out", str(tmp_path)]
    halfway = world2.run(nanogpt_job, argv=[*args, "--steps", "3"])
    resumed = world2.run(nanogpt_job, argv=[*args, "--steps", "6"])
    assert [r["resumed_from"] for r in resumed] == [3, 3]
    # batches depend only on the step and the checkpoint restores weights and AdamW state
    # exactly, so the resumed steps are those of the uninterrupted run, bit for bit
    assert halfway[0]["losses"] + resumed[0]["losses"] == nanogpt_6_steps[0]["losses"]
    assert resumed[0]["val_loss"] == nanogpt_6_steps[0]["val_loss"]


def test_hf_finetune_saves_what_from_pretrained_loads(world2, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    first, second = world2.run(hf_finetune_job, argv=[*HF_TINY, "--out", str(tmp_path / "llama")])
    assert first["losses"] == second["losses"] and len(first["losses"]) == 6
    assert first["losses"][-1] < first["losses"][0]
    assert second["state_dict"] == {}  # rank0_only

    # a plain single-process load: no fullshard, no process group
    model, info = AutoModelForCausalLM.from_pretrained(first["save_dir"], output_loading_info=True)
    assert isinstance(model, LlamaForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded, trained = model.state_dict(), first["state_dict"]
    assert loaded.keys() == trained.keys()
    for name, tensor in trained.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
