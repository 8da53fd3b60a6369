"""Correctness and timing of the CUDA attention kernels (run on the GPU machine).

    python benchmarks/attention_check.py [--out DIR]

Checks (fresh random inputs each, outputs poisoned with NaN first, relative error
||out - ref|| / ||ref|| against a float32 torch reference with TF32 off):
- slot-mapped K/V store, paged decode (GQA, random block tables, ragged lengths, sliding window),
  paged prefill (ragged chunks that continue cached context, sliding window);
timing (CUDA events, median) at Llama-3-8B head shapes (32 q heads, 8 KV heads, head_dim 128,
bf16): decode at batch 1..256 with 1k contexts against the KV bytes it must read, a small sweep of
decode tile configs, prefill 1x4096 and 16x512 against SDPA (flash) on contiguous tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.kernels import attention_decode, attention_prefill

DEV = "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    ref = ref.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def make_cache(num_blocks, page, kvh, hd, dtype=torch.bfloat16):
    k = torch.randn(num_blocks, page, kvh, hd, device=DEV, dtype=dtype)
    v = torch.randn(num_blocks, page, kvh, hd, device=DEV, dtype=dtype)
    return k, v


def random_tables(seq_lens, page, num_blocks, gen):
    """Each sequence gets distinct random pages (shuffled, so paging is really exercised)."""
    need = [math.ceil(s / page) for s in seq_lens]
    width = max(need) if need else 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(width, 1), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    assert at <= num_blocks
    return table.to(DEV)


def gather_ctx(cache, table_row, length, page):
    idx = torch.arange(length, device=DEV)
    slots = table_row[idx // page].long() * page + idx % page
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]  # [length, kvh, hd]


def ref_attention(q, k, v, q_pos, scale, window):
    """q [nq, H, D] at absolute positions q_pos; k/v [L, KVH, D]; causal (+window), fp32."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(h // kvh, dim=1)
    v = v.float().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    kpos = torch.arange(k.shape[0], device=DEV)
    allowed = kpos[None, :] <= q_pos[:, None]
    if window:
        allowed &= (q_pos[:, None] - kpos[None, :]) < window
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def check_store(results, gen):
    kvh, hd, page, nb = 8, 128, 16, 64
    kc, vc = make_cache(nb, page, kvh, hd)
    n = 100
    slots = torch.randperm(nb * page, generator=gen)[:n].to(DEV)
    slots[::7] = -1  # padding rows must be skipped
    k = torch.randn(n, kvh, hd, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(n, kvh, hd, device=DEV, dtype=torch.bfloat16)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 3.0, -0.5])  # fp8 must saturate, not overflow
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    ref8 = kc8.clone()
    attention_decode.store_kv(k, v, kc8, vc8, slots)
    keep = slots >= 0
    ref8.view(-1, kvh, hd)[slots[keep]] = k[keep].float().clamp(-448, 448).to(torch.float8_e4m3fn)
    results.append({"check": "store_kv_fp8", "ok": torch.equal(kc8.view(torch.uint8),
                                                              ref8.view(torch.uint8))})
    kc2, vc2 = kc.clone(), vc.clone()
    attention_decode.store_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    kc2.view(-1, kvh, hd)[slots[keep]] = k[keep]
    vc2.view(-1, kvh, hd)[slots[keep]] = v[keep]
    ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
    results.append({"check": "store_kv", "ok": ok})


