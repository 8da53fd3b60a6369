#!/usr/bin/env bash
# One nvidia-h100-x1 (or H200) call, ~4-5 minutes (issue 40, W4A16 at batch 1):
#   benchmarks/int4_b1_sweep.py: every M = 1 GEMV candidate of the Llama-3-8B linears (the
#   multi-group "wide" / "diag" tiles of shard/kernels/int_gemv_wide.py and the older ones)
#   compiled in parallel, checked against an fp32 reference (and graph replay against eager),
#   timed over 32 layers in one CUDA graph with GB/s and % of copy bandwidth; then the 32-layer
#   stacks int4 vs bf16 at M = 1, 16, 64.
# Outputs under $OUT: int4_b1_sweep.{json,md,log}. The last lines printed are the summary.
#   run(command="bash benchmarks/run_int4_b1_device.sh", carry=[".whl-tw"])
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 540 python3 benchmarks/int4_b1_sweep.py --out "$OUT" > "$OUT/int4_b1_sweep.log" 2>&1
echo "sweep rc=$?"
grep -E "^\[compile\]|FAILED|Traceback|Error" "$OUT/int4_b1_sweep.log" | head -30
# per-candidate lines of the new tiles (wide / wptx = wide with inline PTX / wquad = wptx scaled per 4 words / diag), fastest first per shape
grep -E "^  (qkv|o|gate_up|down) +[0-9.]+ us .*  (wide|wptx|wquad|diag) " "$OUT/int4_b1_sweep.log" \
  | sort -k1,1 -k2,2n | awk '{c[$1]++} c[$1] <= 6'
sed -n '/=* SUMMARY =*/,$p' "$OUT/int4_b1_sweep.log"
tail -5 "$OUT/int4_b1_sweep.log"
