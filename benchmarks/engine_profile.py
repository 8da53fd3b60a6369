"""Where a shard's decode step goes at batch 256: forward vs host work (run on the GPU machine).

    python benchmarks/engine_profile.py MODEL_DIR [--batch 256] [--steps 40] [--out DIR]

Loads MODEL_DIR through the normal shard path, warms up (KV sizing + CUDA graphs), prefills
`batch` requests of 200 tokens, then times `steps` Engine.decode calls: the engine's own
StepTimings (prepare / forward / sampling+detokenization) and a cProfile of the host side.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-total", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from shard.distributed.groups import Dist
    from shard.engine.contracts import BatchSpec, RequestSpec
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(args.model_dir), dtype=args.dtype, device=args.device),
                  Dist())
    warm = shard.warmup(WarmupSpec(max_input_tokens=args.max_total // 2, max_total_tokens=args.max_total,
                                   max_batch_prefill_tokens=8192, max_batch_size=args.batch))
    engine = shard.engine
    bs = warm.block_size
    per = -(-(args.prompt + args.steps + 8) // bs)
    refs = []
    for start in range(0, args.batch, 32):
        reqs = []
        for i in range(start, min(start + 32, args.batch)):
            ids = [(i * 7919 + j * 31) % 128000 for j in range(args.prompt)]
            reqs.append(RequestSpec(id=i, input_ids=ids, cache_len=0, chunk_len=len(ids),
                                    blocks=list(range(i * per, (i + 1) * per)),
                                    max_new_tokens=10_000, ignore_eos_token=True))
        res = engine.prefill(BatchSpec(id=start + 1, requests=reqs), None, [])
        refs.append(res.batch)
    res = engine.decode(refs, [])
    ref = res.batch
    timings = []
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        prof.enable()
        res = engine.decode([ref], [])
        prof.disable()
        ref = res.batch
        timings.append(res.timings)
    wall = (time.perf_counter() - t0) / args.steps

    def ms(attr):
        return statistics.median(getattr(t, attr) for t in timings) / 1e6

    summary = {
        "batch": args.batch, "steps": args.steps, "wall_ms_per_step": wall * 1e3,
        "prepare_ms": ms("prepare_ns"), "forward_ms": ms("forward_ns"),
        "sample_detok_ms": ms("decode_ns"), "total_ms": ms("total_ns"),
        "graphs": shard.runner.graphs is not None,
    }
    print(json.dumps(summary))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_profile.txt").write_text(json.dumps(summary) + "\n" + s.getvalue())
    print("\n".join(s.getvalue().splitlines()[:45]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
