"""GPU check: fullshard on CUDA with NCCL, against one process and against torch's FSDP2,
on a machine with one GPU (or more; it uses GPU 0).

    PYTHONPATH=src timeout -k 10 540 python3 benchmarks/gpu_check.py   # the check: one command, one table
    PYTHONPATH=src python3 benchmarks/gpu_check.py --cpu  # the same on the CPU over gloo (checks the script)

Without CUDA (and without --cpu) it prints why it skips and exits 0. It runs, each under
torchrun --standalone:

1. parity at world 2, both ranks on GPU 0: NCCL refuses two ranks on one device unless
   they look like two hosts, so each rank gets its own NCCL_HOSTID and NCCL talks over its
   socket transport on the loopback interface (slow, but NCCL's real streams, events and
   collective semantics). A small GPT trained by every strategy (full_shard,
   shard_grad_op, no_shard, hybrid_shard with shard groups of 1 and 2) x precision
   (fp32; bf16; fp16 with fullshard.GradScaler), with CPU offload and without prefetch
   for some, and full_shard with gradients sent in bf16 or int8 blocks and summed in fp32
   (Note [low-precision reductions]: an all_to_all on NCCL), 3 SGD steps with clipping,
   against the same model trained by one process on the whole global batch (low precision:
   bf16/fp16 copies of fp32 masters, by hand); a background save; fullshard.optim.Muon
   against torch.optim.Muon given the same gradients (its owner exchange on NCCL), with and
   without CPU offload;
2. the step benchmark at world 1: fullshard against FSDP2 (sharded per block, bf16
   compute) on the 100m GPT, alternating, median step time and
   torch.cuda.max_memory_allocated.

Then int8 and float8 gathers (gather_dtype) and torchao's float8 training (when torchao is
installed), each with forward prefetch, trained twice from the same start: bitwise-equal runs
required, as a stream race shows as a run-to-run difference. Each part has a deadline
(PARITY_DEADLINE_S, BENCH_DEADLINE_S: 8 minutes in all), past which its torchrun and ranks
are killed; the outer `timeout -k 10 540` bounds the rest.

It prints a line per configuration, then one table, and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

# (loss, parameter) tolerances against one process; reasons where they are used, in parity()
TOLERANCES = {"fp32": (1e-5, 1e-5), "bf16": (0.08, 2e-3), "fp16": (0.02, 4e-4),
              "fp32+bf16": (1e-4, 5e-4), "bf16+int8": (0.08, 3e-3)}
LOW_PRECISION_REDUCTIONS = ("fp32+bf16", "bf16+int8")  # compute precision + the dtype gradients are sent in
# each part's deadline: together 8 minutes, inside the documented outer `timeout -k 10 540`
PARITY_DEADLINE_S, BENCH_DEADLINE_S = 330, 150


MESHES: dict[int, object] = {}  # hybrid meshes by shard-group size


def log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configs(world: int) -> list[tuple[str, int, str, bool, bool]]:
    """(strategy, shard-group size or reshard k, precision, offload, prefetch) to check: every
    strategy and precision with prefetch; offload, and no prefetch, for full_shard and
    hybrid with shard groups of 1 (a few minutes on one GPU over NCCL's sockets)."""
    shapes = [("full_shard", 0), ("shard_grad_op", 0), ("no_shard", 0)]
    shapes += [("hybrid_shard", f) for f in divisors(world)]
    shapes += [("reshard_after_forward", k) for k in divisors(world) if 1 < k < world]
    precisions = ("fp32", "bf16", "fp16")
    plain = [(s, n, p, False, True) for (s, n), p in itertools.product(shapes, precisions)]
    varied = [(s, n, p, offload, prefetch) for (s, n), p, (offload, prefetch) in
              itertools.product([("full_shard", 0), ("hybrid_shard", 1)], precisions, ((True, True), (False, False)))]
    # Note [low-precision reductions]: fp32 compute with bf16 rows, bf16 compute with int8 rows
    sent = [("full_shard", 0, p, False, True) for p in LOW_PRECISION_REDUCTIONS]
    return plain + varied + sent


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

    compute, _, sent = precision.partition("+")
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute)
    send = {"bf16": torch.bfloat16, "int8": torch.int8}.get(sent)
    options = dict(mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=low, reduce_send_dtype=send)
                   if low or send else None,
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

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.partition("+")[0])
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


