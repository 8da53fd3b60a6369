#!/usr/bin/env bash
# One device call for issue 37 (the transformers backend), < 9 minutes on one H100: the backend's
# GPU tests (tiny Llama forced through it: CUDA graphs, tokens equal native; a MoE model eager),
# then the benchmark harness twice on the Llama-3-8B-shaped random checkpoint, native and forced
# through the transformers backend (decode graph replay at batch 1 and 64, end-to-end req/s on
# the harness workload), then the comparison (backend step <= 1.25x native, req/s >= 80 %).
# Outputs under $OUT: gpu_tests_transformers_backend.log, native/ and transformers/ (each the
# harness's results.json, RESULTS.md, bench.log, e2e_server.log), transformers_backend.md.
# Usage: bash benchmarks/run_transformers_backend_device.sh
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_transformers_backend_cuda.py -p no:cacheprovider 2>&1 \
  | tail -25 > $OUT/gpu_tests_transformers_backend.log; tail -3 $OUT/gpu_tests_transformers_backend.log
for impl in native transformers; do
  mkdir -p $OUT/$impl
  limit=160; [ $impl = transformers ] && limit=270  # the backend loads through from_pretrained
  timeout $limit python3 -m benchmarks.harness --parts decode,e2e --decode-batches 1,64 --skip-ab \
    --e2e-overlap on --model-impl $impl --out $OUT/$impl --workdir /tmp/twb 2>&1 \
    | grep -v "Loading weights\|Writing model shards" > $OUT/$impl/bench.log
  grep -E "^decode b=|requests_per_s|Traceback|Error" $OUT/$impl/bench.log | cut -c1-300 | tail -8
done
python3 benchmarks/transformers_backend_compare.py $OUT/native/results.json \
  $OUT/transformers/results.json --out $OUT/transformers_backend.md
