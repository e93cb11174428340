"""One rank of a DiLoCo replica group on torchft, for tests/test_diloco_ft.py: forked by
tests/replicas.py's Replicas (target=diloco_rank), its model test_diloco's three-block net on
that replica's batches, DiLoCo's syncs on torchft's Manager (Note [managed syncs]).

After each inner step a rank reports a row: the inner step, whether a sync committed in it
(the Manager's step rose), the participants of the last sync, whether this rank healed (its
inner step jumped), and a digest of each fragment's parameters. A rank can be told to SIGKILL
itself in the forward of an inner step, or inside the all-gather of a sync; to put a NaN in
its shard before a sync; to hold before an
inner step until the test releases it; and to report DiLoCo's state before each try of a sync.
Every rank reports "ready" once DiLoCo is built and takes its first step once the test says go.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from tests.replicas import QUIET, TIMEOUT_S, kill_here


def shards_digest(tensors) -> str:
    import torch
    from torch.distributed.tensor import DTensor
    h = hashlib.sha256()
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        h.update(local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def state_digest(model, diloco) -> str:
    """The parameters and DiLoCo's whole state (inner and outer, anchors, step), hashed."""
    import torch
    tensors = [p for p in model.parameters()]
    for p in tensors[:]:
        tensors += [v for _, v in sorted(diloco.state[p].items()) if isinstance(v, torch.Tensor)]
    return shards_digest(tensors)


def diloco_rank(cfg: dict[str, Any], reports: mp.Queue) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **QUIET})
    import torch
    import torch.distributed as dist

    import fullshard
    from fullshard import ft
    from tests.reference import full_state
    from tests.test_diloco import inner_step, sharded

    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S)
    rank, size, bind, replica = cfg["group_rank"], cfg["group_size"], cfg["bind"], cfg["replica"]
    store = ft.replica_store(bind, cfg["store_port"], is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=size,
                            timeout=timeout)
    model = sharded(None)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ft.Manager(bind=bind, replica_id=f"replica_{replica}", lighthouse_addr=cfg["lighthouse"], rank=rank,
                         world_size=size, store_addr=bind, store_port=store.port, timeout=timeout,
                         quorum_timeout=timeout, connect_timeout=timeout, init_sync=cfg.get("init_sync", False),
                         heartbeat_interval=timedelta(milliseconds=100))
    try:
        if cfg.get("refusals"):  # what a hostile user may try, each refused by name before anything runs
            said = []
            try:
                fullshard.DiLoCo(model, inner, ft.ManagedReplicas(manager), sync_every=2, overlap=True)
            except fullshard.FullShardError as e:
                said.append(str(e))
        diloco = fullshard.DiLoCo(model, inner, ft.ManagedReplicas(manager), sync_every=cfg["sync_every"],
                                  fragments=cfg.get("fragments", 1),
                                  outer_dtype=getattr(torch, cfg.get("outer_dtype", "float32")))
        if cfg.get("refusals"):
            try:
                ft.attach(manager, model, inner)
            except fullshard.FullShardError as e:
                said.append(str(e))
            reports.put(("refused", replica, rank, said))
        kill, tries = cfg.get("kill"), []  # kill: {"where": "forward" | "sync", "at": inner step}
        begin, gather = diloco.replicas.begin, manager.all_gather

        def traced_begin(layout):  # DiLoCo's whole state at the start of each try of a sync
            tries.append({"step": diloco.steps, "state": state_digest(model, diloco)})
            return begin(layout)

        def killing_gather(*args):
            if kill and kill["where"] == "sync" and diloco.steps == kill["at"]:
                kill_here(cfg)
            return gather(*args)

        diloco.replicas.begin, manager.all_gather = traced_begin, killing_gather
        model[1].register_forward_pre_hook(lambda *_: kill_here(cfg) if kill and kill["where"] == "forward" and
                                           diloco.steps + 1 == kill["at"] else None)
        reports.put(("ready", replica, rank, None))
        while not cfg["go"].value:  # every group is up before any takes a step: the first sync takes them all
            time.sleep(0.02)
        while diloco.steps < min(cfg["steps"], cfg["stop"].value):
            while cfg.get("hold_at") == diloco.steps and not cfg["gate"].value:
                time.sleep(0.02)  # the test restarts another group meanwhile
            before, syncs, tries[:] = diloco.steps, manager.current_step(), []
            inner_step(model, replica, diloco.steps + 1, rank, size)
            if cfg.get("poison_at") == diloco.steps + 1:  # a NaN in this rank's shard before the sync
                with torch.no_grad():
                    model[0][0].weight.to_local()[0, 0] = float("nan")
            diloco.step()
            diloco.zero_grad()
            reports.put(("row", replica, rank, {
                "step": diloco.steps, "healed": diloco.steps != before + 1, "synced": manager.current_step() > syncs,
                "participants": diloco.participants, "tries": list(tries), "state": state_digest(model, diloco),
                "fragments": [shards_digest(p.sharded for p in f.params) for f in diloco.fragments]}))
        reports.put(("final", replica, rank, {"params": {k: v.tolist() for k, v in full_state(model).items()},
                                              "names": [f.names for f in diloco.fragments],
                                              "phases": [f.phase for f in diloco.fragments]}))
    except fullshard.FullShardError as e:
        reports.put(("error", replica, rank, str(e)))
        raise
    reports.put(("done", replica, rank, None))
    deadline = time.monotonic() + 60
    while not cfg["release"].value and time.monotonic() < deadline:
        time.sleep(0.05)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
