"""One framework's training, as its users write it, with torch's FSDP2 and then with fullshard,
in the same two ranks: `torchrun --nproc_per_node 2 integrations/run.py FRAMEWORK OUT`.

Each recipe trains a tiny Hugging Face Llama (torchtitan: its own debug model) for 4
optimizer steps of 2 micro-batches each, saves a checkpoint with the framework's own call
after step 2, then builds everything again, loads that checkpoint the framework's way and
trains steps 3 and 4 again. Rank 0 writes OUT (JSON): for each implementation the losses of
every micro-batch, those of the resumed steps, and a digest of every final parameter's
bytes, which integrations/test_frameworks.py compares bitwise. docs/integrations.md shows the
recipes in short.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: the tests package

import fullshard  # noqa: E402
import fullshard.hooks  # noqa: E402
from tests.models import SEQ, VOCAB, hf_llama  # noqa: E402

STEPS, MICRO, SAVE_AT = 4, 2, 2
WORLD_BATCH = 4  # sequences per micro-batch over both ranks


def batches(seed: int = 0) -> list[torch.Tensor]:
    """Every micro-batch of the run (the global batch; a rank takes its half)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (WORLD_BATCH, SEQ), generator=generator) for _ in range(STEPS * MICRO)]


def mine(batch: torch.Tensor) -> torch.Tensor:
    return batch.chunk(dist.get_world_size())[dist.get_rank()]


