"""GPU check: fullshard on CUDA with NCCL, against one process and against torch's FSDP2.

    .venv/bin/python benchmarks/gpu_check.py            # every GPU of this machine, 1 included
    .venv/bin/python benchmarks/gpu_check.py --cpu      # the same checks on 2 CPU ranks over gloo

Without CUDA it prints why it skips and exits 0 (`--cpu` checks this script itself).
With N GPUs it starts N ranks (torchrun --standalone, one GPU per rank, NCCL) and runs:

1. parity: a small GPT trained by every strategy (full_shard,
   shard_grad_op, no_shard, hybrid_shard over every shard-group size that divides N,
   reshard_after_forward=k for every divisor 1 < k < N) x precision (fp32; bf16; fp16
   with fullshard.GradScaler) x CPU offload (off, on) x prefetch (on, off), 3 SGD steps
   with clipping, against the same model trained by one process on the whole global
   batch on the same GPU (low precision: bf16/fp16 copies of fp32 masters, by hand);
2. the step benchmark: fullshard against FSDP2 (both sharded per block, bf16 compute),
   median step time and torch.cuda.max_memory_allocated per rank.

It prints a line per configuration and a table, and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

# (loss, parameter) tolerances against one process; reasons where they are used, in parity()
TOLERANCES = {"fp32": (1e-5, 1e-5), "bf16": (0.08, 2e-3), "fp16": (0.02, 4e-4)}


MESHES: dict[int, object] = {}  # hybrid meshes by shard-group size


def log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configs(world: int) -> list[tuple[str, int, str, bool, bool]]:
    """(strategy, shard-group size or reshard k, precision, offload, prefetch) to check."""
    shapes = [("full_shard", 0), ("shard_grad_op", 0), ("no_shard", 0)]
    shapes += [("hybrid_shard", f) for f in divisors(world)]
    shapes += [("reshard_after_forward", k) for k in divisors(world) if 1 < k < world]
    return [(s, n, p, o, f) for (s, n), p, o, f in
            itertools.product(shapes, ("fp32", "bf16", "fp16"), (False, True), (True, False))]


def build(device):
    import torch
    from fullshard.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, vocab_size=97, n_layer=3, n_head=2, n_embd=48)).to(device)


def shard(model, strategy: str, size: int, precision: str, offload: bool, prefetch: bool, device_type: str):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fullshard
    from fullshard.gpt import Block

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    options = dict(mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=low) if low else None,
                   offload_policy=fullshard.CPUOffloadPolicy() if offload else None)
    if strategy == "reshard_after_forward":
        for block in model.h:
            fullshard.fully_shard(block, reshard_after_forward=size, **options)
        fullshard.fully_shard(model, **options)
        return model
    mesh = None
    if strategy == "hybrid_shard":
        world = torch.distributed.get_world_size()
        if size not in MESHES:  # one per shape: each creates process groups
            MESHES[size] = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("replicate", "shard"))
        mesh = MESHES[size]
    return fullshard.shard_model(model, wrap={Block}, strategy=strategy, mesh=mesh,
                                 backward_prefetch="pre" if prefetch else None, forward_prefetch=prefetch, **options)


def optimizer_for(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def scaler_for(precision: str, device, sharded: bool):
    """fp16 only; a small initial scale, so neither run skips a step for an overflow the other does not have."""
    import torch

    import fullshard

    if precision != "fp16":
        return None
    return (fullshard.GradScaler if sharded else torch.amp.GradScaler)(device.type, init_scale=2.0**8)


def finish_step(model, optimizer, scaler, clip) -> None:
    if scaler:
        scaler.unscale_(optimizer)
    clip(model)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()


def train_sharded(model, batches, rank: int, world: int, precision: str, device) -> list[float]:
    """3 SGD steps with clipping; losses are the global batch's mean."""
    import torch.distributed as dist

    import fullshard

    optimizer, scaler = optimizer_for(model), scaler_for(precision, device, sharded=True)
    losses = []
    for x, y in batches:
        loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
        (scaler.scale(loss) if scaler else loss).backward()
        finish_step(model, optimizer, scaler, lambda m: fullshard.clip_grad_norm_(m, 1.0))
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def train_reference(model, batches, precision: str, device) -> list[float]:
    """One process, whole batches, by hand as fullshard does it: fp32 masters step, a
    bf16/fp16 copy computes (tests/test_precision.py's reference)."""
    import torch

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    compute = copy.deepcopy(model).to(low) if low else model
    optimizer, scaler = optimizer_for(model), scaler_for(precision, device, sharded=False)
    losses = []
    for x, y in batches:
        if low:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), model.parameters()):
                    c.copy_(m)
        loss = compute(x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        if low:
            for c, m in zip(compute.parameters(), model.parameters()):
                m.grad, c.grad = (None if c.grad is None else c.grad.float()), None
        finish_step(model, optimizer, scaler, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        losses.append(loss.item())
    return losses


def parity(rank: int, world: int, device) -> int:
    """Every configuration against one process; returns the failures."""
    import torch
    import torch.distributed as dist

    import fullshard

    generator = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in (x, torch.roll(x, -1, 1)))
               for x in (torch.randint(0, 97, (4 * world, 32), generator=generator) for _ in range(3))]
    failures = 0
    for strategy, size, precision, offload, prefetch in configs(world):
        name = f"{strategy}{f' {size}' if size else ''} {precision} offload={offload} prefetch={prefetch}"
        try:
            reference = build(device)
            model = shard(copy.deepcopy(reference), strategy, size, precision, offload, prefetch, device.type)
            got = train_sharded(model, batches, rank, world, precision, device)
            want = train_reference(reference, batches, precision, device)
            params, _ = fullshard.get_state_dict(model)  # full tensors on the CPU, under the reference's names
            drift = max((params[n].float() - p.detach().float().cpu()).abs().max().item()
                        for n, p in reference.named_parameters())
            loss_drift = max(abs(a - b) for a, b in zip(got, want))
            # Both runs compute the same terms; the sharded one sums the batch in per-rank
            # parts, which regroups the sums. fp32 (TF32 off): a few roundings per step
            # (tests/reference.py bounds them at 1e-6 and 2.5e-7 on CPUs; 10x-40x here for
            # cuBLAS choosing other kernels at other batch sizes). bf16/fp16: a regrouped sum
            # moves a value by about an ulp of its dtype; with --cpu (2 ranks) measured: loss
            # 0.047 (1.5 bf16 ulps at ~4) / 0.0059 (fp16), parameters 1.8e-4 / 2.0e-5;
            # the bounds allow ~2.5 ulps on losses and 10-20x on parameters for GPU kernels.
            loss_tol, param_tol = TOLERANCES[precision]
            ok = loss_drift <= loss_tol and drift <= param_tol and all(v == v for v in got)
            detail = f"loss {loss_drift:.2e} param {drift:.2e}"
        except Exception as e:  # a crash is a failed check, and the next configuration still runs
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)
        failures += int(flag.item() > 0)
        log(rank, f"{'PASS' if flag.item() == 0 else 'FAIL'}  {name}: {detail}")
        del reference
        gc.collect()
    return failures


