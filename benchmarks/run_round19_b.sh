#!/usr/bin/env bash
# Round 19, third lease (benchmarks/MOE_B1.md, round 19): the changed GPU tests (route_sorted the
# table's default, half tiles, the stamp test's stale-stamp filter), the attention chain with
# half tiles from context 128 to 16,384, then the step A/B without the profiler: half tiles,
# the expert launches' pipelines and tiles (ROUND19_CONFIGS), the routing's old loop.
# run(command="bash benchmarks/run_round19_b.sh", carry=[".whl-tw"]). A record (call 4): half
# tiles (attention_decode.half_tiles, old:half-tiles, the chain's +half rows) were removed after
# it (benchmarks/MOE_B1.md, round 19).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py \
  tests/gpu/test_fused_kernels.py -k "not fused_kernels or half or stress or stamp or new_kv" \
  2>&1 | tail -6 > $OUT/gpu_tests.log
tail -4 $OUT/gpu_tests.log
timeout 100 python3 -m benchmarks.attention_stamps --out $OUT/chain \
  --contexts 128,512,1024,4096,16384 \
  --names "default(s16)+by-split,default(s16)+by-split+half" 2>&1 | grep -v Warn | cut -c1-170
v=old,old:half-tiles,old:down-st6,old:down-kwide,old:down-n4,old:up-st6,old:up-k2x,old:up-n32
v=$v,old:route-loop,old,old:half-tiles
timeout 230 python3 -m benchmarks.moe_b1_bench --out $OUT/ab --no-profile --parts bf16,fp8 \
  --variants $v 2>&1 | grep -v Warn > $OUT/ab.log
grep -E "^model|rror" $OUT/ab.log | cut -c1-100
