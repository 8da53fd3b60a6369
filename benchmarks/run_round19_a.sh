#!/usr/bin/env bash
# Round 19, second lease (ran as call 3): the vision GPU tests (the first lease ran them from the
# wrong directory), then round 18's prepared A/B. A record: fine_splits and new_kv_first (and
# their variants and chain rows) were removed after this run (benchmarks/MOE_B1.md, round 19).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_vision_cuda.py 2>&1 \
  | tail -3 > $OUT/vision.log
tail -2 $OUT/vision.log
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
