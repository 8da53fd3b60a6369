#!/usr/bin/env bash
# One device call for issue 38's Gemma part, < 8 minutes on one H100: the Gemma GPU tests (soft-
# capping and per-layer windows in the Triton decode / prefill kernels against the torch backend,
# the (1 + w) norm and GELU-tanh kernels, tiny Gemma 2 / Gemma 3 greedy on CUDA with CUDA-graph
# decode equal to CPU; the q/k head-norm kernel's own tests), then the benchmark harness on a
# random bf16 Gemma-2-9B-shaped checkpoint (42 layers, soft-capped, every other layer local):
# CUDA-graph decode at batch 1 / 64 / 256, context 512 (its KV is 344 KB a token: batch 256 x 1024
# would not fit 80 GB beside the 18.5 GB of weights), against the memory roofline.
# Outputs under $OUT (4 files): gpu_tests_gemma.log, results.json, RESULTS.md, summary.txt.
# Usage: bash benchmarks/run_gemma_device.sh
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_gemma_cuda.py tests/gpu/test_qk_norm_cuda.py \
  -p no:cacheprovider 2>&1 | tail -30 > $OUT/gpu_tests_gemma.log; tail -3 $OUT/gpu_tests_gemma.log
timeout -s INT -k 15 330 python3 -m benchmarks.harness --model-type gemma2 --parts decode \
  --decode-batches 1,64,256 --context 512 --skip-ab --out /tmp/gemma_bench --workdir /tmp/twb 2>&1 \
  | grep -v "Loading weights\|Writing model shards" > /tmp/gemma_bench.log
cp /tmp/gemma_bench/results.json /tmp/gemma_bench/RESULTS.md $OUT/ 2>/dev/null
{ grep -E "^checkpoint ready|^decode b=|Traceback|Error" /tmp/gemma_bench.log | cut -c1-300; } \
  | tee $OUT/summary.txt
# The bar: CUDA-graph decode at batch 1 >= 85 % of the memory roofline.
python3 - <<'PY' | tee -a $OUT/summary.txt
import json
res = json.load(open("/tmp/gemma_bench/results.json"))
for d in res.get("model", {}).get("decode", []):
    print(f"gemma2-9b b={d['batch']} ctx={d['context']}: graph {d['graph_replay_ms']:.2f} ms, "
          f"roofline {d['roofline_ms']:.2f} ms = {d['pct_of_roofline']:.0f}%, "
          f"{d['tokens_per_s']:.0f} tok/s, graph/eager argmax agree {d['graph_eager_argmax_agree']:.2f}")
b1 = [d for d in res.get("model", {}).get("decode", []) if d["batch"] == 1]
print("bar b=1 >= 85% of roofline:", "met" if b1 and b1[0]["pct_of_roofline"] >= 85 else "MISSED",
      "| errors:", res.get("errors") or "none", "|", res.get("device"))
PY
