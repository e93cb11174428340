"""benchmarks/gpu_check.py, the check a lent GPU runs, run here on the stream model: its own
code (not only the library's) must move nothing NCCL cannot send. Its Muon check gathered
offloaded gradients from host memory with `DTensor.full_tensor()`, which NCCL refused on the
first GPU it met ("No backend type associated with device type cpu"); the CPU runs of the
check, on gloo, cannot see that, the stream model can (it pretends to be a GPU and marks
offloaded shards as host memory)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fullshard import runtime
from fullshard.testing.stream_model import StreamModel


def gpu_check_parts() -> dict[str, dict]:
    """The parts of the check that handle CPU-offloaded values, each on a stream model:
    Muon against torch.optim.Muon (with and without offload), and the parity runs with
    offload (training, clipping, the full state dict)."""
    from benchmarks import gpu_check

    rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    every = gpu_check.configs
    parts = {"muon": lambda: [gpu_check.muon(rank, world, device, offload) for offload in (False, True)],
             "parity with offload": lambda: gpu_check.parity(rank, world, device)}
    out = {}
    try:
        gpu_check.configs = lambda n: [c for c in every(n) if c[3] and c[2] == "fp32"]
        for name, run in parts.items():
            model_rt = StreamModel()
            with runtime.installed(model_rt), model_rt.tracking():
                records = run()
            out[name] = {"violations": model_rt.violations, "passed": [r["ok"] for r in records]}
    finally:
        gpu_check.configs = every
    return out


def test_the_gpu_check_sends_device_memory_only(world2):
    for got in world2.run(gpu_check_parts):
        assert got["muon"]["passed"] == [True, True]
        assert got["parity with offload"]["passed"] == [True, True]  # full_shard and hybrid_shard 1
        for name, part in got.items():
            assert part["violations"] == [], f"{name}:\n" + "\n".join(part["violations"][:4])