def digest(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's full value, as a digest of its bytes (every rank gathers)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p
        out[name] = hashlib.sha256(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def sharded_by(model: torch.nn.Module) -> str:
    """Whose units the model has: fullshard's, torch FSDP2's, or none."""
    from torch.distributed.fsdp import FSDPModule

    if fullshard.hooks.units_under(model):
        return "fullshard"
    return "torch" if any(isinstance(m, FSDPModule) for m in model.modules()) else "none"


def seeded_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_llama()


def shard_llama(model: torch.nn.Module, shard, mesh=None) -> torch.nn.Module:
    """Per decoder layer, then the root: the usual FSDP2 recipe, with `shard` torch's or fullshard's."""
    for layer in model.model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


# ---- Lightning Fabric ------------------------------------------------------------------------


def fabric(impl: str, ckpt: Path) -> dict:
    """Fabric with ModelParallelStrategy: parallelize_fn shards; no_backward_sync skips the
    reductions of all but the last micro-batch; fabric.save / fabric.load (distributed)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = torch_fully_shard if impl == "torch" else fullshard.fully_shard

    def parallelize(model, device_mesh):
        return shard_llama(model, shard, device_mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    f = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    f.launch()

    def build():
        model = f.setup(seeded_llama())
        return model, f.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train(model, optimizer, steps: range) -> list[float]:
        losses = []
        data = batches()
        for step in steps:
            for m in range(MICRO):
                x = mine(data[step * MICRO + m])
                with f.no_backward_sync(model, enabled=m < MICRO - 1):
                    loss = model(input_ids=x, labels=x).loss / MICRO
                    f.backward(loss)
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
            if step + 1 == SAVE_AT:
                f.save(ckpt, {"model": model, "optimizer": optimizer})
        return losses

    model, optimizer = build()
    with counted(model, impl) as reductions:
        losses = train(model, optimizer, range(STEPS))
    final = digest(model)
    model, optimizer = build()
    f.load(ckpt, {"model": model, "optimizer": optimizer})
    resumed = train(model, optimizer, range(SAVE_AT, STEPS))
    return {"losses": losses, "resumed": resumed, "params": final, "resumed_params": digest(model),
            "reductions": reductions, "sharded by": sharded_by(model)}


@contextlib.contextmanager
def counted(model: torch.nn.Module, impl: str):
    """fullshard's reduce-scatters while the block runs, into the list it yields (FSDP2: none counted)."""
    out: list[int] = []
    if impl != "fullshard":
        yield out
        return
    with fullshard.stats(model) as s:
        yield out
    out.append(s.reduce_scatters)


# ---- the Lightning Trainer -------------------------------------------------------------------


def lightning_trainer(impl: str, ckpt: Path) -> dict:
    """Trainer with ModelParallelStrategy: configure_model shards, accumulate_grad_batches=2, a
    checkpoint after step 2 (trainer.save_checkpoint, distributed), fit(ckpt_path=...) resumes."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = torch_fully_shard if impl == "torch" else fullshard.fully_shard

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = seeded_llama()
            self.seen: list[float] = []

        def configure_model(self) -> None:
            if sharded_by(self.model) == "none":
                shard_llama(self.model, shard, self.device_mesh["data_parallel"])

        def training_step(self, x, index):
            loss = self.model(input_ids=x, labels=x).loss
            self.seen.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


    epoch = [x for batch in batches()[: SAVE_AT * MICRO] for x in batch.chunk(2)[0]]  # 1 sequence a rank a batch
    data = torch.utils.data.DataLoader(epoch, batch_size=1)

    def run(resume: Path | None) -> Module:
        module = Module()
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, accumulate_grad_batches=MICRO,
                            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                            callbacks=[ModelCheckpoint(ckpt, every_n_train_steps=SAVE_AT, save_top_k=-1)],
                            logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, data, ckpt_path=resume)
        return module

    first = run(None)
    again = run(next(ckpt.glob(f"*step={SAVE_AT}*")))
    return {"losses": first.seen, "resumed": again.seen, "params": digest(first.model),
            "resumed_params": digest(again.model), "sharded by": sharded_by(first.model)}


# ---- Accelerate -------------------------------------------------------------------------------


def accelerate(impl: str, ckpt: Path, peft: bool = False) -> dict:
    """Accelerate's FSDP2 plugin (it calls torch's fully_shard itself: fullshard.replace_fsdp2 for
    fullshard), accumulation by accelerator.accumulate, save_state / load_state; with `peft`, a
    LoRA adapter on the model first."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=MICRO, cpu=True)
    # Accelerate takes FSDP on GPUs only; on these CPU ranks its state is set as a GPU run's would be
    for state in (PartialState(), accelerator.state):
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin

    def build():
        model = lora(seeded_llama()) if peft else seeded_llama()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        with replaced(impl):
            return accelerator.prepare(model, optimizer)

    def train(model, optimizer, steps: range) -> list[float]:
        losses, data = [], batches()
        for step in steps:
            for m in range(MICRO):
                x = mine(data[step * MICRO + m])
                with accelerator.accumulate(model):
                    loss = model(input_ids=x, labels=x).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
            if step + 1 == SAVE_AT:
                accelerator.save_state(str(ckpt))
        return losses

    model, optimizer = build()
    with counted(model, impl) as reductions:
        losses = train(model, optimizer, range(STEPS))
    final = digest(model)
    model, optimizer = build()
    accelerator._models, accelerator._optimizers = [model], [optimizer]  # load_state fills what prepare registered
    accelerator.load_state(str(ckpt))
    resumed = train(model, optimizer, range(SAVE_AT, STEPS))
    return {"losses": losses, "resumed": resumed, "params": final, "resumed_params": digest(model),
            "reductions": reductions, "sharded by": sharded_by(model)}


# ---- the Hugging Face Trainer -----------------------------------------------------------------


def hf_trainer(impl: str, ckpt: Path, peft: bool = False) -> dict:
    """Trainer with FSDP version 2 (through Accelerate: fullshard.replace_fsdp2 for fullshard),
    gradient accumulation, a checkpoint every 2 steps and resume_from_checkpoint; with `peft`,
    a LoRA adapter first."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class CPUFSDPTrainer(Trainer):
        """Accelerate takes FSDP on GPUs only; on these CPU ranks its state is set as a GPU run's would be."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            from accelerate.utils import FullyShardedDataParallelPlugin

            for state in (PartialState(), self.accelerator.state):
                state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.seen.append(logs["loss"])

    data = [{"input_ids": x, "labels": x} for batch in batches() for x in batch]
    args = TrainingArguments(output_dir=str(ckpt), per_device_train_batch_size=WORLD_BATCH // 2 // 2,
                             gradient_accumulation_steps=MICRO, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1,
                             save_strategy="steps", save_steps=SAVE_AT, report_to=[], use_cpu=True, seed=0,
                             dataloader_drop_last=True, fsdp="full_shard auto_wrap",
                             fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                          "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"})

    def run(resume: str | None) -> tuple[list[float], dict]:
        AcceleratorState._reset_state(True)
        model = lora(seeded_llama()) if peft else seeded_llama()
        losses = Losses()
        trainer = CPUFSDPTrainer(model=model, args=args, train_dataset=data, callbacks=[losses])
        with replaced(impl):
            trainer.train(resume_from_checkpoint=resume)
        return losses.seen, digest(trainer.model_wrapped), sharded_by(trainer.model_wrapped)

    losses, final, by = run(None)
    resumed, resumed_params, _ = run(str(ckpt / f"checkpoint-{SAVE_AT}"))
    return {"losses": losses, "resumed": resumed, "params": final, "resumed_params": resumed_params,
            "sharded by": by}


