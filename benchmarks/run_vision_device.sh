#!/usr/bin/env bash
# One device call for issue 42 (images in), < 9 minutes on one H100: the TTFT of a 1-image
# request on a random LLaVA-1.5-7B-shaped model (bf16, transformers backend) with and without an
# encoder-cache hit, a text-only prefill of the same length, and the decode step after an image
# prompt vs a text prompt (benchmarks/vision_ttft.py). Needs the tokenwire wheels incl. pillow:
# run `bash benchmarks/fetch_device_wheels.sh` here first and carry .whl-tw.
# Outputs under $OUT: vision_ttft.json, vision_ttft.md, vision.log.
# Usage: run(command="bash benchmarks/run_vision_device.sh", carry=[".whl-tw"]); for the
# Qwen2-VL-7B shape (M-RoPE; outputs vision_ttft_qwen2_vl.*, vision_qwen2_vl.log):
# run(command="bash benchmarks/run_vision_device.sh --family qwen2_vl", carry=[".whl-tw"])
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
LOG=$OUT/vision${2:+_$2}.log
timeout -s INT -k 15 500 python3 benchmarks/vision_ttft.py --out $OUT --workdir /tmp/vision \
  --reps 5 "$@" 2>&1 | grep -v "Loading weights\|Writing model shards" > $LOG
tail -15 $LOG
