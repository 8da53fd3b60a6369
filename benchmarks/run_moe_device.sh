#!/usr/bin/env bash
# One device call for issue 39 (fused MoE), < 9 minutes on one H100 (or H200): the MoE GPU tests
# (compiled kernels vs the per-expert loop, a CUDA-graph capture of the layer, the tiny Mixtral /
# Qwen2-MoE / Qwen3-MoE shards on CUDA = CPU, decode from graphs), then benchmarks/moe_bench.py
# on the Qwen3-30B-A3B shape: one layer (fused vs naive loop vs fp8, tiling sweep, prefill 4096),
# the whole 48-layer model (bf16 and --quantize fp8) built by the shard's loader from the 8-layer
# checkpoint's layers (moe_bench.aliased_layers: no 61 GB checkpoint), random checkpoints of 4
# and 8 layers through the shard's loader (decode graphs at batch 1 / 64 / 256 with each step's
# byte roofline, also extrapolated to 48 layers; fp8 vs bf16 at batch 1; prefill 4096 vs the
# bf16 matmul rate), and the harness's e2e workload on the 8-layer model (if started by 280 s).
# Outputs under $OUT: gpu_tests_moe.log, moe.json, MOE.md, moe_bench.log, e2e_server.log.
# SIGINT at the time limit: the e2e part's finally stops its deployment.
# Usage: bash benchmarks/run_moe_device.sh   (MOE_LAYERS=4,8 MOE_BENCH_TIMEOUT=400 MOE_E2E_START_BY=280)
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_moe_cuda.py -p no:cacheprovider 2>&1 \
  | tail -30 > $OUT/gpu_tests_moe.log; tail -3 $OUT/gpu_tests_moe.log
timeout -s INT -k 30 ${MOE_BENCH_TIMEOUT:-400} python3 -m benchmarks.moe_bench --out $OUT --workdir /tmp/moe-bench \
  --layers ${MOE_LAYERS:-4,8} --budget-s ${MOE_E2E_START_BY:-280} 2>&1 \
  | grep -v "Loading weights\|Writing model shards" > $OUT/moe_bench.log
grep -E "^layer |^model |Traceback|Error" $OUT/moe_bench.log | cut -c1-300 | tail -40
cat $OUT/MOE.md 2>/dev/null | tail -60