def parity(rank: int, world: int, device) -> list[dict]:
    """Every configuration against one process; a record of each."""
    import torch
    import torch.distributed as dist

    import fullshard

    generator = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in (x, torch.roll(x, -1, 1)))
               for x in (torch.randint(0, 97, (4 * world, 32), generator=generator) for _ in range(3))]
    records = []
    for strategy, size, precision, offload, prefetch in configs(world):
        name = f"{strategy}{f' {size}' if size else ''} {precision} offload={offload} prefetch={prefetch}"
        drift = loss_drift = float("nan")
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
            # Gradients sent in bf16 (int8 blocks) move each by up to 2^-8 of it (half a step
            # of its block): with --cpu, fp32+bf16 loss 2.4e-6, parameters 6.2e-5; bf16+int8
            # loss 0.047 (bf16's), parameters 2.1e-4; the bounds allow 8x and 14x on parameters.
            loss_tol, param_tol = TOLERANCES[precision]
            ok = loss_drift <= loss_tol and drift <= param_tol and all(v == v for v in got)
            detail = f"loss {loss_drift:.2e} param {drift:.2e}"
        except Exception as e:  # a crash is a failed check, and the next configuration still runs
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)
        passed = flag.item() == 0
        log(rank, f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
        records.append({"name": name, "precision": precision, "ok": passed, "loss": loss_drift, "param": drift})
        del reference
        gc.collect()
    return records


def background_save(rank: int, world: int, device, path: str) -> dict:
    """save(block=False) on the device while the GPU is busy: the 100m GPT (424 MB of fp32
    parameters; tiny with --cpu) takes an AdamW step and is saved right after
    `optimizer.step()`, with no host read between (pinned staging copies on the "stage" stream,
    Note [background saves]); the next step runs while it writes, then a fresh model loads it:
    every shard as it was at the save, bitwise (the values at the save are copied on the
    device, which reads nothing on the host)."""
    import torch
    import torch.distributed as dist

    import fullshard
    from fullshard.gpt import GPT, PRESETS, Block, GPTConfig

    preset = "100m" if device.type == "cuda" else "tiny"

    def make():
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=128, vocab_size=256, **PRESETS[preset])).to(device)
        return fullshard.shard_model(model, wrap={Block}, forward_prefetch=True)

    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 256, (2 * world, 129), generator=generator).to(device) for _ in range(2)]
    try:
        model = make()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        for i, batch in enumerate(batches):
            local = batch.chunk(world)[rank]
            model(local[:, :-1], local[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
            if i == 0:  # hot: the step's kernels may still be running
                at_save = [p.to_local().clone() for p in model.parameters()]
                handle = fullshard.save(path, model, step=1, block=False)
        handle.result()
        fresh = make()
        fullshard.load(path, fresh)
        diff = max((p.to_local() - v).abs().max().item() for p, v in zip(fresh.parameters(), at_save))
        ok = diff == 0.0
        detail = f"{preset} GPT ({megabytes:.0f} MB of parameters): largest difference from the values at the " \
                 f"save {diff:.1e}"
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    log(rank, f"{'PASS' if flag.item() == 0 else 'FAIL'}  background save: {detail}")
    return {"name": "background save", "precision": "save", "ok": flag.item() == 0, "detail": detail}


def repeatable(rank: int, world: int, device, kind: str) -> dict:
    """A transformed gather (Note [gather streams]) trained twice from the same start with
    forward prefetch and 2 gathers in flight: the losses and parameters of the two runs must
    be bitwise equal (a stream race shows as a difference from run to run). `kind`: int8 or
    float8 blocks (gather_dtype), or torchao's float8 training (all-gather extensions)."""
    import torch
    import torch.distributed as dist

    import fullshard
    from fullshard.gpt import Block

    generator = torch.Generator().manual_seed(4)
    batches = [tuple(t.to(device) for t in (x, torch.roll(x, -1, 1)))
               for x in (torch.randint(0, 97, (4 * world, 32), generator=generator) for _ in range(3))]
    name = {"int8": "int8 gathers", "float8": "float8 gathers (gather_dtype)",
            "torchao": "torchao float8 training (all-gather extensions)"}[kind]
    try:
        runs = []
        for _ in range(2):
            model = build(device)
            if kind == "torchao":
                if device.type != "cuda":
                    raise RuntimeError("torchao's float8 matmuls need a GPU")
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                convert_to_float8_training(
                    model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                    module_filter_fn=lambda m, _: m.in_features % 16 == 0 and m.out_features % 16 == 0)
                mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            else:
                gather = torch.int8 if kind == "int8" else torch.float8_e4m3fn
                mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, gather_dtype=gather)
            fullshard.shard_model(model, wrap={Block}, mp_policy=mp, forward_prefetch=True, limit_all_gathers=2)
            losses = train_sharded(model, batches, rank, world, "bf16", device)
            runs.append((losses, [p.to_local().detach().clone() for p in model.parameters()]))
        same = runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
        ok = same and all(v == v for v in runs[0][0])
        detail = "two runs bitwise equal" if same else \
            f"runs differ: losses {runs[0][0]} and {runs[1][0]}"
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if kind == "torchao" and (isinstance(e, ImportError) or device.type != "cuda"):
            ok, detail = True, f"not run: {detail}"  # torchao is not a dependency (a GPU's): said in the table
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    log(rank, f"{'PASS' if flag.item() == 0 else 'FAIL'}  {name}, twice: {detail}")
    return {"name": name, "precision": "repeat", "ok": flag.item() == 0, "detail": detail}


def whole(value, device):
    """A DTensor gathered whole from `device`'s memory, as fullshard's state dicts gather
    optimizer state: under CPU offload its rows are in host memory, which NCCL cannot send
    (DTensor.full_tensor() would hand them to it)."""
    from fullshard.collectives import Caller
    from fullshard.state_dict import full_value

    return full_value(value, device, Caller("the check's gather of a parameter or gradient"))


def muon(rank: int, world: int, device, offload: bool) -> dict:
    """fullshard.optim.Muon (Note [matrix optimizers]: the rows to each matrix's owner and the
    update back, two NCCL all_to_alls; with CPU offload the rows go to the device and the
    updates come back in one wait) against torch.optim.Muon on the whole matrices, given the
    gradients the sharded model made: 3 steps, every parameter compared."""
    import torch
    import torch.distributed as dist

    from fullshard.optim import Muon, muon_groups

    generator = torch.Generator().manual_seed(3)
    batches = [tuple(t.to(device) for t in (x, torch.roll(x, -1, 1)))
               for x in (torch.randint(0, 97, (4 * world, 32), generator=generator) for _ in range(3))]
    name = f"Muon full_shard offload={offload}"
    try:
        reference = build(device)
        model = shard(copy.deepcopy(reference), "full_shard", 0, "fp32", offload, True, device.type)
        pairs = list(zip(muon_groups(model)[0], muon_groups(reference)[0]))
        ours = Muon([p for p, _ in pairs], lr=0.02)
        theirs = torch.optim.Muon([q for _, q in pairs], lr=0.02)
        for x, y in batches:
            local = x.shape[0] // world
            model(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]).backward()
            for p, q in pairs:
                q.grad = whole(p.grad, device)
            ours.step()
            theirs.step()
            ours.zero_grad()
            model.zero_grad()
        diff = max((whole(p.detach(), device) - q).abs().max().item() for p, q in pairs)
        # the owner orthogonalizes the same bits with the same kernels as one process: bitwise
        # on the CPU (tests/test_optim.py); a cuBLAS kernel chosen by another alignment may
        # round one bf16 step of the update differently (lr 2^-8 = 8e-5)
        ok, detail = diff <= 1e-4, f"largest difference from torch.optim.Muon {diff:.1e}" + \
            (" (bitwise)" if diff == 0 else "")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    log(rank, f"{'PASS' if flag.item() == 0 else 'FAIL'}  {name}: {detail}")
    return {"name": name, "precision": "muon", "ok": flag.item() == 0, "detail": detail}