def check_decode(results, gen, h, kvh, hd, page, batch, ctx_lo, ctx_hi, window=None, splits=None,
                 cache_dtype=torch.bfloat16):
    lens = torch.randint(ctx_lo, ctx_hi + 1, (batch,), generator=gen).tolist()
    nb = sum(math.ceil(s / page) for s in lens) + 8
    kc, vc = make_cache(nb, page, kvh, hd)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    table = random_tables(lens, page, nb, gen)
    q = torch.randn(batch, h, hd, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    scale = hd**-0.5
    attention_decode.paged_decode_attention(q, kc, vc, table, seq_lens, scale, window, splits, out=out)
    refs = []
    for i, L in enumerate(lens):
        k = gather_ctx(kc, table[i], L, page)
        v = gather_ctx(vc, table[i], L, page)
        refs.append(ref_attention(q[i : i + 1], k, v, torch.tensor([L - 1], device=DEV), scale,
                                  window))
    err = rel_err(out, torch.cat(refs))
    results.append({"check": "decode", "shape": [h, kvh, hd, page], "batch": batch,
                    "ctx": [ctx_lo, ctx_hi], "window": window, "splits": splits,
                    "cache": str(cache_dtype),
                    "rel_err": err, "ok": err < 1e-2})


def check_prefill(results, gen, h, kvh, hd, page, chunks, window=None):
    """chunks: list of (cached_len, new_len)."""
    lens = [c + n for c, n in chunks]
    nb = sum(math.ceil(s / page) for s in lens) + 8
    kc, vc = make_cache(nb, page, kvh, hd)
    table = random_tables(lens, page, nb, gen)
    qlens = [n for _, n in chunks]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32,
                       device=DEV)
    q = torch.randn(sum(qlens), h, hd, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    scale = hd**-0.5
    attention_prefill.paged_prefill_attention(q, kc, vc, table, qsl, seq_lens, max(qlens), scale,
                                           window, out=out)
    refs = []
    for i, (c, n) in enumerate(chunks):
        k = gather_ctx(kc, table[i], c + n, page)
        v = gather_ctx(vc, table[i], c + n, page)
        qi = q[qsl[i] : qsl[i + 1]]
        refs.append(ref_attention(qi, k, v, torch.arange(c, c + n, device=DEV), scale, window))
    err = rel_err(out, torch.cat(refs))
    results.append({"check": "prefill", "shape": [h, kvh, hd, page], "chunks": chunks,
                    "window": window, "rel_err": err, "ok": err < 1e-2})


def bench_ms(fn, reps=50):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=reps, return_mode="median")


def time_decode(rows, gen, batch, ctx=1024, page=16, h=32, kvh=8, hd=128, sweep=False):
    lens = [ctx] * batch
    nb = batch * math.ceil(ctx / page) + 8
    kc, vc = make_cache(nb, page, kvh, hd)
    table = random_tables(lens, page, nb, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, h, hd, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * ctx * kvh * hd * 2
    default_splits = attention_decode.default_num_splits(batch, kvh, 132)
    configs = [(default_splits, 64, 4, 2)]
    if sweep:
        for s in sorted({1, 2, 4, 8, 16, 32, default_splits}):
            for bn, nw, st in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3),
                               (128, 8, 3)]:
                if s * kvh * batch <= 8 * 132 * 4 and (s, bn, nw, st) not in configs:
                    configs.append((s, bn, nw, st))
    best = None
    for s, bn, nw, st in configs:
        def fn(s=s, bn=bn, nw=nw, st=st):
            return attention_decode.paged_decode_attention(
                q, kc, vc, table, seq_lens, hd**-0.5, None, s, out=out, block_n=bn,
                num_warps=nw, num_stages=st)

        ms = bench_ms(fn)
        row = {"bench": "decode", "batch": batch, "ctx": ctx, "splits": s, "block_n": bn,
               "warps": nw, "stages": st, "us": ms * 1e3, "GBps": kv_bytes / ms / 1e6}
        rows.append(row)
        if best is None or ms < best["us"] / 1e3:
            best = row
    return best


