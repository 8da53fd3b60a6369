#!/usr/bin/env bash
# One device call for issue 39's batch-1 bar, ~5-6 minutes on one H100 or H200: the MoE GPU tests
# (tests/gpu/test_moe_cuda.py: the compiled kernels incl. the fused add + RMSNorm + router +
# routing launch against the three launches it replaces, tiny Mixtral / Qwen2-MoE / Qwen3-MoE
# shards from CUDA graphs with and without it), then benchmarks/moe_b1_bench.py: the decode
# attention kernel alone at batch 1 over a grid of tilings, and the Qwen3-30B-A3B-shaped model
# (48 layers aliased from an 8-layer random checkpoint, context 512, CUDA graphs) at batch 1 in
# bf16 and --quantize fp8, each as `old` (main's five MoE-half launches), `fused` (the fused
# router launch), `fused+attn:<tiling>` (also the attention tilings) and, bf16 only,
# `fused+norm-prologue` (the input norm inside the qkv GEMV) and other router tilings, with each
# step's byte roofline and its kernels by name. Outputs under $OUT: gpu_tests_moe.log,
# moe_b1_bench.log, moe_b1.json, MOE_B1.md. The summary is the last thing printed (from MOE_B1.md,
# written after every part, if the benchmark ran out of time). The whole call stays under 560 s.
# Usage: bash benchmarks/run_moe_b1_device.sh   (MOE_B1_TIMEOUT=400 MOE_B1_PARTS=attention,bf16,fp8)
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
t0=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_moe_cuda.py -p no:cacheprovider 2>&1 \
  | tail -40 > $OUT/gpu_tests_moe.log
grep -E "^FAILED|^ERROR" $OUT/gpu_tests_moe.log | cut -c1-300 | head -10
echo "tests took $(( $(date +%s) - t0 )) s"
left=$(( 540 - ($(date +%s) - t0) ))
limit=${MOE_B1_TIMEOUT:-400}
(( left < limit )) && limit=$left
timeout -s INT -k 20 $limit python3 -m benchmarks.moe_b1_bench --out $OUT \
  --workdir /tmp/moe-b1 --parts ${MOE_B1_PARTS:-attention,bf16,fp8} 2>&1 \
  | grep -v "Loading weights\|Writing model shards" > $OUT/moe_b1_bench.log
grep -E "Traceback|Error" $OUT/moe_b1_bench.log | cut -c1-300 | tail -12
echo "total $(( $(date +%s) - t0 )) s"
echo "GPU tests (tests/gpu/test_moe_cuda.py): $(tail -1 $OUT/gpu_tests_moe.log)"
if grep -q "== MoE batch-1 summary" $OUT/moe_b1_bench.log; then
  sed -n '/== MoE batch-1 summary/,$p' $OUT/moe_b1_bench.log | cut -c1-700
else
  echo "benchmark stopped early (limit $limit s); summary of the parts done:"
  awk 'NR > 2 && /^## /{exit} NR > 2' $OUT/MOE_B1.md 2>/dev/null | cut -c1-700
fi
