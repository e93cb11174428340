"""The GPU (CUDA + NCCL) paths of issue 15, checked on the CPU.

Memory and stream order come from fullshard/testing/stream_model.py (host memory, as CPU offload and
models built on the CPU have it, must never reach a collective or meet device memory in
an operation); the rest are the decisions the GPU paths take, tested directly.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fullshard
from fullshard import runtime
from fullshard.cli.config import TrainConfig, nonfinite_policy
from fullshard.reduce import Averaging, averaging
from fullshard.gpt import Block
from fullshard.hooks import units_under
from fullshard.mesh import check_local_gpu, compute_device
from fullshard.testing.stream_model import StreamModel
from tests.models import build, hf_llama, hf_loss, tiny_gpt, token_batch, train_modelled
from tests.reference import global_batches, local_slice

# ---- defect 2: CPU offload never hands host memory to NCCL ---------------------------------


def offload_nccl_job(strategy: str) -> list[str]:
    """CPU offload: accumulate with the all-reduce across replicas off (hybrid), pay it,
    clip, step, and take the full state dicts."""
    model_rt = StreamModel()
    with runtime.installed(model_rt), model_rt.tracking():
        model = build(strategy, "fp32", True, "prefetch", 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rank, world = dist.get_rank(), dist.get_world_size()
        for k, batch in enumerate(global_batches(token_batch, 2, 8)):
            model.set_requires_all_reduce(k == 1)  # the second backward pays the first's all-reduce
            model(*local_slice(batch, rank, world)).backward()
        fullshard.clip_grad_norm_(model, 1.0)
        optimizer.step()
        model_sd, optim_sd = fullshard.get_state_dict(model, optimizer)
    assert optim_sd["state"] and all(not isinstance(v, DTensor) for s in optim_sd["state"].values() for v in s.values())
    return model_rt.violations


@pytest.mark.parametrize("strategy", ["hybrid_f1", "full_shard"])
def test_cpu_offload_sends_only_device_memory(world2, strategy):
    for violations in world2.run(offload_nccl_job, strategy=strategy):
        assert not violations, "\n".join(violations[:8])


def offloaded_calls_job(path: str) -> dict[str, list[str]]:
    """Every public call that gathers or moves a CPU-offloaded model's values, with Muon's row
    shards in its optimizer state: each one's violations (host memory handed to a collective)."""
    from fullshard.optim import Muon, muon_groups

    model_rt = StreamModel()
    out = {}
    with runtime.installed(model_rt), model_rt.tracking():
        model = build("full_shard", "fp32", True, "prefetch")
        matrices, rest = muon_groups(model)
        optimizer = Muon([{"params": matrices}, {"params": rest, "use_muon": False}], lr=0.02)
        batch = local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())
        model(*batch).backward()
        optimizer.step()
        full, sharded = fullshard.get_state_dict(model, optimizer), fullshard.get_state_dict(model, optimizer, full=False)

        def evaluate():
            with fullshard.full_params(model, writeback=False):
                model(*batch)

        calls = {"get_state_dict": lambda: fullshard.get_state_dict(model, optimizer),
                 "get_state_dict(full=False)": lambda: fullshard.get_state_dict(model, optimizer, full=False),
                 "set_state_dict": lambda: fullshard.set_state_dict(model, optimizer, model_sd=full[0],
                                                                    optim_sd=full[1]),
                 "set_state_dict(full=False)": lambda: fullshard.set_state_dict(
                     model, optimizer, model_sd=sharded[0], optim_sd=sharded[1], full=False),
                 "full_params": evaluate,
                 "save": lambda: fullshard.save(path, model, optimizer),
                 "load": lambda: fullshard.load(path, model, optimizer),
                 "save(block=False)": lambda: fullshard.save(path, model, optimizer, block=False).result(),
                 "export": lambda: fullshard.export(model, path + "-export")}
        for name, call in calls.items():
            before = len(model_rt.violations)
            call()
            out[name] = model_rt.violations[before:]
    return out


def test_every_call_on_an_offloaded_model_sends_only_device_memory(world2, tmp_path):
    for got in world2.run(offloaded_calls_job, path=str(tmp_path / "ckpt")):
        assert {name: v[:2] for name, v in got.items() if v} == {}


# ---- defects 3 and 4: a model built on the CPU for GPUs ----------------------------------------