def step_benchmark(rank: int, world: int, device, steps: int) -> dict:
    """fullshard against FSDP2 on the 100m GPT (tiny on the CPU) in bf16: median step time and
    peak memory, the best of two alternated runs each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fullshard
    from fullshard.gpt import GPT, PRESETS, Block, GPTConfig

    rows = []
    preset = "100m" if device.type == "cuda" else "tiny"
    for impl in ("fullshard", "fsdp2", "fullshard", "fsdp2"):  # alternated: drift hits both alike
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
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
        rows.append((impl, statistics.median(times), peak / 2**20))
        del model, optimizer
    return {"preset": preset, "steps": steps,
            **{impl: [min(r[1] for r in rows if r[0] == impl), max(r[2] for r in rows if r[0] == impl)]
               for impl in ("fullshard", "fsdp2")}}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    cuda = not args.cpu
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        os.environ["NCCL_HOSTID"] = f"fullshard-gpu-check-{rank}"  # every rank a "host" of its own on GPU 0
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300),  # a hang fails the check
                            device_id=device if cuda else None)
    log(rank, f"gpu_check: {world} rank(s) on {torch.cuda.get_device_name(device) if cuda else 'the CPU'}, "
              f"torch {torch.__version__}, backend {dist.get_backend()}")
    result = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "CPU",
              "torch": torch.__version__}
    if args.part == "parity":
        result["parity"] = parity(rank, world, device)
        result["parity"].append(background_save(rank, world, device, os.path.join(os.path.dirname(args.result),
                                                                                   "ckpt")))
        result["parity"] += [muon(rank, world, device, offload) for offload in (False, True)]
        result["parity"] += [repeatable(rank, world, device, kind) for kind in ("int8", "float8", "torchao")]
    else:
        result["bench"] = step_benchmark(rank, world, device, args.steps)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


def run_part(part: str, nproc: int, args: argparse.Namespace, result: str, deadline_s: float) -> dict | None:
    """One torchrun of the worker; what rank 0 recorded (None when it did not finish). Past
    `deadline_s` the torchrun and its ranks (one process group) are killed: a hang the process
    group's timeout does not cover (NCCL's bootstrap over loopback) costs the part, not the
    check."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"
    else:  # NCCL between "hosts" on this machine: sockets on loopback, no InfiniBand; GPU 0 alone visible
        env.update(NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1",
                   CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           "--worker", "--part", part, "--result", result, "--steps", str(args.steps)] + (["--cpu"] if args.cpu else [])
    launched = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        launched.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        print(f"gpu_check: the {part} part passed its deadline of {deadline_s:.0f} s: killed", flush=True)
        os.killpg(launched.pid, signal.SIGKILL)
        launched.wait()
    if not os.path.exists(result):
        return None
    with open(result) as f:
        return json.load(f)


