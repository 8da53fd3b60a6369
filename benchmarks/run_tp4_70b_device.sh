#!/usr/bin/env bash
# Issue 43, part 2, ONE nvidia-h100-x4 call (< 9 min): a Llama-3-70B-shaped model (random bf16,
# 80 layers = 141 GB, written on the device by one process per GPU into /dev/shm when it has
# room, else /tmp; never carried) served with tensor parallelism (benchmarks/tp_scale.py and
# benchmarks/harness/scale.py say what is measured):
#   TP=4 decode with CUDA graphs at batch 1 / 64 / 256 for 8, 16 and 80 layers (per-layer fit),
#   against the per-GPU roofline (a rank's bytes per step / copy bandwidth + the measured
#   collectives); TP=2 (GPUs 0, 1) at 8 and 16 layers for the batch-1 speed-up; each rank's join,
#   load, host memory while loading, first-step tuning and graph-capture seconds; then
#   `tokenwire launch --num-shard 4` with the harness's 1,000-request workload (req/s, TTFT, ITL),
#   its start-up seconds, the shards' start-up log lines and their host memory while they load.
# Every part is saved when it ends; a part that would not fit the time is reported as not run.
# Outputs under $OUT: RESULTS.md (printed last), results.json, env.txt, logs.tar.gz (the driver's
# log, the launch log of the e2e run, `free -g` every 10 s).
# Call: bash benchmarks/run_tp4_70b_device.sh [extra benchmarks.tp_scale flags]
#   (carry .whl-tw; run with timeout_s 600). Knobs: TIMEOUT_S (python's limit, default 500).
# Dry run without GPUs (CPU, gloo, a small model of the same structure, 8 requests):
#   FAKE=1 OUT=/tmp/o bash benchmarks/run_tp4_70b_device.sh
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
OUT=${OUT:?set OUT}
work=${WORK:-/tmp/tp70_run}
rm -rf "$work"; mkdir -p "$work"
{
  date -u; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,clocks.sm --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -8
  df -h /dev/shm /tmp 2>&1; free -g; nproc
  python3 -c "import torch, triton, safetensors; print('torch', torch.__version__, 'triton', triton.__version__, 'safetensors', safetensors.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
( while :; do echo "$(date +%T) $(free -g | awk '/Mem:/ {print "used", $3, "GiB; shared", $5, "GiB; buff/cache", $6, "GiB; available", $7, "GiB"}')"; sleep 10; done ) > "$work/free.log" 2>&1 &
sampler=$!
if [ "${FAKE:-0}" != 0 ]; then
  set -- --fake --layers 8 --tp4-layers 4,8 --tp2-layers 4,8 --batches 1,4 --tp2-batches 1 \
    --context 64 --requests 8 --workdir /tmp/tw70b_fake "$@"
fi
# One GEMV tuning cache for every part (the TP=4 ranks measure a shape once between them; the
# e2e deployment reads what the TP=4 part measured). Fresh per call (under $work) unless
# TUNING_CACHE_DIR names one, so the parts' first-step seconds show a cold tuning.
timeout -k 20 "${TIMEOUT_S:-500}" python3 -m benchmarks.tp_scale --out "$work/out" \
  --tuning-cache-dir "${TUNING_CACHE_DIR:-$work/gemv_tuning}" "$@" 2>&1 \
  | grep --line-buffered -v -i -E "warn|Loading weights|^\s*$|enable\(" | tee "$work/tp_scale.log"
echo "driver exit: ${PIPESTATUS[0]} (124: TIMEOUT_S reached; parts saved before it are kept)"
kill "$sampler" 2>/dev/null
# A deployment of this run's model left by a killed driver (it runs in its own session): stop
# its process group (the launcher's pid).
for pid in $(pgrep -f "service.app.cli launch --model-id [^ ]*tw70b[^ ]*/llama3-70b-shape" 2>/dev/null); do
  kill -TERM -- "-$pid" 2>/dev/null
done
cp "$work/out/results.json" "$work/out/RESULTS.md" "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tar.gz" -C "$work" tp_scale.log free.log $(cd "$work" && ls out/*.log 2>/dev/null)
echo "=================== RESULTS.md ==================="
cat "$OUT/RESULTS.md" 2>/dev/null || echo "no RESULTS.md (see tp_scale.log in logs.tar.gz)"
