"""Kernel-level breakdown of one decode step (run on the GPU machine).

    python benchmarks/decode_profile.py MODEL_DIR [--batches 1,64] [--context 1024] [--out DIR]

torch.profiler over eager decode steps of the real model (same kernels as the CUDA graph, whose
replay time is also printed): device time per kernel class, kernels per step, and the gap between
the sum of kernel times and the graph replay (launch gaps inside the graph).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()

    import torch

    from benchmarks.harness.timing import cuda_time_ms, decode_step
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner
    from shard.distributed.groups import Dist
    from benchmarks.harness.kernel_profile import profile_kernels
    from shard.server.loader import Shard, ShardConfig

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
        for _ in range(3):
            runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)
        torch.cuda.synchronize()
        prof = profile_kernels(
            lambda dev=dev: runner.forward(dev.input_ids, dev.positions, dev.meta,
                                           dev.logits_indices),
            calls=5,
        )
        total = prof["kernel_sum_ms"]
        report[b] = dict(prof, graph_replay_ms=replay)
        print(f"batch {b}: graph {replay:.3f} ms, kernel sum {total:.3f} ms, "
              f"{prof['kernels_per_call']} kernels/step")
        for k, (ms, n) in list(prof["classes"].items())[:12]:
            print(f"   {k:50s} {ms:8.3f} ms  x{n}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
