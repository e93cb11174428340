"""The frameworks users train with, with fullshard in FSDP2's place: each trains (or, for
torchtitan, runs forward) on 2 gloo ranks with torch's FSDP2 and with fullshard, and every
loss, every final parameter and the framework's own checkpoint resume must be bitwise equal
(integrations/run.py has the recipes; docs/integrations.md, the recipes in short)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FRAMEWORKS = ["fabric", "lightning", "accelerate", "accelerate-peft", "hf-trainer", "hf-trainer-peft", "torchtitan"]
# fullshard's reduce-scatters over the 4 steps: one per unit and optimizer step (3 units:
# 2 decoder layers and the root; with LoRA the root trains nothing) when the framework's
# accumulation skips the reductions of all but the last micro-batch, twice that when not
REDUCTIONS = {"fabric": 12, "accelerate": 12, "accelerate-peft": 8}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_trains_on_fullshard_bitwise_as_on_fsdp2(framework, tmp_path):
    out = tmp_path / "result.json"
    root = HERE.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), str(root / "src"), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(HERE / "run.py"), framework, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    theirs, ours = got["torch"], got["fullshard"]
    assert theirs["sharded by"] == "torch" and ours["sharded by"] == "fullshard"
    assert ours["losses"] == theirs["losses"] and ours["resumed"] == theirs["resumed"]  # bitwise
    assert ours["params"] == theirs["params"] and ours["resumed_params"] == theirs["resumed_params"]
    # the framework's checkpoint resumes the run exactly, with either
    assert ours["resumed_params"] == ours["params"] and ours["resumed"] == ours["losses"][-len(ours["resumed"]):]
    if framework in REDUCTIONS:
        assert ours["reductions"] == [REDUCTIONS[framework]]
    if framework == "torchtitan":  # its gradient scaling: a sum, not a mean, in every unit
        assert ours["divide factors"] and set(ours["divide factors"]) == {1.0}