def cpu_built_job(model: str) -> dict:
    """Build on the CPU (host memory), shard with sync_module_states, train a step."""
    model_rt = StreamModel()
    with runtime.installed(model_rt), model_rt.tracking():
        torch.manual_seed(0)
        module = tiny_gpt() if model == "gpt" else hf_llama()
        model_rt.mark_host(*module.parameters(), *module.buffers())
        units = {Block} if model == "gpt" else {type(module.model.layers[0])}
        fullshard.shard_model(module, wrap=units, sync_module_states=True)
        batch = local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())
        loss = module(*batch) if model == "gpt" else hf_loss(module, batch)
        loss.backward()
        buffers_on_host = [name for name, b in module.named_buffers() if model_rt.is_host(b)]
    return {"violations": model_rt.violations, "buffers_on_host": buffers_on_host}


@pytest.mark.parametrize("model", ["gpt", "hf_llama"])
def test_a_model_built_on_the_cpu_moves_to_the_device(world2, model):
    # defect 3: sync_module_states broadcasts from device memory; defect 4: buffers (the
    # rotary inv_freq of Llama) go to the compute device with the parameters
    for got in world2.run(cpu_built_job, model=model):
        assert not got["violations"], "\n".join(got["violations"][:8])
        assert got["buffers_on_host"] == []


# ---- defect 5: fp16 overflow steps are the loss scaler's -----------------------------------------


def fp16_overflow_job() -> dict:
    torch.manual_seed(0)
    model = tiny_gpt()
    fullshard.shard_model(model, wrap={Block}, mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.float16))
    model.set_nonfinite_grads(nonfinite_policy(TrainConfig(precision="fp16")))  # as `fullshard train` does
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fullshard.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16 at once
    rank, world = dist.get_rank(), dist.get_world_size()
    scales = []
    for batch in global_batches(token_batch, 3, 8):
        scaler.scale(model(*local_slice(batch, rank, world))).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return {"scales": scales}


def test_fp16_training_lets_the_scaler_skip_overflow_steps(world2):
    for got in world2.run(fp16_overflow_job):
        # each overflowing step is skipped and halves the scale, on every rank
        assert got["scales"] == [2.0**39, 2.0**38, 2.0**37]
    assert nonfinite_policy(TrainConfig(precision="bf16")) == "raise"
    assert nonfinite_policy(TrainConfig(precision="fp32", nonfinite="off")) is None


# ---- defect 9: averaging ------------------------------------------------------------------------


def test_averaging_uses_nccl_avg_and_divides_fp16_first():
    avg, summed = torch.distributed.ReduceOp.AVG, torch.distributed.ReduceOp.SUM
    # NCCL averages inside the collectives: nothing left to divide, or the replicas whose
    # all-reduce is deferred (set_requires_all_reduce(False)); gloo sums, then divides
    assert averaging("nccl", torch.bfloat16, dp_size=8, summed_over=8, divide_by=8) == Averaging(False, avg, 1)
    assert averaging("nccl", torch.float32, dp_size=8, summed_over=4, divide_by=8) == Averaging(False, avg, 2)
    assert averaging("gloo", torch.bfloat16, dp_size=8, summed_over=8, divide_by=8) == Averaging(False, summed, 8)
    assert averaging("nccl", torch.float16, dp_size=8, summed_over=8, divide_by=8) == Averaging(True, summed, 1)
    assert averaging("nccl", torch.float32, dp_size=1, summed_over=1, divide_by=1) == Averaging(False, summed, 1)
    # set_gradient_divide_factor and set_force_sum_reduction_for_comms: NCCL's AVG divides by the
    # ranks it sums over, so another divisor (or sums only) sums and divides after
    assert averaging("nccl", torch.bfloat16, dp_size=8, summed_over=8, divide_by=2.5) == Averaging(False, summed, 2.5)
    assert averaging("nccl", torch.bfloat16, dp_size=8, summed_over=8, divide_by=8,
                     force_sum=True) == Averaging(False, summed, 8)
    assert averaging("nccl", torch.float16, dp_size=8, summed_over=8, divide_by=2.5) == Averaging(True, summed, 1)


