#!/usr/bin/env bash
# The next lease for issue 39 (benchmarks/MOE_B1.md, round 20 "Next" item 2), after
# `git show 96fe843 -- shard/kernels/gemv.py | git apply` (whole 4,096-wide rows, 2 x 4096, 8 warps,
# added to gemv._W16_FMA_CONFIGS): the GEMV's GPU tests, then which candidate the tuner picks
# for the o_proj shape (printed with `old`) and the bf16 step against the old pick (c4: 2 x 1024)
# and the forced whole rows. If the tuner's pick wins in the step, the GPU suite
# (run_round20_suite.sh) must pass before it stays on main; Llama-3-8B's step should be
# re-measured too (every 16-bit shape retunes).
# run(command="bash benchmarks/run_round21_next.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout -s INT 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_decode_linear_cuda.py \
  tests/gpu/test_fused_kernels.py -k "gemv or linear or silu" -rfE 2>&1 | grep -v Warn | tail -6
timeout 200 python3 -m benchmarks.moe_b1_bench --out $OUT/oproj --no-profile --parts bf16 \
  --variants old,old:oproj-c4,old:oproj-2x4096w8st1,old,old:oproj-c4,old:oproj-2x4096w8st1 \
  2>&1 | grep -v Warn > $OUT/oproj.log
grep -E "^model|o_proj|rror" $OUT/oproj.log | cut -c1-220