def table(parity_run: dict | None, bench_run: dict | None) -> list[str]:
    """The check's one table: parity per precision at world 2, then the step at world 1."""
    lines = ["| check | result | figures |", "|---|---|---|"]
    if parity_run is None:
        lines.append("| parity, world 2 on one device | did not finish | see the output above |")
    else:
        records = parity_run["parity"]
        for precision in ("fp32", "bf16", "fp16", *LOW_PRECISION_REDUCTIONS):
            mine = [r for r in records if r["precision"] == precision]
            passed = sum(r["ok"] for r in mine)
            loss, param = (max(r[k] for r in mine) for k in ("loss", "param"))
            compute, _, sent = precision.partition("+")
            what = f"{compute}, gradients sent in {sent} (fp32 sum)" if sent else precision
            lines.append(f"| parity {what}, world 2 on one device ({parity_run['device']}) | {passed} of "
                         f"{len(mine)} pass | largest drift: loss {loss:.2e}, parameters {param:.2e} |")
        for r in records:
            if r["precision"] == "repeat":
                result = "not run" if r["detail"].startswith("not run") else "pass" if r["ok"] else "FAIL"
                lines.append(f"| {r['name']}, forward prefetch, world 2, run twice | {result} | {r['detail']} |")
            if r["precision"] == "muon":
                lines.append(f"| {r['name']}: against torch.optim.Muon, same gradients, 3 steps | "
                             f"{'pass' if r['ok'] else 'FAIL'} | {r['detail']} |")
            if r["precision"] == "save":
                lines.append(f"| save(block=False) right after optimizer.step(), a step while it writes, load | "
                             f"{'pass' if r['ok'] else 'FAIL'} | {r['detail']} |")
    if bench_run is None:
        lines.append("| step, world 1, against FSDP2 | did not finish | see the output above |")
    else:
        b = bench_run["bench"]
        (ours_s, ours_mb), (theirs_s, theirs_mb) = b["fullshard"], b["fsdp2"]
        lines.append(f"| {b['preset']} GPT bf16 step, world 1 ({bench_run['device']}), median of {b['steps']} | "
                     f"fullshard {ours_s * 1e3:.1f} ms, FSDP2 {theirs_s * 1e3:.1f} ms | step / FSDP2 "
                     f"{ours_s / theirs_s:.2f} |")
        if theirs_mb:
            lines.append(f"| {b['preset']} GPT bf16 max_memory_allocated, world 1 | fullshard {ours_mb:.0f} MB, "
                         f"FSDP2 {theirs_mb:.0f} MB | memory / FSDP2 {ours_mb / theirs_mb:.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU over gloo (checks this script)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per benchmark run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("parity", "bench"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}). Run it on a machine with a GPU, or pass --cpu to check the script on the CPU.")
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        parity_run = run_part("parity", 2, args, os.path.join(folder, "parity.json"), PARITY_DEADLINE_S)
        bench_run = run_part("bench", 1, args, os.path.join(folder, "bench.json"), BENCH_DEADLINE_S)
    print(f"\ngpu_check finished in {time.perf_counter() - start:.0f} s\n")
    print("\n".join(table(parity_run, bench_run)))
    ok = parity_run is not None and bench_run is not None and all(r["ok"] for r in parity_run["parity"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