def step_benchmark(rank: int, world: int, device, steps: int) -> None:
    """fullshard against FSDP2 on the 100m GPT (tiny on the CPU) in bf16: median step time, peak memory."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fullshard
    from fullshard.gpt import GPT, PRESETS, Block, GPTConfig

    rows = []
    for impl in ("fullshard", "fsdp2", "fullshard", "fsdp2"):  # alternated: drift hits both alike
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
        preset = "100m" if device.type == "cuda" else "tiny"
        model = GPT(GPTConfig(block_size=256, vocab_size=256, **PRESETS[preset])).to(device)
        if impl == "fullshard":
            fullshard.shard_model(model, wrap={Block}, forward_prefetch=True,
                                  mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        else:
            for block in model.h:
                fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        generator = torch.Generator().manual_seed(0)
        times = []
        for i in range(steps + 3):
            x = torch.randint(0, 256, (8, 257), generator=generator).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            if impl == "fullshard":
                fullshard.clip_grad_norm_(model, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 3:  # after warm-up
                times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        figures = torch.tensor([statistics.median(times), peak], dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        rows.append((impl, figures[0].item(), figures[1].item() / 2**20))
        del model, optimizer
    best = {impl: (min(r[1] for r in rows if r[0] == impl), max(r[2] for r in rows if r[0] == impl))
            for impl in ("fullshard", "fsdp2")}
    log(rank, f"\n| impl | step s (median of {steps}, best of 2 runs) | peak allocated MB (max over ranks) "
              f"| step / FSDP2 | memory / FSDP2 |\n|---|---|---|---|---|")
    for impl, (step_s, peak_mb) in best.items():
        base_s, base_mb = best["fsdp2"]
        log(rank, f"| {impl} | {step_s:.4f} | {peak_mb:.0f} | {step_s / base_s:.2f} | "
                  f"{peak_mb / base_mb if base_mb else float('nan'):.2f} |")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))  # a hang fails the check
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    log(rank, f"gpu_check: {world} rank(s) on {torch.cuda.get_device_name(device) if cuda else 'the CPU'}, "
              f"torch {torch.__version__}, backend {dist.get_backend()}")
    failures = parity(rank, world, device)
    log(rank, f"\nparity: {len(configs(world)) - failures} of {len(configs(world))} configurations pass")
    if not args.skip_bench:
        step_benchmark(rank, world, device, args.steps)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on 2 CPU ranks over gloo (checks this script)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per benchmark run")
    parser.add_argument("--skip-bench", action="store_true", help="parity only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}). Run it on a machine with GPUs, or pass --cpu to check the script on the CPU.")
        return 0
    nproc = 2 if args.cpu else torch.cuda.device_count()
    env = dict(os.environ, OMP_NUM_THREADS="1") if args.cpu else dict(os.environ)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           "--worker", "--steps", str(args.steps)] + (["--cpu"] if args.cpu else []) + \
        (["--skip-bench"] if args.skip_bench else [])
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
