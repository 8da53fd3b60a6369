"""W8A8-int8 linears (shard/quantization/w8a8.py: Triton per-token quantize + int8 GEMM with a
fused rescale epilogue) vs bf16 on one GPU, Llama-3-8B shapes (issue 40: batch 256 faster than
bf16; ~3-5 minutes on an H100, most of it compiling and tuning the GEMM's candidates).

    python3 benchmarks/w8a8_check.py --out $OUT/w8a8.json   # also writes $OUT/w8a8.md

For the linear shapes (N x K: fused q/k/v 6144x4096, o 4096x4096, fused gate/up 28672x4096,
down 4096x14336), random int8 weights with per-channel scales:
  - check (GPU vs the CPU reference): the Triton quantize bit-equal to quantize_per_token on CPU;
    the Triton int8 GEMM's int32 sums equal to torch._int_mm's (exact integer sums both);
    W8A8Linear on CUDA vs the same layer on CPU (exact int32 sums, float32 rescale) at
    M = 1, 16, 256: max error relative to the largest output below 2^-7 (bf16 output rounding);
    the gate/up layer's SiLU-and-mul epilogue likewise (2^-6); each layer replayed in a CUDA graph
    bit-equal to its eager call;
  - time, batches M = 1, 16, 64, 256, 1024, 2048: W8A8Linear.forward (quantize + GEMM, all of
    it) against F.linear with the bf16 weight, both eager (CUDA events over a loop of calls) and
    under CUDA graphs (a captured loop of >= 16 calls replayed, as a decode step replays its
    layers); the int8 GEMM alone (Triton, the layer's tuned tile) against torch._int_mm (padded
    to 17 rows below 17, as the old path did), in graphs. Every loop cycles through weight copies
    that overflow the L2 twice, so each call streams its weight from DRAM.
Bytes per call: weight (+ scales) + activations in + output (+ the int8 activations written and
read back, W8A8); GB/s = bytes / time. Prints one line per shape and batch and the whole-layer
sums; writes the rows as JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.kernels.elementwise import silu_mul
from shard.kernels.int8_gemm import int8_mm, m_bucket
from shard.kernels.int8_quant import quantize_int8_per_token
from shard.quantization.int_weights import UnpackedInt
from shard.quantization.w8a8 import W8A8Linear, int8_matmul, quantize_per_token

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 16, 64, 256, 1024, 2048)
CHECK_BATCHES = (1, 16, 256)
MIN_CALLS = 16  # launches per captured graph
REPLAYS = 5


def layer(n: int, k: int, device: str, seed: int) -> W8A8Linear:
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(1, 256, (n, k), generator=g, dtype=torch.int16, device=device)
    scales = torch.rand(n, 1, generator=g, device=device) * 1e-3 + 1e-4
    w = UnpackedInt(q.to(torch.uint8), scales, torch.full_like(scales, 128.0),
                    torch.zeros(k, dtype=torch.int64, device=device), 8)
    return W8A8Linear(w)


def copies_for(nbytes: int) -> int:
    """How many weight copies overflow the L2 twice."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, math.ceil(2 * l2 / nbytes))


