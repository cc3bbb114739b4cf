#!/usr/bin/env bash
# The main job, end to end on this machine: a 4-rank DDP job logging offline, then wbmerge.
set -euo pipefail
out="${1:-./wbmerge-demo}"
rm -rf "$out/wandb"
mkdir -p "$out"
echo "== training: torchrun, 4 ranks, every rank writes an offline W&B run under $out/wandb"
WANDB_SILENT=true python -m torch.distributed.run --standalone --nproc-per-node 4 \
    "$(dirname "$0")/ddp_train.py" --dir "$out" --steps 40 > "$out/train.log" 2>&1 \
    || { tail -30 "$out/train.log"; exit 1; }
echo "== wbmerge inspect $out/wandb"
wbmerge inspect "$out/wandb"
