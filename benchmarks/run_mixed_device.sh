#!/usr/bin/env bash
# Issue 44 item 1 on the GPU machine: mixed prefill + decode steps, and the served workload's
# scheduling knobs, measured (carry [".whl-tw"]; outputs under $OUT):
#
#   bash benchmarks/run_mixed_device.sh micro
#       the harness's checkpoint in /tmp/twb (kept while the machine stays warm), the mixed-step
#       attention micro-benchmark (benchmarks/mixed_step_bench.py: whole batch through the
#       prefill kernel vs the split) and tests/gpu/test_mixed_step_cuda.py (~1.5 min)
#   bash benchmarks/run_mixed_device.sh e2e NAME MAX_BATCH "LAUNCH ARGS" [profile]
#       the harness's e2e part (1,000 requests at once, overlap on) with `--max-batch-size
#       MAX_BATCH` and the extra launch arguments; `profile`: the shard records its steps
#       (kind, device time, gaps: results.json's shard_profile; steps.json copied) (~1-1.5 min)
#
# Several calls of this script chain in one device command (see benchmarks/RESULTS.md's issue-44
# section for the sequences used).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/mixed-out}
mkdir -p "$OUT"
commit=${COMMIT:-unknown}

case "${1:-}" in
micro)
  timeout 300 python3 -c "from pathlib import Path; from shard.testing.checkpoint import write_checkpoint; print(write_checkpoint(Path('/tmp/twb/llama3-8b-shape-32l'), 32, 'llama'))" \
    > "$OUT/checkpoint.log" 2>&1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
  timeout 240 python3 benchmarks/mixed_step_bench.py --out "$OUT" > "$OUT/mixed_step_bench.log" 2>&1
  tail -9 "$OUT/mixed_step_bench.log"
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_mixed_step_cuda.py > "$OUT/gpu_test_mixed.log" 2>&1
  tail -2 "$OUT/gpu_test_mixed.log" ;;
e2e)
  name=${2:?usage: e2e NAME MAX_BATCH "ARGS" [profile]}
  batch=${3:?}
  extra=${4:-}
  profile=none
  [ "${5:-}" = profile ] && profile=0
  dir="$OUT/$name"
  mkdir -p "$dir"
  rm -rf /tmp/twb/profiles
  timeout 300 python3 -m benchmarks.harness --parts e2e --e2e-overlap on \
    --e2e-profile-from-step $profile --workdir /tmp/twb --out "$dir" --commit "$commit" \
    --e2e-max-batch-size "$batch" --e2e-launch-args "$extra" ${DUMP_STREAMS:+--e2e-dump-streams} > "$dir/bench.log" 2>&1
  cp /tmp/twb/profiles/e2e_server/rank0/steps.json "$dir/" 2>/dev/null
  python3 - "$dir/results.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1])).get("e2e") or {}
g = (r.get("shard_profile") or {}).get("gaps", {})
kinds = {k: (v["steps"], round(v["gpu_ms_mean"], 1), round(v["gap_ms_sum"]))
         for k, v in g.items() if isinstance(v, dict)}
print(sys.argv[2], {k: (round(r[k], 1) if isinstance(r.get(k), float) else r.get(k)) for k in (
    "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "ok",
    "startup_seconds")}, kinds or "")
EOF
  ;;
*)
  echo "usage: $0 micro | e2e NAME MAX_BATCH \"ARGS\" [profile]" >&2; exit 2 ;;
esac
