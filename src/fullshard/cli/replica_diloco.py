"""The training loop of one rank of `fullshard train --fault-tolerant --replicas R --sync-every H`:
the replica group trains alone on its share of each global batch, and DiLoCo's syncs run on
torchft's Manager (Note [managed syncs] in fullshard/ft/diloco.py).

Note [diloco rows]: metrics.jsonl holds each inner step once. A group keeps its rows since its
last sync; when a sync commits, the group in place 0 of that sync's quorum writes them, each
with the sync's participants (a group that healed in it takes no place). A group lost between
syncs loses its kept rows, and the group in place 0 at the next sync writes its own for those
steps. A group that heals drops its rows, and the step it took (the live groups' replace
them); a group restarted while another lives starts from nothing rather than its checkpoint,
so that it is behind, and joins the live groups' next sync before any step of its own: it
heals in it (sending nothing the others average) and goes on from their step. The rows after
the last sync are written by the group in place 0 of that sync. The validation loss is that
group's own model's. Such a restarted group that is alone at a sync (the live groups finished before it was up, or
their heartbeats lapsed) is behind the run, on steps the live groups logged: until a sync with
another group it writes no rows and no checkpoint (which would replace its group's newest with
a model trained from nothing); the launcher ends it once the others finished (Note [replica
groups]).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fullshard
from fullshard import ft
from fullshard.cli.config import gpt_dims
from fullshard.cli.launcher import REJOINING, report_healed
from fullshard.cli.trainer import Run, evaluate, train_step


def diloco_loop(run: Run, manager: ft.Manager, log, ckpt: Path, group: int) -> bool:
    """Inner steps until --steps, a row kept for each (Note [diloco rows]), validation and
    checkpoints by the inner step. Whether this group wrote the last rows."""
    cfg, diloco = run.cfg, run.optimizer
    comm_stats = fullshard.stats(run.model)
    kept: list[dict] = []
    saving, last, logged = None, time.perf_counter(), False
    rejoining = os.environ.get(REJOINING) == "1"  # from nothing, behind the run, until a sync with company
    if rejoining:  # take part in the live groups' next sync now, healing in it, not after H steps of its own
        diloco.sync_managed()
        rejoining = diloco.steps == 0  # not healed: alone
        if not rejoining:
            report_healed()
    while diloco.steps < cfg.steps:
        step, syncs = diloco.steps, manager.current_step()
        record = train_step(run, step, comm_stats, part=(group, cfg.replicas))
        done = diloco.steps
        if done != step + 1:  # healed in this step's sync: the live groups' state and step replace ours
            kept = []
        else:
            if done % cfg.eval_interval == 0 or done == cfg.steps:
                record["val_loss"] = evaluate(run)
            now = time.perf_counter()
            record["step_s"] = round(now - last, 4)
            last = now
            kept.append(record)
        synced = manager.current_step() > syncs
        if rejoining and (done != step + 1 or synced and diloco.participants > 1):  # healed, or synced with company
            report_healed()
            rejoining = False
        if synced and rejoining:  # alone: the live groups logged these steps
            kept = []
        elif synced or (done == cfg.steps and not rejoining):
            place = manager.participating_rank() if manager.current_step() else group  # before any sync: its own
            writer = place == 0 and log is not None
            for row in kept:
                row["participants"] = diloco.participants
                if writer:
                    log.write(json.dumps(row) + "\n")
            if writer:
                log.flush()
            logged, kept = writer and bool(kept), []
        if not rejoining and ((cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == cfg.steps):
            saving = fullshard.save(ckpt, run.model, diloco, step=done, block=not cfg.background_saves,
                                    extra={"preset": cfg.preset, "dims": gpt_dims(cfg), "syncs": manager.current_step(),
                                           "batches_committed": manager.batches_committed()})
    if saving is not None:
        saving.result()
    return logged
