#!/bin/bash
# The runs of docs/diloco.md's table on the CLI's small GPT: bash benchmarks/diloco_cli_runs.sh (about 55 min on 2 cores)
# (the outputs in /tmp/dl; benchmarks/loss_curves.py makes the table)
cd "$(dirname "$0")/.."
common="--preset small --steps 300 --eval-interval 50 --sample-bytes 0 --ckpt-interval 0 --no-resume"
for seed in 0 1 2; do
  for cfg in "sync|--nproc 2 --strategy no_shard" \
             "H10|--nproc 2 --replicas 2 --sync-every 10" \
             "H50|--nproc 2 --replicas 2 --sync-every 50" \
             "H100|--nproc 2 --replicas 2 --sync-every 100" \
             "H50int8|--nproc 2 --replicas 2 --sync-every 50 --outer-dtype int8" \
             "H50K4int8|--nproc 2 --replicas 2 --sync-every 50 --fragments 4 --outer-dtype int8" \
             "H50avg|--nproc 2 --replicas 2 --sync-every 50 --outer-lr 1 --outer-momentum 0" \
             "alone|--nproc 1 --global-batch 8"; do
    name=${cfg%%|*}; args=${cfg#*|}
    out=/tmp/dl/${name}_s${seed}
    rm -rf $out
    start=$(date +%s)
    .venv/bin/python -m fullshard.cli train $common $args --seed $seed --out $out > $out.log 2>&1
    echo "$name seed $seed rc $? $(( $(date +%s) - start )) s" >> /tmp/dl/progress.txt
  done
done
echo DONE >> /tmp/dl/progress.txt
