"""Kernel-level breakdown of one decode step (run on the GPU machine).

    python benchmarks/decode_profile.py MODEL_DIR [--batches 1,64] [--context 1024] [--out DIR]

torch.profiler over eager decode steps of the real model (same kernels as the CUDA graph, whose
replay time is also printed): device time per kernel class, kernels per step, and the gap between
the sum of kernel times and the graph replay (launch gaps inside the graph).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def classify(name: str) -> str:
    n = name.lower()
    if "gemv" in n or "gemm" in n or "cutlass" in n or "sm90" in n or "xmma" in n or "nvjet" in n:
        return "matmul"
    if "_decode_split" in n or "_decode_merge" in n:
        return "attention"
    if "_store_kv" in n:
        return "kv_store"
    if "rotary" in n or "rope" in n:
        return "rotary"
    if "rms_norm" in n:
        return "norm"
    if "silu" in n:
        return "silu_mul"
    return "other:" + name[:60]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from shard.bench import cuda_time_ms, decode_step
    from shard.cuda_graphs import CudaGraphDecodeRunner
    from shard.distributed import Dist
    from shard.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(args.model_dir), dtype="bfloat16", device="cuda"),
                  Dist())
    runner = shard.runner
    batches = [int(b) for b in args.batches.split(",")]
    per = math.ceil(args.context / runner.block_size)
    runner.allocate_kv_cache(max(batches) * per + 1)
    for k, v in runner.kv_cache:
        k.normal_()
        v.normal_()
    graphs = CudaGraphDecodeRunner(runner.forward, runner.device, runner.block_size, max(batches),
                                   per, buckets=batches)
    graphs.capture()
    report = {}
    for b in batches:
        step = decode_step(b, args.context, runner.block_size)
        dev = runner.prepare(step)
        graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)  # inputs
        replay = cuda_time_ms(graphs.graphs[b].replay, iters=30)
        steps = 5
        for _ in range(3):
            runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)
            torch.cuda.synchronize()
        by_class: dict[str, float] = collections.defaultdict(float)
        counts: dict[str, int] = collections.defaultdict(int)
        for evt in prof.key_averages():
            t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if t <= 0 or evt.count <= 0:
                continue
            c = classify(evt.key)
            by_class[c] += t / steps / 1e3  # ms per step
            counts[c] += evt.count // steps
        total = sum(by_class.values())
        report[b] = {"graph_replay_ms": replay, "kernel_sum_ms": total,
                     "kernels_per_step": sum(counts.values()),
                     "classes": {k: [round(v, 4), counts[k]] for k, v in
                                 sorted(by_class.items(), key=lambda kv: -kv[1])}}
        print(f"batch {b}: graph {replay:.3f} ms, kernel sum {total:.3f} ms, "
              f"{sum(counts.values())} kernels/step")
        for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])[:12]:
            print(f"   {k:50s} {v:8.3f} ms  x{counts[k]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