# ---- torchtitan -------------------------------------------------------------------------------


def torchtitan(impl: str, ckpt: Path) -> dict:
    """torchtitan's FSDP recipe (apply_fsdp_to_decoder, whose module bound torch's fully_shard at
    import, and disable_fsdp_gradient_division, which finds units with isinstance) on its Llama 3
    debug model. Its language models attend with flex attention only, which has no backward on
    the CPU, so here the model runs forward: the loss of a batch, then again after a DCP round
    trip of model.state_dict()."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
    from torchtitan.models.llama3 import _debugmodel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    # a whole block of flex attention's CPU kernel (128): with fewer tokens it reads memory it never
    # wrote, and the logits of either implementation are garbage, NaN in some runs
    x = mine(torch.randint(0, 2048, (WORLD_BATCH, 128), generator=torch.Generator().manual_seed(0)))
    positions = torch.arange(128).repeat(x.shape[0], 1)

    def build(seed: int):
        torch.manual_seed(seed)
        model = _debugmodel("flex").build()
        with replaced(impl):
            apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
            disable_fsdp_gradient_division(model)
        torch.manual_seed(seed)  # build() leaves storage uninitialized: torchtitan inits the sharded model
        model.init_states(buffer_device=torch.device("cpu"))
        return model

    def loss(model) -> float:
        with torch.no_grad():
            logits = model(x, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.roll(-1, 1).flatten()).item()

    model = build(0)
    divided = [unit.switches.divide_factor for unit in fullshard.hooks.units_under(model)] if impl == "fullshard" else []
    first = loss(model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    other = build(1)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt))
    other.load_state_dict(state["model"])
    return {"losses": [first], "resumed": [loss(other)], "params": digest(model), "resumed_params": digest(other),
            "sharded by": sharded_by(model), "divide factors": divided}


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))


def replaced(impl: str):
    """fullshard in torch's fully_shard's place (for fullshard), or nothing."""
    return fullshard.replace_fsdp2() if impl == "fullshard" else contextlib.nullcontext()


RECIPES = {"fabric": fabric, "lightning": lightning_trainer, "accelerate": accelerate,
           "accelerate-peft": lambda impl, ckpt: accelerate(impl, ckpt, peft=True), "hf-trainer": hf_trainer,
           "hf-trainer-peft": lambda impl, ckpt: hf_trainer(impl, ckpt, peft=True), "torchtitan": torchtitan}


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2])
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    results = {}
    for impl in ("torch", "fullshard"):
        # one folder for both ranks, named by the launch (torchrun's run id)
        folder = Path(tempfile.gettempdir(), f"fullshard-{framework}-{impl}-{os.environ['TORCHELASTIC_RUN_ID']}")
        try:
            results[impl] = RECIPES[framework](impl, folder / "ckpt")
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