def test_a_group_made_without_a_backend_averages_with_nccl_on_the_gpu(world2):
    """init_process_group() without a backend names its group "cpu:gloo,cuda:nccl": CUDA tensors
    go through NCCL, which averages; CPU tensors through gloo. The runtime reads the backend for
    the device (the averaging and the route choose by it), here on a real group of that kind."""
    from fullshard.runtime import device_backend

    assert device_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert device_backend("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert device_backend("nccl", "cuda") == "nccl" and device_backend("gloo", "cpu") == "gloo"
    backend = device_backend("cpu:gloo,cuda:nccl", "cuda")
    assert averaging(backend, torch.bfloat16, dp_size=8, summed_over=8, divide_by=8).op == dist.ReduceOp.AVG
    assert world2.run(mixed_backend_job) == ["gloo", "gloo"]


def mixed_backend_job() -> str:
    group = dist.new_group(backend="cpu:gloo,cuda:gloo")  # the mixed kind of name, runnable without a GPU
    from fullshard.runtime import Runtime

    assert "cpu:gloo" in str(dist.get_backend(group)), dist.get_backend(group)
    return Runtime().backend(group, torch.device("cpu"))


def bf16_rounding_job() -> dict:
    """bf16 gradients reduced over 4 ranks against their fp32 average rounded once."""
    torch.manual_seed(0)
    model = tiny_gpt()
    fullshard.shard_model(model, wrap={Block}, mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    rank, world = dist.get_rank(), dist.get_world_size()
    unit = units_under(model)[1]  # h.0
    contributed = []
    issue = unit.grads.issue

    def spy(*args) -> None:  # the full bf16 gradients this rank contributes
        contributed.extend(p.unsharded.grad.detach().clone() for p in unit.params)
        issue(*args)

    unit.grads.issue = spy
    model(*local_slice(global_batches(token_batch, 1, 8)[0], rank, world)).backward()
    differ = 0
    for p, grad in zip(unit.params, contributed):
        every = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(every, grad)
        total = every[rank].float()  # this rank's row first, then the peers' in rank order, as gloo adds them
        for r in range(world):
            if r != rank:
                total += every[r].float()
        want = (total / world).to(torch.bfloat16).float()
        rows = want if p.replicated else want[p.first_row : p.first_row + p.local_shape[0]]
        differ += int((p.sharded.grad.to_local() != rows).sum())
    return {"differ": differ}


def test_bf16_gradients_are_rounded_once(world4):
    # summed and divided in fp32, rounded to bf16 at the end: exactly the rounded average
    for got in world4.run(bf16_rounding_job):
        assert got["differ"] == 0, got


# ---- defect 6: waits on the GPU are stream waits; hangs are still named ---------------------


class Marker:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class FakeStream:
    """Stands for a CUDA stream: makes fullshard take its GPU paths (waits on the stream)."""

    def record_event(self) -> Marker:
        return Marker(True)


class StuckRuntime(runtime.Runtime):
    """The GPU runtime (on CPU tensors) whose stream never gets past the collectives of
    the unit named `stuck`: every other collective's marker is done."""

    def __init__(self, stuck: str) -> None:
        super().__init__()
        self.stuck = stuck
        self.armed = False  # until set: every collective finishes
        self.markers: list[Marker] = []
        self.next_stuck = False
        self.stream = FakeStream()

    def side_stream(self, device, purpose):
        return self.stream

    def host_memory(self, device) -> bool:
        return False  # a GPU's

    def backend(self, group, device) -> str:
        return "nccl"  # its collectives, whose waits are stream waits

    def current_stream(self, device):
        return self.stream

    def use(self, stream):
        return contextlib.nullcontext()

    def wait_stream(self, waiter, waited) -> None:
        pass

    def wait_works(self, works, *, timeout, what, on_device) -> None:
        self.next_stuck = self.armed and self.stuck in what
        super().wait_works(works, timeout=timeout, what=what, on_device=on_device)

    def marker(self) -> Marker:
        self.markers.append(Marker(not self.next_stuck))
        return self.markers[-1]

    def gpu(self) -> None:
        return None


def stuck_unit_job() -> dict:
    """h.0's all-gather never finishes on the (fake) GPU; the next wait, of another unit, raises."""
    torch.manual_seed(0)
    model = tiny_gpt()
    fullshard.shard_model(model, wrap={Block})
    batch = local_slice(global_batches(token_batch, 1, 4)[0], dist.get_rank(), dist.get_world_size())
    rt = StuckRuntime("unit 'h.0'")
    rt.watch.poll_s = 5.0  # the test scans itself, between the two forwards
    with runtime.installed(rt), torch.no_grad():  # the units' routes are chosen at their first gathers, here
        model(*batch)  # the first forward's check of the ranks' modes waits on the host: before the tiny timeout
        model.set_timeout(0.001)
        rt.armed = True
        model(*batch)  # every unit gathers; h.0's marker stays pending
        time.sleep(0.01)
        rt.watch.scan()  # what the watch's thread does every half second
        with pytest.raises(fullshard.FullShardError) as raised:
            model(*batch)  # the root's gather wait finds h.0's overdue
    stuck = [m for m in rt.markers if not m.done]
    for marker in stuck:  # let the thread see nothing left to watch
        marker.done = True
    thread = rt.watch.thread
    if thread is not None:
        rt.watch.wake.set()
        thread.join(timeout=5)
    return {"message": str(raised.value), "stuck": len(stuck), "thread_alive": thread is not None and thread.is_alive()}


def test_a_hang_on_the_gpu_names_the_stuck_unit(world2):
    for got in world2.run(stuck_unit_job):
        assert got["stuck"] == 1
        # the error names the overdue all-gather of h.0, not the unit whose wait found it
        assert "the all-gather of unit 'h.0' of model " in got["message"] and " at step " in got["message"], got["message"]
        assert "did not finish within 0.001 s" in got["message"], got["message"]
        assert "unit ''" not in got["message"], got["message"]
        assert not got["thread_alive"]


def test_host_waits_are_bounded():
    rt = runtime.Runtime()
    with pytest.raises(runtime.CollectiveError, match="the flags did not finish within 0.01 s"):
        rt.sync_event(Marker(False), timeout=timedelta(seconds=0.01), what="the flags")
    rt.watch.overdue = "the reduce-scatter of unit 'h.1' at step 2 did not finish within 5 s"
    with pytest.raises(runtime.OverdueCollective, match="unit 'h.1' at step 2"):
        rt.sync_event(Marker(False), timeout=timedelta(seconds=5), what="the flags")
    rt.sync_event(Marker(True), timeout=timedelta(seconds=5), what="the flags")


# ---- defect 7: the all-reduce across replicas follows its reduce-scatter at once ------------------


def issue_order_job() -> list[tuple[str, str]]:
    model_rt = StreamModel()
    with runtime.installed(model_rt):
        model = build("hybrid_f2", "fp32", False, "prefetch", 2)
        train_modelled(model, model_rt, "fp32", "prefetch", steps=1)
    return [(stream, "reduce-scatter" if "(reduce)" in site else "all-reduce")
            for stream, site in model_rt.issued if "routes.py" in site and ("(reduce)" in site or "(all_reduce)" in site)]


def test_hybrid_all_reduce_is_issued_right_after_its_reduce_scatter(world4):
    for issued in world4.run(issue_order_job):
        # 3 units: each reduce-scatter (reduce stream) is followed by its all-reduce on the
        # all-reduce stream, before the next unit's reduce-scatter
        assert issued == [("reduce", "reduce-scatter"), ("all_reduce", "all-reduce")] * 3, issued


# ---- defect 10: one GPU per rank ----------------------------------------------------------------


def test_a_rank_on_another_ranks_gpu_is_refused(monkeypatch):
    with pytest.raises(fullshard.FullShardError, match="LOCAL_RANK=1 but computes on cuda:0"):
        check_local_gpu(0, "1", 8)
    check_local_gpu(0, "3", 1)  # one visible GPU per rank (CUDA_VISIBLE_DEVICES): it is this rank's
    check_local_gpu(2, "2", 8)
    check_local_gpu(1, "5", 4)  # several ranks per visible GPU set: LOCAL_RANK modulo the GPUs seen
    with pytest.raises(fullshard.FullShardError, match="LOCAL_RANK=5 but computes on cuda:0 .*not cuda:1"):
        check_local_gpu(0, "5", 4)
    check_local_gpu(0, None, 8)  # not launched by torchrun: nothing to check against
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(fullshard.FullShardError, match="torch.cuda.set_device"):
        compute_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert compute_device("cuda") == torch.device("cuda", 0)
