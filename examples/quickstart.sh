#!/usr/bin/env bash
# The main job, end to end on this machine, no account and no network:
#   1. the built-in local W&B-compatible sink on 127.0.0.1
#   2. a real 4-rank torchrun DDP job (gloo, CPU); every rank writes an offline W&B run
#   3. wbmerge report: per-rank skew, from the offline runs alone
#   4. wbmerge sync --run-mode shared: all ranks merged into one run, uploaded by `wandb sync`
#   5. the links, which open on the sink's own pages
set -euo pipefail
out="${1:-./wbmerge-demo}"  # the demo's own folder (or one it marked): its runs are replaced
port="${WBMERGE_SINK_PORT:-8765}"
if [ $# -gt 0 ] && [ -e "$out/wandb" ] && [ ! -e "$out/.wbmerge-demo" ]; then
    echo "quickstart: $out/wandb was not made by this script and is left as it is;" \
        "name an empty folder: bash $0 FOLDER" >&2
    exit 2
fi
mkdir -p "$out"
touch "$out/.wbmerge-demo"
rm -rf "$out/wandb"

# Up when anything answers; the sink answers 401 without its key.
sink_up() { python -c "import urllib.request as u, urllib.error as e
try: u.urlopen('http://127.0.0.1:$port/', timeout=2)
except e.HTTPError: pass" 2>/dev/null; }
sink_pid=""
if ! sink_up; then
    # umask 077: the sink's start-up lines (in sink.log) hold its key.
    ( umask 077; exec wbmerge sink serve --port "$port" --data "$out/sink" > "$out/sink.log" 2>&1 ) &
    sink_pid=$!
    for _ in $(seq 100); do sink_up && break; sleep 0.1; done
    sink_up || { cat "$out/sink.log"; exit 1; }
    echo "== the local sink runs on http://127.0.0.1:$port (pid $sink_pid; data in $out/sink)"
fi
# The sink's own key, made on its first start; a sink started elsewhere needs the key it printed.
if [ -r "$out/sink/api-key" ]; then
    WANDB_API_KEY="$(cat "$out/sink/api-key")"
elif [ -z "${WANDB_API_KEY:-}" ]; then
    echo "quickstart: a sink already runs on port $port; set WANDB_API_KEY to the key" \
        "its \`wbmerge sink serve\` printed" >&2
    exit 2
fi
export WANDB_BASE_URL="http://127.0.0.1:$port" WANDB_API_KEY
export WBMERGE_STATE_DIR="$out/state"

echo "== training: torchrun, 4 ranks, offline W&B runs under $out/wandb"
WANDB_SILENT=true python -m torch.distributed.run --standalone --nproc-per-node 4 \
    "$(dirname "$0")/ddp_train.py" --dir "$out" --steps 40 --slow-rank 3 > "$out/train.log" 2>&1 \
    || { tail -30 "$out/train.log"; exit 1; }
wbmerge inspect "$out/wandb"
echo "== wbmerge report: which rank is slow? (from the offline runs alone)"
wbmerge report "$out/wandb" -m train/samples_per_sec -m train/loss

echo "== wbmerge sync --run-mode shared $out/wandb"
wbmerge sync --run-mode shared --skew-metrics "$out/wandb"
echo "== in a browser, sign in as user api with the sink's key (WANDB_API_KEY=$WANDB_API_KEY),"
echo "   or open http://api:$WANDB_API_KEY@127.0.0.1:$port/ (the key is in $out/sink/api-key)"
if [ -n "$sink_pid" ]; then
    echo "== open the link above in a browser; the sink keeps running (pid $sink_pid; stop it with: kill $sink_pid)"
else
    echo "== open the link above in a browser; the sink was already running (stop it with: kill PID, the pid its start-up line printed)"
fi
