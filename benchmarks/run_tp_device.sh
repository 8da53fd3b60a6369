#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 8): GPU tests (incl. fp8 KV kernels), then `python -m
# benchmarks.harness --num-shard 2` decode: one-GPU decode + TP=2 (tiny greedy, 8B logits, decode speedup,
# all-reduce cost). Outputs under $OUT. NCCL_NVLS_ENABLE=0 etc. are preset on the machine.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m | head -4
[ "${RUN_TESTS:-1}" != 0 ] && timeout 120 python3 -m pytest -q -m gpu tests/gpu tests/shard/test_quantization.py -p no:cacheprovider -s -rA 2>&1 \
  | grep -v -i warn | tee $OUT/gpu_tests.log | tail -30
timeout ${BENCH_TIMEOUT:-330} python3 -m benchmarks.harness --parts ${PARTS:-decode} --decode-batches ${BATCHES:-1,8,64} \
  --num-shard 2 "$@" --out $OUT --workdir /tmp/twb 2>&1 | grep -v "Loading weights" | tee $OUT/bench_tp.log | tail -60
