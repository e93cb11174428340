"""One rank of one replica group of `fullshard train --fault-tolerant`, top-down: join the
group, build and shard the GPT, join torchft's quorum through fullshard.ft, resume, train
until --steps steps have committed (with --sync-every: DiLoCo's loop, replica_diloco.py),
report (Note [replica groups] in launcher.py).

Note [replica rows]: each committed step is logged once, by rank 0 of the group in place 0 of
that step's quorum (a healing group takes no place), with the step's participants; the groups
take turns appending to metrics.jsonl. A group's batch is its place's part of the step's
global batch, so a step with fewer groups trains on fewer sequences.

Note [rejoining first]: a group restarted while another is alive must heal from it before it
trains. torchft's lighthouse keeps a lone restarted group out of a quorum while the live one
heartbeats, but a live group whose heartbeat lapses (a stalled host) lets the restarted one
form a quorum alone, at its own step, behind the run: it would train and log steps that were
committed already, and then heal the live group back to them. So a rejoining group takes no
step in a quorum of itself alone at its starting step: it asks again until a group is there
to heal from, for up to 3 x --timeout seconds (a live group may spend --timeout in the
collective the dead group left, another in a heal sent to it, another forming the next
quorum); after that no group is alive to wait for, and it goes on from its checkpoint, as a
whole restart does.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fullshard
from fullshard import ft
from fullshard.cli.config import TrainConfig, gpt_dims
from fullshard.cli.launcher import REJOINING, REPLICA, report_healed
from fullshard.cli.replica_diloco import diloco_loop
from fullshard.cli.run_log import append_log
from fullshard.cli.trainer import (Run, build, diloco, diloco_setting, evaluate, join_job, report, sample, share,
                                   start_rank, train_step)


def train_replica(cfg: TrainConfig) -> int:
    """This rank's whole run; its exit status (a FullShardError propagates: status 3)."""
    start_rank()
    out, group = Path(cfg.out), int(os.environ[REPLICA])
    rank, world, device = join_job(cfg)
    run, description = build(cfg, rank, world, device)
    manager = join_quorum(run, group)
    ckpt = out / "checkpoint" / f"replica_{group}"
    resume(run, manager, ckpt)
    if rank == 0 and group == 0:
        print(description + f"; {cfg.replicas} replica groups of {world} ranks, fault tolerant (torchft)" +
              (f"; DiLoCo {diloco_setting(cfg)}" if cfg.sync_every else ""), flush=True)
    log = append_log(out) if rank == 0 else None
    logged = (diloco_loop(run, manager, log, ckpt, group) if cfg.sync_every else train_loop(run, manager, log, ckpt))
    text = sample(run)
    share(torch.zeros(1, device=device), timeout=run.timeout, what="the barrier at the end of the run")
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    if log is not None:
        log.close()
        if logged:  # the group that logged the last step reports
            report(cfg, out, text)
    return 0


def join_quorum(run: Run, group: int) -> ft.Manager:
    """This group's TCPStore (served by its rank 0 on --ft-bind) and torchft Manager, the model
    and optimizer attached (with --sync-every: the optimizer wrapped in DiLoCo on the Manager)."""
    cfg, timeout = run.cfg, run.timeout
    store = ft.replica_store(cfg.ft_bind, 0, is_master=True, timeout=timeout) if run.rank == 0 else None
    port = torch.tensor([store.port if store is not None else 0], device=run.device)
    port = int(share(port, timeout=timeout, what="the broadcast of the replica group's store port")[0])
    if store is None:
        store = ft.replica_store(cfg.ft_bind, port, is_master=False, timeout=timeout)
    manager = ft.Manager(bind=cfg.ft_bind, replica_id=f"replica_{group}", lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
                         rank=run.rank, world_size=run.world, store_addr=cfg.ft_bind, store_port=port, timeout=timeout,
                         quorum_timeout=timeout, connect_timeout=timeout, init_sync=not cfg.sync_every)
    manager.replica_store = store  # the group's rank 0 serves it for the Manager's life
    if cfg.sync_every:
        run.optimizer = diloco(run.model, run.optimizer, cfg, ft.ManagedReplicas(manager))
    else:
        ft.attach(manager, run.model, run.optimizer)
    return manager


def resume(run: Run, manager: ft.Manager, ckpt: Path) -> None:
    """This group's newest checkpoint, if any (--resume): its step becomes torchft's (with
    --sync-every: the syncs it had committed). A live group further on heals this one at the
    first quorum anyway; under DiLoCo a group restarted while another lives starts from nothing,
    so that it is behind and heals at its first sync (Note [diloco rows] in replica_diloco.py)."""
    rejoining = os.environ.get(REJOINING) == "1" and run.cfg.sync_every
    if rejoining or not (run.cfg.resume and (ckpt / "LATEST").is_file()):
        return
    info = fullshard.load(ckpt, run.model, run.optimizer)
    extra = info["extra"] if isinstance(info["extra"], dict) else {}
    manager.load_state_dict({"step": extra.get("syncs", info["step"]),
                             "batches_committed": extra.get("batches_committed", 0)})


def train_loop(run: Run, manager: ft.Manager, log, ckpt: Path) -> bool:
    """Until --steps steps have committed: a step each time, a row for each committed one
    (Note [replica rows]), validation and checkpoints by the committed step. Whether this
    group logged the last step."""
    cfg = run.cfg
    comm_stats = fullshard.stats(run.model)
    saving, last, logged = None, time.perf_counter(), False
    rejoining = os.environ.get(REJOINING) == "1"
    start, deadline = manager.current_step(), time.monotonic() + 3 * cfg.timeout
    while manager.current_step() < cfg.steps:
        manager.start_quorum()
        manager.wait_quorum()
        step = manager.current_step()  # a healed group's is the live group's
        if rejoining and step == start and manager.num_participants() <= 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # alone, behind the run: no step until a live group is there (Note [rejoining first])
            continue
        if rejoining:  # healed (or alone for good): before this step, which the live groups cannot commit without it
            report_healed()
            rejoining = False
        writer = manager.participating_rank() == 0 and log is not None
        record = train_step(run, step, comm_stats, manager)
        if manager.current_step() == step:  # not committed: redone with the next quorum
            continue
        done = step + 1
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            record["val_loss"] = evaluate(run)
        now = time.perf_counter()
        record.update(participants=manager.num_participants(), step_s=round(now - last, 4))
        logged = writer
        if writer:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if (cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == cfg.steps:
            saving = fullshard.save(ckpt, run.model, run.optimizer, step=done, block=not cfg.background_saves,
                                    extra={"preset": cfg.preset, "dims": gpt_dims(cfg),
                                           "batches_committed": manager.batches_committed()})
        last = now
    if saving is not None:
        saving.result()
    return logged
