#!/usr/bin/env bash
# The next lease for issue 39 (benchmarks/MOE_B1.md, round 18 "Next"): the GPU tests written in
# round 18 without a GPU (step stamps, fine split shares, new k/v first), the attention chain's
# stamps for those options, then their A/B in the step without the profiler (a CUPTI session
# slows later replays in the process), then the step stamps of `old`.
# run(command="bash benchmarks/run_round18_next.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py \
  tests/gpu/test_fused_kernels.py -k "stamp or fine or stress or new_kv or early_ids" 2>&1 \
  | tail -8 \
  > $OUT/gpu_new.log
tail -3 $OUT/gpu_new.log
timeout 90 python3 -m benchmarks.attention_stamps --out $OUT/chain --contexts 512,4096 --names \
  "default(s16)+by-split,default(s16)+by-split+fine,default(s16)+by-split+kv-first,default(s16)+by-split+fine+kv-first" \
  2>&1 | grep -v Warn | cut -c1-200
v=old,old:fine-splits,old:new-kv-first,old:route-sorted,old+attn:s16-n32-w4-st3,old
v=$v,old:fine-splits,old:new-kv-first,old:route-sorted,old
timeout 200 python3 -m benchmarks.moe_b1_bench --out $OUT/ab --no-profile --parts bf16,fp8 \
  --variants $v 2>&1 | grep -v Warn > $OUT/ab.log
grep "^model" $OUT/ab.log | cut -c1-90
timeout 150 python3 -m benchmarks.moe_b1_bench --out $OUT/stamps --no-profile --stamps \
  --parts bf16,fp8 --variants old 2>&1 | grep -v Warn > $OUT/stamps.log
grep -E "^model|stamps" $OUT/stamps.log | cut -c1-220
