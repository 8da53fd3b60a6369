#!/usr/bin/env bash
# Round 20, lease 4 (2 x H200): the GPU tests lease 3 left failing or unrun, in one pytest
# process: the short-context graph test (eager now takes the same bound), the verify-graph and
# vision files (cut by lease 3's time limit), and the two-GPU file after test_cuda_paths (whose
# tiny models tune GEMV shapes in this process first: the condition of lease 3's tuning-count
# failure, fixed in the module's tuning_dir fixture).
# run(command="bash benchmarks/run_round20_final.sh", carry=[".whl-tw"], kind="nvidia-h200-x2").
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout -s INT 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_cuda_paths.py \
  tests/gpu/test_verify_graphs.py tests/gpu/test_vision_cuda.py tests/gpu/test_multi_gpu.py -rfE \
  --durations 12 2>&1 | grep -v Warn > $OUT/gpu_tests.log
grep -E "passed|failed|FAILED|ERROR|s call" $OUT/gpu_tests.log | tail -24
