#!/usr/bin/env bash
# Round 16: a GPU smoke after the settings refactor (shard/kernels/setting.py): the MoE tiny
# models with graphs, the fused router and the norm prologue switched on, the decode kernels.
# run(command="bash benchmarks/run_round16_smoke.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py \
  -k "on_cuda_match_cpu or fused_router or norm_prologue or compiled_match_the_loop" \
  2>&1 | tail -3
