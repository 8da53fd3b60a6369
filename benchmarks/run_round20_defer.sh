#!/usr/bin/env bash
# Round 20, lease 2 (benchmarks/MOE_B1.md): the split down launch leaving its sum to the next
# layer's add + norm (DecodeConfig.defer_sum): its GPU tests, then the step A/B without the
# profiler (bf16 with the split launch, fp8's table entry deferred), interleaved.
# run(command="bash benchmarks/run_round20_defer.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout -s INT 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py \
  -k "deferred or split_down or on_cuda_match_cpu" -rfE 2>&1 | grep -v Warn | tail -8
timeout 300 python3 -m benchmarks.moe_b1_bench --out $OUT/ab --no-profile --parts bf16,fp8 \
  --variants old,old:defer,old:split32-defer,old:split32,old,old:defer,old:split32-defer,old:split32-k128-defer \
  2>&1 | grep -v Warn > $OUT/ab.log
grep -E "^model|rror" $OUT/ab.log | cut -c1-100
