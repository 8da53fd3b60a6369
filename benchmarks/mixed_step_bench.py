"""Attention time of one layer in mixed steps (prompt chunks + decode rows in one flat batch), at
Llama-3-8B heads (32 query, 8 KV, head_dim 128, bf16, 16-token pages); run on the GPU machine.

    python benchmarks/mixed_step_bench.py [--out DIR]

Per case (CUDA events, median of 20 after 3 warm-ups, benchmarks/harness/timing.py):
- whole: the step through the prefill kernel alone, one program per (sequence, 64-row tile of the
  longest chunk, query head): the path before shard/attention/mixed_step.py;
- split: CudaAttentionBackend.attend: chunks through the prefill kernel over the tile map, the
  trailing decode rows through the decode kernel (the split and tile map are made once per step
  and reused by every layer: their host time is reported apart, per step);
- decode only: the decode rows alone through the decode kernel, and their K/V bytes: the floor.
Cases follow the e2e workload's mixed steps (chunks of ~196-token prompts plus the running
requests' decode rows) and two prefill-only shapes (the tile map must not slow them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.timing import cuda_time_ms
from shard.attention.base import AttentionMetadata
from shard.attention.cuda_backend import CudaAttentionBackend
from shard.kernels import attention_decode, attention_prefill
from shard.testing.paged_batch import random_paged_step

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
SCALE = DIM**-0.5

# name: (chunk lengths (new tokens over no cache), decode rows' contexts (mean, spread))
CASES = {
    "8 chunks x 196 + 500 decode rows ~300": ([196] * 8, 500, 300),
    "42 chunks x 196 (8,192) + 200 decode rows ~200": ([196] * 41 + [156], 200, 200),
    "42 chunks x 196 (8,192) + 1,000 decode rows ~250": ([196] * 41 + [156], 1000, 250),
    "2 chunks x 100 + 900 decode rows ~400": ([100, 100], 900, 400),
    "prefill only 1 x 4,096": ([4096], 0, 0),
    "prefill only 16 x 512": ([512] * 16, 0, 0),
}


def build(chunks: list[int], decodes: int, ctx: int, rng: random.Random):
    """The step's query, caches and a maker of fresh metadata (each path gets its own, so that
    one's per-step plan is not reused by the other), plus the decode rows' K/V bytes."""
    dec = [max(1, int(rng.lognormvariate(math.log(ctx), 0.5))) for _ in range(decodes)]
    q_lens, seq_lens = chunks + [1] * decodes, chunks + dec
    q, cache, first = random_paged_step(q_lens, seq_lens, HEADS, KV_HEADS, DIM, PAGE, "cuda",
                                        torch.bfloat16)

    def meta() -> AttentionMetadata:
        return replace(first, derived={})

    kv_bytes = sum(dec) * KV_HEADS * DIM * 2 * 2
    return q, cache, meta, kv_bytes


def measure(name: str, chunks: list[int], decodes: int, ctx: int,
            backend: CudaAttentionBackend) -> dict:
    q, cache, meta, kv_bytes = build(chunks, decodes, ctx, random.Random(0))
    m_whole, m_split = meta(), meta()

    def whole_batch() -> torch.Tensor:
        return attention_prefill.paged_prefill_attention(
            q, *cache, m_whole.block_tables, m_whole.query_start_loc, m_whole.seq_lens,
            m_whole.max_query_len, SCALE)

    def split_batch() -> torch.Tensor:
        return backend.attend(q, *cache, m_split, SCALE, None)

    err = (split_batch().float() - whole_batch().float()).abs().max().item()
    whole, split = cuda_time_ms(whole_batch), cuda_time_ms(split_batch)
    t0 = time.perf_counter()
    for _ in range(20):
        backend._mixed_plan(meta(), DIM, q.device)
    plan_ms = (time.perf_counter() - t0) / 20 * 1e3
    dec_ms = float("nan")
    if decodes:
        n, t = len(chunks), sum(chunks)
        dec_ms = cuda_time_ms(lambda: attention_decode.paged_decode_attention(
            q[t:], *cache, m_split.block_tables[n:], m_split.seq_lens[n:], SCALE))
    return {"case": name, "whole_ms": whole, "split_ms": split, "speedup": whole / split,
            "decode_rows_only_ms": dec_ms, "decode_kv_bytes": kv_bytes,
            "decode_rows_tb_per_s": kv_bytes / dec_ms / 1e9 if decodes else float("nan"),
            "plan_host_ms_per_step": plan_ms, "max_abs_diff_vs_whole": err}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    backend = CudaAttentionBackend("cuda", use_flash_attn=False)
    rows = []
    for name, (chunks, decodes, ctx) in CASES.items():
        rows.append(measure(name, chunks, decodes, ctx, backend))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    header = ("| case | whole batch, prefill kernel ms | split ms | speedup | decode rows alone ms "
              "(K/V GB, TB/s) | plan host ms/step | max abs diff |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['whole_ms']:.3f} | {r['split_ms']:.3f} | {r['speedup']:.2f}x | "
            f"{r['decode_rows_only_ms']:.3f} ({r['decode_kv_bytes'] / 1e9:.2f}, "
            f"{r['decode_rows_tb_per_s']:.2f}) | {r['plan_host_ms_per_step']:.3f} | "
            f"{r['max_abs_diff_vs_whole']:.1e} |")
    table = "\n".join(lines)
    print(f"{torch.cuda.get_device_name()}, one layer\n{table}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mixed_step_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
        (args.out / "mixed_step_bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
