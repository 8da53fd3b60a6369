#!/usr/bin/env bash
# One device call (issue 20, fp8 KV cache): the GPU tests of the fp8 KV cache (key rotation on by
# default, and the fused decode kernel with rotation off), then decode steps of the Llama-3-8B
# shape (random weights, CUDA graphs) with a bf16 cache, an fp8 cache with rotated keys (the
# default) and an fp8 cache without rotation, on the same machine. Outputs under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
  tests/gpu/test_cuda_paths.py tests/gpu/test_fused_kernels.py -k "fp8_kv or fused_path" 2>&1 \
  | grep -v -i warn > $OUT/kv_rotation_gpu_tests.log
grep -E "passed|failed|FAILED|Error|greedy|margin" $OUT/kv_rotation_gpu_tests.log | tail -20
for run in "auto hadamard" "fp8_e4m3fn hadamard" "fp8_e4m3fn none"; do
  set -- $run
  timeout 240 python3 -m benchmarks.harness --parts decode --decode-batches ${BATCHES:-1,16,64} \
    --kv-cache-dtype $1 --kv-cache-rotation $2 --out $OUT/kv_$1_$2 --workdir /tmp/twb \
    > $OUT/kv_$1_$2.log 2>&1
  echo "== kv-cache-dtype $1, rotation $2"; grep -E "^decode|Error|error" $OUT/kv_$1_$2.log | tail -8
done
