#!/usr/bin/env bash
# Round 16 device call 3 (benchmarks/MOE_B1.md, round 16): the MoE GPU tests, then the batch-1
# step with the persistent gate/up variants and interleaved A/Bs of the fused q/k norms and the
# o_proj L2 warm. run(command="bash benchmarks/run_round16_device.sh", carry=[".whl-tw"]).
set -u
source benchmarks/device_env.sh
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py 2>&1 | tail -4 | tee $OUT/gpu_tests.log
timeout 340 python3 -m benchmarks.moe_b1_bench --out $OUT --parts bf16,fp8 --variants old,old:up-stream,old:up-stream-8x2048-st4,old:up-stream-2sm,old:qk-norm-apart,old,old:qk-norm-apart,old:warm-o 2>&1 | grep -v Warn | tee $OUT/bench.log | grep -v "kernels:\|roofline bytes" | tail -24
