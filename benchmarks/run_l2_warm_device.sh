#!/usr/bin/env bash
# Device run for the L2 warming work (round 16): the probe, then the batch-1 MoE step with and
# without the attention launch warming o_proj. run(command="bash benchmarks/run_l2_warm_device.sh
# [variants]", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python3 -m benchmarks.l2_warm_probe --out $OUT 2>&1 | grep -v Warning | tee $OUT/probe.log
timeout 420 python3 -m benchmarks.moe_b1_bench --out $OUT --parts bf16,fp8 \
  --variants "${1:-old,old:warm-o}" 2>&1 | grep -v Warning | tee $OUT/bench.log | tail -40
