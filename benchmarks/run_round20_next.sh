#!/usr/bin/env bash
# The next lease for issue 39 (benchmarks/MOE_B1.md, round 19 "Next"): the short-context graph
# (CudaAttentionBackend.short_decode + CudaGraphDecodeRunner's short graphs, opt-in, written in
# round 19 without a lease left): its GPU tests, then its step A/B without the profiler.
# run(command="bash benchmarks/run_round20_next.sh", carry=[".whl-tw"]).
# A record of round 20's call 1 (raw/round20/call1): the graph is now the default and its A/B
# variant is `old:no-short-graph` (`old:short-graph` no longer exists).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout -s INT 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_cuda_paths.py \
  tests/gpu/test_moe_cuda.py -k "short or graphs" -rfE 2>&1 | grep -v Warn | tail -6
timeout 280 python3 -m benchmarks.moe_b1_bench --out $OUT/ab --no-profile --parts bf16,fp8 \
  --variants old,old:short-graph,old,old:short-graph,old:short-graph,old 2>&1 | grep -v Warn > $OUT/ab.log
grep -E "^model|rror" $OUT/ab.log | cut -c1-100