def eager_us(fn: Callable[[int], object], calls: int) -> float:
    """Mean microseconds per call of fn(i), i = 0..calls-1 (CUDA events, after a warm-up)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def graph_us(fn: Callable[[int], object], copies: int) -> float:
    """Median microseconds per call when >= MIN_CALLS calls fn(i) (cycling the copies) run back
    to back in one CUDA graph, replayed REPLAYS times."""
    calls = copies * math.ceil(MIN_CALLS / copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return 1e3 * statistics.median(times) / calls


def check(name: str, n: int, k: int) -> list[dict]:
    """GPU kernels vs the CPU reference (module docstring)."""
    cpu = layer(n, k, "cpu", seed=n + k)
    gpu = W8A8Linear(UnpackedInt((cpu.qweight.to(torch.int16) + 128).to(torch.uint8),
                                 cpu.weight_scale[:, None], torch.full((n, 1), 128.0),
                                 torch.zeros(k, dtype=torch.int64), 8)).to("cuda")
    t0 = time.perf_counter()
    gpu(torch.zeros(1, k, device="cuda", dtype=torch.bfloat16))  # tunes every batch bucket
    tune_s = time.perf_counter() - t0
    rows = []
    torch.manual_seed(n)
    x = (torch.randn(256, k) * torch.linspace(0.01, 30, 256)[:, None]).to(torch.bfloat16)
    q_got, s_got = quantize_int8_per_token(x.cuda())
    q_want, s_want = quantize_per_token(x)
    quant_ok = torch.equal(q_got.cpu(), q_want) and torch.equal(s_got.cpu(), s_want)
    for m_rows in (16, 256):
        mm_ok = torch.equal(int8_mm(q_got[:m_rows], gpu.qweight,
                                    gpu._gemm_configs[(torch.bfloat16, False)][m_bucket(m_rows)]),
                            int8_matmul(q_got[:m_rows], gpu.qweight))
        rows.append({"shape": name, "check": "int8_gemm_exact", "m": m_rows, "ok": mm_ok})
    rows.append({"shape": name, "check": "quantize_bit_equal", "m": 256, "ok": quant_ok,
                 "tune_s": tune_s})
    print(f"check {name}: quantize bit-equal {quant_ok}, int32 sums exact "
          f"{[r['ok'] for r in rows if r['check'] == 'int8_gemm_exact']}, tuning {tune_s:.1f} s",
          flush=True)
    for m_rows in CHECK_BATCHES:
        xm = x[:m_rows]
        # Under a CUDA graph (as a decode step replays it): bit-equal to the eager call.
        xg = xm.cuda()
        eager = gpu(xg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gpu(xg)
        graph.replay()
        torch.cuda.synchronize()
        rows.append({"shape": name, "check": "graph_equals_eager", "m": m_rows,
                     "ok": torch.equal(captured, eager)})
        del graph
        got = gpu(xm.cuda()).double().cpu()
        want = cpu(xm).double()  # CPU: the torch form (bf16 in and out)
        err = float((got - want).abs().max() / want.abs().max())
        rows.append({"shape": name, "check": "layer_vs_cpu", "m": m_rows, "rel_err": err,
                     "ok": err < 2**-7})
        print(f"check {name} M={m_rows}: rel err vs CPU {err:.2e}", flush=True)
        if name == "gate_up":  # the fused SiLU-and-mul epilogue vs the CPU's two steps
            got = gpu.forward_silu_mul(xm.cuda()).double().cpu()
            want = cpu.forward_silu_mul(xm).double()
            err = float((got - want).abs().max() / want.abs().max())
            rows.append({"shape": name, "check": "silu_mul_vs_cpu", "m": m_rows,
                         "rel_err": err, "ok": err < 2**-6})
            print(f"check {name} silu_mul M={m_rows}: rel err vs CPU {err:.2e}", flush=True)
    return rows


def time_shape(name: str, n: int, k: int, calls: int) -> list[dict]:
    w8_copies = copies_for(n * k)
    bf_copies = copies_for(2 * n * k)
    gpu = [layer(n, k, "cuda", seed=i) for i in range(w8_copies)]
    w_bf16 = [gpu[i % w8_copies].dequantized_weight(torch.bfloat16) for i in range(bf_copies)]
    rows = []
    for m_rows in BATCHES:
        x = torch.randn(m_rows, k, device="cuda", dtype=torch.bfloat16)
        for m in gpu:
            m(x)  # tunes (first layer of the shape) and loads, eagerly
        xq, _ = quantize_int8_per_token(x)
        config = gpu[0]._gemm_configs[(torch.bfloat16, False)][m_bucket(m_rows)]
        bf16 = lambda i, x=x: F.linear(x, w_bf16[i % bf_copies])
        w8a8 = lambda i, x=x: gpu[i % w8_copies](x)
        mm = lambda i, xq=xq, c=config: int8_mm(xq, gpu[i % w8_copies].qweight, c)
        int_mm = lambda i, xq=xq: int8_matmul(xq, gpu[i % w8_copies].qweight)
        r = {"shape": name, "n": n, "k": k, "m": m_rows, "config": str(config),
             "bf16_eager_us": eager_us(bf16, calls), "w8a8_eager_us": eager_us(w8a8, calls),
             "bf16_graph_us": graph_us(bf16, bf_copies), "w8a8_graph_us": graph_us(w8a8, w8_copies),
             "int8_gemm_graph_us": graph_us(mm, w8_copies),
             "torch_int_mm_graph_us": graph_us(int_mm, w8_copies)}
        r["bf16_bytes"] = 2 * n * k + 2 * m_rows * k + 2 * m_rows * n
        # at least: weight + scales, x, xq written and read back, the activation scales, y
        r["w8a8_bytes"] = (n * k + 4 * n + 2 * m_rows * k + 2 * m_rows * k + 4 * m_rows
                           + 2 * m_rows * n)
        r["bf16_graph_gbps"] = r["bf16_bytes"] / r["bf16_graph_us"] / 1e3
        r["w8a8_graph_gbps"] = r["w8a8_bytes"] / r["w8a8_graph_us"] / 1e3
        r["speedup_graph"] = r["bf16_graph_us"] / r["w8a8_graph_us"]
        r["speedup_eager"] = r["bf16_eager_us"] / r["w8a8_eager_us"]
        if name == "gate_up":
            # As the MLP runs it: bf16 GEMM + elementwise.silu_mul vs the W8A8 GEMM with the
            # SiLU-and-mul epilogue (one launch after the quantize).
            bf16_silu = lambda i, x=x: silu_mul(*F.linear(x, w_bf16[i % bf_copies]).chunk(2, -1))
            w8a8_silu = lambda i, x=x: gpu[i % w8_copies].forward_silu_mul(x)
            for m in gpu:
                m.forward_silu_mul(x)  # tunes the epilogue's tiles (first layer), eagerly
            r["bf16_silu_graph_us"] = graph_us(bf16_silu, bf_copies)
            r["w8a8_silu_graph_us"] = graph_us(w8a8_silu, w8_copies)
            r["bf16_silu_eager_us"] = eager_us(bf16_silu, calls)
            r["w8a8_silu_eager_us"] = eager_us(w8a8_silu, calls)
            print(f"gate_up+silu_mul M={m_rows:5d}: graph bf16 {r['bf16_silu_graph_us']:7.1f} us "
                  f"w8a8 {r['w8a8_silu_graph_us']:7.1f} | eager bf16 {r['bf16_silu_eager_us']:7.1f}"
                  f" w8a8 {r['w8a8_silu_eager_us']:7.1f}", flush=True)
        rows.append(r)
        print(f"{name:8s} M={m_rows:5d}: graph bf16 {r['bf16_graph_us']:7.1f} us  w8a8 "
              f"{r['w8a8_graph_us']:7.1f} ({r['speedup_graph']:.2f}x; GEMM alone "
              f"{r['int8_gemm_graph_us']:7.1f}, torch._int_mm {r['torch_int_mm_graph_us']:7.1f})"
              f" | eager bf16 {r['bf16_eager_us']:7.1f} w8a8 {r['w8a8_eager_us']:7.1f} "
              f"({r['speedup_eager']:.2f}x)  [{config.kwargs}]", flush=True)
    return rows


def markdown(device: str, checks: list[dict], rows: list[dict], totals: dict) -> str:
    lines = [f"# W8A8-int8 vs bf16 ({device})", "",
             f"Checks: {sum(c['ok'] for c in checks)} of {len(checks)} ok.", "",
             ("| shape | M | bf16 graph us | W8A8 graph us | speedup | int8 GEMM us | "
              "torch._int_mm us | bf16 eager us | W8A8 eager us | bf16 MB | W8A8 MB | "
              "bf16 GB/s | W8A8 GB/s |"), "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['m']} | {r['bf16_graph_us']:.1f} | {r['w8a8_graph_us']:.1f} | "
            f"{r['speedup_graph']:.2f}x | {r['int8_gemm_graph_us']:.1f} | "
            f"{r['torch_int_mm_graph_us']:.1f} | {r['bf16_eager_us']:.1f} | "
            f"{r['w8a8_eager_us']:.1f} | {r['bf16_bytes'] / 1e6:.1f} | "
            f"{r['w8a8_bytes'] / 1e6:.1f} | {r['bf16_graph_gbps']:.0f} | "
            f"{r['w8a8_graph_gbps']:.0f} |")
    lines += ["", "Per layer (sum of the four shapes):", "",
              ("| M | bf16 graph us | W8A8 graph us | speedup (graph) | bf16 eager us | "
               "W8A8 eager us | speedup (eager) |"), "|" + "---|" * 7]
    for m_rows, t in totals.items():
        lines.append(f"| {m_rows} | {t['bf16_graph_us']:.1f} | {t['w8a8_graph_us']:.1f} | "
                     f"{t['speedup_graph']:.2f}x | {t['bf16_eager_us']:.1f} | "
                     f"{t['w8a8_eager_us']:.1f} | {t['speedup_eager']:.2f}x |")
    silu_rows = [r for r in rows if "bf16_silu_graph_us" in r]
    if silu_rows:
        lines += ["", ("gate/up with SiLU-and-mul (bf16: GEMM + elementwise.silu_mul; W8A8: the "
                  "fused epilogue), and the layer sum with it:"), "",
                  ("| M | bf16 graph us | W8A8 graph us | bf16 eager us | W8A8 eager us | "
                  "layer bf16 graph us | layer W8A8 graph us | layer speedup (graph) |"),
                  "|" + "---|" * 8]
        for r in silu_rows:
            t = totals[r["m"]]
            lines.append(f"| {r['m']} | {r['bf16_silu_graph_us']:.1f} | "
                         f"{r['w8a8_silu_graph_us']:.1f} | {r['bf16_silu_eager_us']:.1f} | "
                         f"{r['w8a8_silu_eager_us']:.1f} | {t['bf16_graph_us_with_silu']:.1f} | "
                         f"{t['w8a8_graph_us_with_silu']:.1f} | "
                         f"{t['speedup_graph_with_silu']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    args = parser.parse_args()
    torch.manual_seed(0)
    checks, rows = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        checks += check(name, n, k)
        rows += time_shape(name, n, k, args.calls)
        torch.cuda.empty_cache()
    totals = {}
    for m_rows in BATCHES:
        sums = {key: sum(r[key] for r in rows if r["m"] == m_rows)
                for key in ("bf16_graph_us", "w8a8_graph_us", "bf16_eager_us", "w8a8_eager_us")}
        sums["speedup_graph"] = sums["bf16_graph_us"] / sums["w8a8_graph_us"]
        sums["speedup_eager"] = sums["bf16_eager_us"] / sums["w8a8_eager_us"]
        # As a decoder layer's MLP runs gate/up: with the SiLU-and-mul (when gate_up was timed)
        for kind in ("graph", "eager"):
            silu = [r for r in rows if r["m"] == m_rows and f"bf16_silu_{kind}_us" in r]
            if silu:
                g = silu[0]
                for p in ("bf16", "w8a8"):
                    sums[f"{p}_{kind}_us_with_silu"] = (sums[f"{p}_{kind}_us"] - g[f"{p}_{kind}_us"]
                                                       + g[f"{p}_silu_{kind}_us"])
                sums[f"speedup_{kind}_with_silu"] = (sums[f"bf16_{kind}_us_with_silu"]
                                                     / sums[f"w8a8_{kind}_us_with_silu"])
        totals[m_rows] = sums
        print(f"layer M={m_rows:5d}: graph bf16 {sums['bf16_graph_us']:8.1f} us  w8a8 "
              f"{sums['w8a8_graph_us']:8.1f} us  speedup {sums['speedup_graph']:.2f}x | eager "
              f"{sums['speedup_eager']:.2f}x  (target at 256: > 1)"
              + (f" | with silu_mul: graph {sums['speedup_graph_with_silu']:.2f}x"
                 if "speedup_graph_with_silu" in sums else ""), flush=True)
    ok = all(c["ok"] for c in checks)
    print(f"checks: {'all ok' if ok else 'FAILED'} ({sum(c['ok'] for c in checks)} of "
          f"{len(checks)})")
    if args.out:
        device = torch.cuda.get_device_name()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "checks": checks, "rows": rows,
                                        "layer_totals": totals}, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(device, checks, rows, totals))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