def time_prefill(rows, gen, nseq, qlen, page=16, h=32, kvh=8, hd=128):
    lens = [qlen] * nseq
    nb = nseq * math.ceil(qlen / page) + 8
    kc, vc = make_cache(nb, page, kvh, hd)
    table = random_tables(lens, page, nb, gen)
    qsl = torch.arange(0, nseq + 1, dtype=torch.int32, device=DEV) * qlen
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(nseq * qlen, h, hd, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    flops = 4 * nseq * (qlen * qlen / 2) * hd * h  # causal: half the score matrix
    res = {}
    for bm, bn, nw, st in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]:
        def fn(bm=bm, bn=bn, nw=nw, st=st):
            return attention_prefill.paged_prefill_attention(
                q, kc, vc, table, qsl, seq_lens, qlen, hd**-0.5, None, out=out, block_m=bm,
                block_n=bn, num_warps=nw, num_stages=st)

        ms = bench_ms(fn)
        rows.append({"bench": "prefill_triton", "nseq": nseq, "qlen": qlen, "cfg": [bm, bn, nw, st],
                     "ms": ms, "TFLOPs": flops / ms / 1e9})
        res.setdefault("triton", ms)
        res["triton"] = min(res["triton"], ms)
    # SDPA (flash) on contiguous [B, H, L, D] tensors: the built-in bar for a fresh prompt.
    qs = q.view(nseq, qlen, h, hd).transpose(1, 2)
    ks = torch.randn(nseq, kvh, qlen, hd, device=DEV, dtype=torch.bfloat16)
    vs = torch.randn_like(ks)
    try:
        ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, enable_gqa=True))
        rows.append({"bench": "prefill_sdpa", "nseq": nseq, "qlen": qlen, "ms": ms,
                     "TFLOPs": flops / ms / 1e9})
        res["sdpa"] = ms
    except Exception as exc:  # noqa: BLE001
        rows.append({"bench": "prefill_sdpa", "error": repr(exc)})
    try:
        from torch.nn.attention.varlen import varlen_attn

        kf = torch.randn(nseq * qlen, h, hd, device=DEV, dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
        ms = bench_ms(lambda: varlen_attn(q, kf, vf, qsl, qsl, qlen, qlen, is_causal=True))
        rows.append({"bench": "prefill_varlen", "nseq": nseq, "qlen": qlen, "ms": ms,
                     "TFLOPs": flops / ms / 1e9})
        res["varlen"] = ms
    except Exception as exc:  # noqa: BLE001
        rows.append({"bench": "prefill_varlen", "error": repr(exc)[:200]})
    return res, flops


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    results: list[dict] = []
    check_store(results, gen)
    L3 = (32, 8, 128)
    for page in (16, 32):
        for batch in (1, 8, 32, 64, 128, 256):
            check_decode(results, gen, *L3, page, batch, 700, 1300)
    check_decode(results, gen, *L3, 16, 5, 1, 40)  # short contexts, many empty splits
    check_decode(results, gen, *L3, 16, 7, 300, 900, window=128)
    check_decode(results, gen, *L3, 16, 3, 800, 1000, splits=1)
    check_decode(results, gen, 4, 2, 16, 16, 6, 1, 100)  # tiny-model shape
    check_decode(results, gen, 28, 4, 128, 16, 4, 100, 600)  # group 7 (Qwen-like)
    check_decode(results, gen, *L3, 16, 9, 100, 900, cache_dtype=torch.float8_e4m3fn)
    check_prefill(results, gen, *L3, 16, [(0, 300), (0, 1), (37, 200), (500, 129), (16, 16)])
    check_prefill(results, gen, *L3, 32, [(0, 1000), (1024, 64)])
    check_prefill(results, gen, *L3, 16, [(0, 400), (200, 100)], window=96)
    check_prefill(results, gen, 4, 2, 16, 16, [(0, 50), (10, 7)])
    check_prefill(results, gen, 28, 4, 128, 16, [(0, 77), (64, 33)])
    bad = [r for r in results if not r["ok"]]
    for r in results:
        print(json.dumps(r))

    rows: list[dict] = []
    summary = []
    for batch in (1, 8, 32, 64, 128, 256):
        best = time_decode(rows, gen, batch, sweep=True)
        default = next(r for r in rows if r["bench"] == "decode" and r["batch"] == batch)
        summary.append(f"decode b={batch:3d} ctx=1024: default {default['us']:7.1f} us "
                       f"({default['GBps']:6.0f} GB/s) | best {best['us']:7.1f} us "
                       f"({best['GBps']:6.0f} GB/s) splits={best['splits']} bn={best['block_n']} "
                       f"w={best['warps']} st={best['stages']}")
    for nseq, qlen in ((1, 4096), (16, 512)):
        res, flops = time_prefill(rows, gen, nseq, qlen)
        summary.append(f"prefill {nseq}x{qlen}: " + ", ".join(
            f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in res.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_check.json").write_text(json.dumps({"checks": results, "timings": rows},
                                                         indent=1))
    print("\n".join(summary))
    print(f"checks: {len(results) - len(bad)}/{len(results)} ok")
    for r in bad:
        print("FAILED", json.dumps(r))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
