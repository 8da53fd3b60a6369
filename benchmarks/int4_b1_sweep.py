"""W4A16 batch-1 sweep on one GPU (issue 40): every GEMV candidate of the Llama-3-8B linears at
M = 1, checked and timed as a decode step runs them, then the 32-layer stacks int4 vs bf16 at
M = 1, 16, 64 (benchmarks/run_int4_b1_device.sh runs it, < 5 minutes on an H100 / H200).

    python3 benchmarks/int4_b1_sweep.py --out $OUT

0. The int-kernel interpreter tests' checks (tests/shard/test_triton_int_gemv_interpreter.py,
   test_triton_int_gemm_interpreter.py) run compiled on CUDA (benchmarks/int4_kernels.py's
   interpreter_checks): the wide / diag tiles at groups of 32 / 64 / 128, fractional zeros,
   tails, bias, split-K, stages 0 / 1 / 2, 1..16 rows.
1. Compile: every candidate this run launches (int_gemv.candidates(1, ...) per shape, the
   bucket-16 GEMV and bucket-64 GEMM candidates the stack tuning times, the bf16 GEMV) is
   compiled once in parallel worker processes (spawned, one launch each), which fills Triton's
   on-disk cache; the measuring process then only loads them.
2. Per shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336; 32 layers of
   random W4A16 group-128 weights, asymmetric, fp16 scales / zeros, each layer its own bytes)
   and per candidate at M = 1:
   - check: layer 0's eager output vs x.float() @ W.float().T (W dequantized in fp32),
     max error / max |ref| <= 2^-7; and after the timed CUDA graph's replays, its layer-0
     output equal to the eager one (split-K counters back at zero);
   - time: one CUDA graph of the 32 layers' calls, replayed 5 times, median / 32;
     GB/s over the int4 bytes a call reads (packed weight + scales + zeros) and % of a measured
     1 GiB device copy (read + write).
   A candidate that fails to compile, run or check gets no time (listed apart).
   Read-only probes: the packed rows streamed in a few tiles' access patterns (BLOCK_N x BLOCK_K,
   split-K) with no unpacking, the ceiling of each pattern (PROBES).
3. Stacks (qkv, o, gate_up, down x 32 layers in one CUDA graph): int4 through IntLinear (its
   own tuner: GEMV buckets 1 and 16 and GEMM bucket 64 tuned, int_tuning's bucket lists
   narrowed for this run) and, at M = 1, also with each shape's fastest candidate of step 2
   forced; bf16 the faster of cuBLAS and the repo's bf16 GEMV per shape (M <= 16).
Writes int4_b1_sweep.json and int4_b1_sweep.md under --out; prints a compact summary last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from int4_kernels import (
    GROUP,
    LAYERS,
    SHAPES,
    capture_graph,
    device_header,
    interpreter_checks,
    random_packed,
    replay_us,
)

from shard.kernels import int_gemm, int_gemv
from shard.kernels.int_gemm import GemmConfig
from shard.kernels.int_gemv import GemvConfig

# Configs (as dicts) that broke a worker's CUDA context while compiling (an illegal access would
# end this process's measurements too): not launched here, nor offered to the stack tuning.
CRASHED: list[dict[str, Any]] = []
STACK_MS = (1, 16, 64)
CHECK_BOUND = 2**-7
# Read-only probes (BLOCK_N rows x BLOCK_K features per step, warps, split-K): the packed rows
# streamed in a tile's access pattern with no unpacking, the bandwidth ceiling of that pattern.
# The earlier tiles' shapes (128 / 256 x 128: 64 B of a row per step) against the new ones.
PROBES = ((128, 128, 4, 1), (128, 128, 8, 8), (256, 128, 8, 8), (64, 512, 4, 2), (16, 1024, 4, 1),
          (16, 1024, 4, 4), (32, 1024, 4, 4), (8, 2048, 4, 1), (4, 2048, 4, 1))


@triton.jit
def _read_probe(q_ptr, out_ptr, N, KW_SPLIT, stride_qn, BLOCK_N: tl.constexpr,
                BLOCK_W: tl.constexpr):
    """XOR of the int32 words [rows, split's words] of a packed weight (BLOCK_N x BLOCK_W words
    per step, 16-byte vectors, evict-first): the loads of a GEMV tile without its arithmetic."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (q_ptr + rows.to(tl.int64) * stride_qn).to(tl.pointer_type(tl.int32))
    k_lo = tl.program_id(1) * KW_SPLIT
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for k in tl.range(k_lo, k_lo + KW_SPLIT, BLOCK_W, num_stages=1):
        offs = tl.max_contiguous(tl.multiple_of(k + tl.arange(0, BLOCK_W), 4), BLOCK_W)
        acc ^= tl.load(w_rows[:, None] + offs[None, :], mask=(offs < k_lo + KW_SPLIT)[None, :],
                       other=0, eviction_policy="evict_first")  # (a split's last step may be short)
    tl.store(out_ptr + tl.program_id(1) * N + rows, tl.xor_sum(acc, axis=1))


def probe_shape(shape: str, lins: list, bandwidth: float) -> list[dict[str, Any]]:
    """Each probe over the 32 layers' packed weights in one CUDA graph: GB/s of the packed
    bytes (scales and zeros not read) and % of copy."""
    n, k = SHAPES[shape]
    out = []
    for bn, bk, warps, split in PROBES:
        kw_split = k // 8 // split
        res = torch.empty(split, n, dtype=torch.int32, device="cuda")
        row: dict[str, Any] = {"name": f"probe {bn}x{bk} w{warps} sk{split}"}
        try:
            def calls(bn: int = bn, bk: int = bk, warps: int = warps, split: int = split,
                      kw_split: int = kw_split, res: torch.Tensor = res) -> list[torch.Tensor]:
                for lin in lins:
                    _read_probe[(n // bn, split)](lin.qweight, res, n, kw_split,
                                                  lin.qweight.stride(0), BLOCK_N=bn,
                                                  BLOCK_W=bk // 8, num_warps=warps)
                return [res]

            us, _ = graph_time(calls)
            row["us"] = us / LAYERS
            row["GBps"] = lins[0].qweight.nbytes / (row["us"] / 1e6) / 1e9
            row["pct_copy"] = 100 * row["GBps"] / bandwidth
            print(f"  {shape:8s} {row['us']:7.2f} us {row['GBps']:6.0f} GB/s "
                  f"{row['pct_copy']:5.1f}% copy  {row['name']}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"  {shape:8s} FAILED {row['name']}: {row['error']}", flush=True)
        out.append(row)
    return out


def family(c: GemvConfig) -> str:
    """The candidate's tile kind: the new multi-group tiles (wide / diag) or the older ones."""
    if c.wide:
        return ("wide", "wptx", "wquad")[c.ptx]
    if c.diag:
        return "diag"
    if c.lop3:
        return "lop3"
    if c.words:
        return "words"
    if c.use_dot:
        return "dot"
    return "join" if c.join else "halves"


def short(c: GemvConfig) -> str:
    return (f"{family(c)} {c.block_n}x{c.block_k} w{c.warps} st{c.stages} sk{c.split_k}"
            f"{f' persist{c.persist}' if c.persist else ''}"
            f"{f' maxnreg{c.maxnreg}' if c.maxnreg else ''}{' pdl' if c.pdl else ''}")


# ------------------------------------------------------------------------ parallel compile


def _warm(task: tuple[str, str, int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Worker: one launch per config at the task's shape and batch (compiles into Triton's
    on-disk cache). Returns what failed."""
    shape, kind, bucket, configs = task
    t0 = time.perf_counter()
    torch.cuda.set_device(0)
    n, k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(1)
    fails = []
    if kind == "bf16":
        from shard.kernels.gemv import tune_gemv

        w = torch.randn(n, k, device="cuda", generator=gen).bfloat16()
        try:
            tune_gemv(w, None, None, torch.bfloat16, cached=False)
        except Exception as exc:  # noqa: BLE001 - reported; the main process retries anyway
            fails.append(f"bf16 gemv: {type(exc).__name__}: {str(exc)[:200]}")
        return {"task": f"{shape}/bf16", "n": 1, "fails": fails,
                "seconds": time.perf_counter() - t0}
    w = random_packed(n, k, gen)
    x = torch.randn(bucket, k, device="cuda", generator=gen).bfloat16()
    counters = torch.zeros(-(-n // 8), dtype=torch.int32, device="cuda")
    crashed = []
    for raw in configs:
        try:
            if kind == "gemv":
                int_gemv.int4_gemv(x, w.qweight, w.scales, w.zeros, GROUP,
                                   config=GemvConfig(**raw), counters=counters)
            else:
                int_gemm.int_gemm(x, w.qweight, w.scales, w.zeros, GROUP,
                                  config=GemmConfig(**raw), counters=counters)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the measuring process reports it too
            fails.append(f"{raw}: {type(exc).__name__}: {str(exc)[:200]}")
            if "CUDA error" in str(exc) or "illegal" in str(exc):
                # this worker's context is gone: the measuring process must not launch it
                crashed.append(raw)
                break
    return {"task": f"{shape}/{kind}/{bucket}", "n": len(configs), "fails": fails,
            "crashed": crashed, "seconds": time.perf_counter() - t0}


def warm_all(report: dict[str, Any]) -> None:
    tasks: list[tuple[str, str, int, list[dict[str, Any]]]] = []
    for shape, (_, k) in SHAPES.items():
        tasks.append((shape, "bf16", 1, []))
        for kind, bucket, pool in (("gemv", 1, int_gemv.candidates(1, GROUP, k)),
                                   ("gemv", 16, int_gemv.candidates(16, GROUP, k)),
                                   ("gemm", 64, int_gemm.candidates(64, GROUP, k))):
            raws = [asdict(c) for c in pool]
            step = 6  # configs per task: enough tasks to keep every worker busy
            tasks += [(shape, kind, bucket, raws[i:i + step]) for i in range(0, len(raws), step)]
        # the untuned GEMM buckets' first candidates, which IntLinear loads at 32 rows
        firsts = {repr(c): c for c in (int_gemm.candidates(b, GROUP, k)[0]
                                       for b in int_gemm.GEMM_M_BUCKETS)}
        tasks.append((shape, "gemm", 32, [asdict(c) for c in firsts.values()]))
    workers = max(2, min(14, (os.cpu_count() or 4) - 2))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_warm, tasks))
    fails = [f for r in results for f in r["fails"]]
    report["compile"] = {"workers": workers, "tasks": len(tasks),
                         "launches": sum(r["n"] for r in results),
                         "seconds": time.perf_counter() - t0, "failures": fails,
                         "crashed": [c for r in results for c in r.get("crashed", [])]}
    CRASHED.extend(report["compile"]["crashed"])
    print(f"[compile] {len(tasks)} tasks, {report['compile']['launches']} launches on {workers} "
          f"workers in {report['compile']['seconds']:.0f} s; {len(fails)} failed", flush=True)
    for f in fails[:20]:
        print(f"[compile] failed: {f}", flush=True)


# ----------------------------------------------------------------------------- timing


def graph_time(calls: Callable[[], list[torch.Tensor]], replays: int = 5
               ) -> tuple[float, list[torch.Tensor]]:
    """(median microseconds of one replay of a CUDA graph of calls(), the graph's outputs after
    the replays); warmed up eagerly on a side stream first."""
    graph, outs = capture_graph(calls)
    us = replay_us(graph, replays)
    outs = [o.clone() for o in outs]  # out of the graph's pool before it goes
    del graph
    return us, outs


def sweep_shape(shape: str, lins: list, ref_w: torch.Tensor, bandwidth: float
                ) -> dict[str, Any]:
    """Every M = 1 candidate of the shape: checked, timed over the 32 layers in one graph."""
    k = SHAPES[shape][1]
    x = torch.randn(1, k, device="cuda").bfloat16()
    ref = x.float() @ ref_w.t()
    nbytes = lins[0].weight_bytes
    rows = []
    for c in int_gemv.candidates(1, GROUP, k):
        row: dict[str, Any] = {"config": asdict(c), "name": short(c), "family": family(c)}
        if asdict(c) in CRASHED:
            row["error"] = "crashed a compile worker's CUDA context: not launched"
            rows.append(row)
            continue
        try:
            def one(lin: Any, c: GemvConfig = c) -> torch.Tensor:
                return int_gemv.int4_gemv(x, lin.qweight, lin.scales, lin.zeros, GROUP,
                                          config=c, counters=lin.splitk_counters)

            eager = one(lins[0])
            torch.cuda.synchronize()
            err = float((eager.float() - ref).abs().max() / ref.abs().max())
            row["max_err"] = err
            if not err <= CHECK_BOUND:
                row["error"] = f"wrong result: max error {err:.2e} of max |y|"
            else:
                us, outs = graph_time(lambda: [one(lin) for lin in lins])
                same = torch.equal(outs[0], eager)
                counters_zero = all(int(lin.splitk_counters.abs().sum()) == 0 for lin in lins)
                row.update(us=us / LAYERS, graph_equal_eager=same, counters_zero=counters_zero)
                row["GBps"] = nbytes / (row["us"] / 1e6) / 1e9
                row["pct_copy"] = 100 * row["GBps"] / bandwidth
                if not (same and counters_zero):
                    row["error"] = (f"graph replay differs from eager ({same}) or counters not "
                                    f"zero ({counters_zero})")
        except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        if "us" in row and "error" not in row:
            print(f"  {shape:8s} {row['us']:7.2f} us {row['GBps']:6.0f} GB/s "
                  f"{row['pct_copy']:5.1f}% copy  {row['name']}", flush=True)
        else:
            print(f"  {shape:8s} FAILED {row['name']}: {row.get('error')}", flush=True)
    ok = [r for r in rows if "us" in r and "error" not in r]
    ok.sort(key=lambda r: r["us"])
    best_by_family: dict[str, dict[str, Any]] = {}
    for r in ok:
        best_by_family.setdefault(r["family"], r)
    # PDL on vs off for the same tile (the candidates that come in both forms)
    by_config = {json.dumps(r["config"], sort_keys=True): r for r in ok}
    pdl_pairs = []
    for r in ok:
        if r["config"].get("pdl"):
            twin = by_config.get(json.dumps({**r["config"], "pdl": False}, sort_keys=True))
            if twin is not None:
                pdl_pairs.append({"name": r["name"], "pdl_us": r["us"], "no_pdl_us": twin["us"]})
    return {"bytes": nbytes, "candidates": rows, "best": ok[0] if ok else None,
            "best_by_family": best_by_family, "pdl_pairs": pdl_pairs,
            "failed": [r for r in rows if "error" in r]}


# ------------------------------------------------------------------------------- stacks


def narrow_tuning() -> None:
    """IntLinear tunes only the buckets this run times (GEMV 1 and 16, GEMM 64); the others
    keep their first candidate (int_tuning's CPU default), launched once at load, never
    timed."""
    from shard.kernels import int_tuning

    int_tuning.M_BUCKETS = (1, 16)
    int_tuning.GEMM_M_BUCKETS = (64,)
    real = int_tuning._tune
    if CRASHED:
        gemv_pool, gemm_pool = int_gemv.candidates, int_gemm.candidates
        int_gemv.candidates = lambda *a: [c for c in gemv_pool(*a) if asdict(c) not in CRASHED]
        int_gemm.candidates = lambda *a: [c for c in gemm_pool(*a) if asdict(c) not in CRASHED]

    def tune(w: Any, dtype: torch.dtype) -> Any:
        tuned = real(w, dtype)
        k = w.in_features
        gemv = {b: tuned.gemv.get(b) or int_gemv.candidates(b, w.group_size, k)[0]
                for b in (1, 2, 4, 8, 16)}
        gemm = {b: tuned.gemm.get(b) or int_gemm.candidates(b, w.group_size, k)[0]
                for b in int_gemm.GEMM_M_BUCKETS}
        return int_tuning.IntTuning(gemv, gemm)

    int_tuning._tune = tune


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-warm", action="store_true", help="skip the parallel compile")
    ap.add_argument("--skip-checks", action="store_true",
                    help="skip the interpreter tests' checks run on CUDA")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    report: dict[str, Any] = {**device_header(), "torch": torch.__version__,
                              "triton": triton.__version__}
    bandwidth = report["copy_GBps"]
    print(f"{report['device']}: copy {bandwidth:.0f} GB/s (spec {report['spec_GBps']}); torch "
          f"{torch.__version__}, triton {triton.__version__}", flush=True)

    def save() -> None:
        (args.out / "int4_b1_sweep.json").write_text(json.dumps(report, indent=1, default=str))

    if not args.no_warm:
        try:
            warm_all(report)
        except Exception as exc:  # noqa: BLE001 - e.g. a worker died: this process compiles
            report["compile"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"[compile] parallel compile failed ({report['compile']['error']}); "
                  "compiling in the measuring process instead", flush=True)
        save()
    if not args.skip_checks:
        # the int-kernel interpreter tests' checks, compiled (wide / diag: groups of 32 / 64 /
        # 128, fractional zeros, tails, bias, split-K, stages 0 / 1 / 2, 1..16 rows)
        interpreter_checks(report)
        save()

    from shard.quantization.int_weights import IntLinear

    gen = torch.Generator(device="cuda").manual_seed(0)
    int4: dict[str, list[IntLinear]] = {}
    bf16: dict[str, list[torch.Tensor]] = {}
    report["shapes"] = {}
    for shape, (n, k) in SHAPES.items():
        int4[shape] = [IntLinear(random_packed(n, k, gen)) for _ in range(LAYERS)]
        bf16[shape] = [lin.packed.dequantize(torch.bfloat16) for lin in int4[shape]]
        t0 = time.perf_counter()
        ref_w = int4[shape][0].packed.dequantize(torch.float32)
        report["shapes"][shape] = sweep_shape(shape, int4[shape], ref_w, bandwidth)
        del ref_w
        report["shapes"][shape]["probes"] = probe_shape(shape, int4[shape], bandwidth)
        report["shapes"][shape]["seconds"] = time.perf_counter() - t0
        best = report["shapes"][shape]["best"]
        print(f"[{time.perf_counter() - t_start:.0f} s] {shape}: best "
              f"{best['name'] if best else None}", flush=True)
        save()

    try:
        stacks(report, int4, bf16, bandwidth)
    except Exception as exc:  # noqa: BLE001 - the sweep's results still get their summary
        report["stack_error"] = "".join(traceback.format_exception(exc))[-2000:]
        print(f"STACKS FAILED: {report['stack_error']}", flush=True)
    report["seconds"] = time.perf_counter() - t_start
    save()
    md = markdown(report)
    (args.out / "int4_b1_sweep.md").write_text(md)
    print(md)
    print(summary(report))


def stacks(report: dict[str, Any], int4: dict[str, list], bf16: dict[str, list[torch.Tensor]],
           bandwidth: float) -> None:
    """The 32-layer stacks (qkv, o, gate_up, down per layer) int4 vs bf16 at STACK_MS, into
    report["stack"] as they come."""
    narrow_tuning()
    from shard.kernels.gemv import gemv, tune_gemv

    tuning_s = {}
    bf16_cfg = {}
    for shape, (_, k) in SHAPES.items():
        t0 = time.perf_counter()
        x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
        for lin in int4[shape]:
            lin(x)  # the first tunes the shape (GEMV 1, 16; GEMM 64), the rest load the choice
        torch.cuda.synchronize()
        tuning_s[shape] = time.perf_counter() - t0
        bf16_cfg[shape] = tune_gemv(bf16[shape][0], None, None, torch.bfloat16)
    report["stack_tuning_s"] = tuning_s
    tuned = {s: lins[0]._tuned[torch.bfloat16] for s, lins in int4.items()}
    report["tuner_choice"] = {s: {"gemv1": short(t.gemv[1]), "gemv16": short(t.gemv[16]),
                                  "gemm64": str(t.gemm[64])} for s, t in tuned.items()}
    stack_bytes = LAYERS * sum(lins[0].weight_bytes for lins in int4.values())
    by_m: dict[str, dict[str, Any]] = {}
    report["stack"] = {"int4_bytes": stack_bytes, "by_m": by_m}
    for m in STACK_MS:
        xs = {"qkv": torch.randn(m, 4096, device="cuda").bfloat16(),
              "down": torch.randn(m, 14336, device="cuda").bfloat16()}
        xs["o"] = xs["gate_up"] = xs["qkv"]

        def int4_stack(xs: dict[str, torch.Tensor] = xs) -> list[torch.Tensor]:
            return [int4[s][layer](xs[s]) for layer in range(LAYERS) for s in SHAPES]

        # bf16: per shape the faster of cuBLAS and the bf16 GEMV (M <= 16), timed per shape
        use_gemv = {}
        for s in SHAPES:
            t_cublas, _ = graph_time(lambda s=s, xs=xs: [F.linear(xs[s], w) for w in bf16[s]])
            use_gemv[s] = False
            if m <= 16:
                cfg = bf16_cfg[s][m]
                t_gemv, _ = graph_time(
                    lambda s=s, xs=xs, cfg=cfg: [gemv(xs[s], w, config=cfg) for w in bf16[s]])
                use_gemv[s] = t_gemv < t_cublas

        def bf16_stack(m: int = m, xs: dict[str, torch.Tensor] = xs,
                       use_gemv: dict[str, bool] = use_gemv) -> list[torch.Tensor]:
            out = []
            for layer in range(LAYERS):
                for s in SHAPES:
                    w = bf16[s][layer]
                    out.append(gemv(xs[s], w, config=bf16_cfg[s][m]) if use_gemv[s]
                               else F.linear(xs[s], w))
            return out

        t_int4, _ = graph_time(int4_stack)
        t_bf16, _ = graph_time(bf16_stack)
        row = {"int4_us": t_int4, "bf16_us": t_bf16, "speedup_vs_bf16": t_bf16 / t_int4,
               "int4_GBps": stack_bytes / (t_int4 / 1e6) / 1e9,
               "bf16_gemv_shapes": [s for s, g in use_gemv.items() if g]}
        row["pct_copy"] = 100 * row["int4_GBps"] / bandwidth
        if m == 1:  # also with each shape's fastest sweep candidate forced
            saved = {s: t.gemv[1] for s, t in tuned.items()}
            for s, t in tuned.items():
                best = report["shapes"][s]["best"]
                if best is not None:
                    t.gemv[1] = GemvConfig(**best["config"])
            t_best, _ = graph_time(int4_stack)
            for s, t in tuned.items():
                t.gemv[1] = saved[s]
            row["int4_sweep_best_us"] = t_best
            row["sweep_best_speedup_vs_bf16"] = t_bf16 / t_best
            row["sweep_best_pct_copy"] = (100 * stack_bytes / (t_best / 1e6) / 1e9
                                          / bandwidth)
        by_m[str(m)] = row
        print(f"stack M={m:3d}: int4 {t_int4 / 1e3:.3f} ms ({row['pct_copy']:.1f}% copy) bf16 "
              f"{t_bf16 / 1e3:.3f} ms x{row['speedup_vs_bf16']:.2f}"
              + (f"; sweep-best int4 {row['int4_sweep_best_us'] / 1e3:.3f} ms "
                 f"({row['sweep_best_pct_copy']:.1f}% copy) "
                 f"x{row['sweep_best_speedup_vs_bf16']:.2f}" if m == 1 else ""), flush=True)

def markdown(r: dict[str, Any]) -> str:
    lines = [f"## W4A16 batch-1 sweep, Llama-3-8B shapes, {r['device']}", "",
             (f"Copy bandwidth {r['copy_GBps']:.0f} GB/s (spec {r['spec_GBps']}); torch "
              f"{r['torch']}, Triton {r['triton']}; group {r['group']}, {r['layers']} layers "
              f"per shape, each candidate timed over the 32 layers in one CUDA graph."), ""]
    for shape, s in r["shapes"].items():
        lines += [(f"### {shape} {SHAPES[shape][0]}x{SHAPES[shape][1]} ({s['bytes']:,} int4 "
                   f"bytes a call)"), "", "| candidate | us | GB/s | % copy | max err |",
                  "|---|---|---|---|---|"]
        for row in sorted(s["candidates"], key=lambda x: x.get("us", math.inf)
                          if "error" not in x else math.inf):
            if "error" in row:
                lines.append(f"| {row['name']} | failed: {row['error'][:80]} | | | |")
            else:
                lines.append(f"| {row['name']} | {row['us']:.2f} | {row['GBps']:.0f} | "
                             f"{row['pct_copy']:.1f} | {row['max_err']:.1e} |")
        for row in s.get("probes", []):  # read-only: packed bytes only, no check
            if "us" in row:
                lines.append(f"| {row['name']} (read only) | {row['us']:.2f} | "
                             f"{row['GBps']:.0f} | {row['pct_copy']:.1f} | - |")
        lines.append("")
    st = r.get("stack")
    if st:
        lines += [f"### 32-layer stacks ({st['int4_bytes']:,} int4 bytes)", "",
                  "| M | int4 ms | bf16 ms | bf16 / int4 | int4 % copy | int4 sweep-best ms |",
                  "|---|---|---|---|---|---|"]
        for m, row in st["by_m"].items():
            best = ((f"{row['int4_sweep_best_us'] / 1e3:.3f} "
                     f"(x{row['sweep_best_speedup_vs_bf16']:.2f}, {row['sweep_best_pct_copy']:.1f} %)")
                    if "int4_sweep_best_us" in row else "-")
            lines.append(f"| {m} | {row['int4_us'] / 1e3:.3f} | {row['bf16_us'] / 1e3:.3f} | "
                         f"{row['speedup_vs_bf16']:.2f} | {row['pct_copy']:.1f} | {best} |")
    return "\n".join(lines) + "\n"


def summary(r: dict[str, Any]) -> str:
    """The last lines of the log: what the lead reads."""
    out = ["", "=" * 30 + " SUMMARY " + "=" * 30,
           ("interpreter checks on CUDA: " + ", ".join(
               f"{name.split('_')[-2]} {'ok' if c['ok'] else 'FAILED'}"
               for name, c in r.get("interpreter_checks_on_gpu", {}).items())),
           (f"device {r['device']}, copy {r['copy_GBps']:.0f} GB/s, triton {r['triton']}; "
            f"compile {r.get('compile', {}).get('seconds', 0):.0f} s "
            f"({len(r.get('compile', {}).get('failures', []))} failed), total "
            f"{r.get('seconds', 0):.0f} s")]
    for shape, s in r["shapes"].items():
        fams = s["best_by_family"]
        best = s["best"]
        out.append(f"{shape:8s} best {best['name'] if best else '-'}: "
                   + (f"{best['us']:.2f} us {best['pct_copy']:.1f}% copy" if best else "")
                   + " | per family: " + ", ".join(
                       f"{f} {row['us']:.2f}" for f, row in sorted(fams.items(),
                                                                  key=lambda kv: kv[1]["us"])))
        probes = sorted((p for p in s.get("probes", []) if "us" in p),
                        key=lambda p: p["us"])
        if probes:
            out.append(f"{'':8s} read-only probes (% copy): " + ", ".join(
                f"{p['name'][6:]} {p['pct_copy']:.0f}" for p in probes))
        if s.get("pdl_pairs"):
            out.append(f"{'':8s} PDL on/off: " + ", ".join(
                f"{p['name']} {p['pdl_us']:.2f}/{p['no_pdl_us']:.2f}" for p in s["pdl_pairs"]))
        if s["failed"]:
            out.append(f"{'':8s} {len(s['failed'])} failed: "
                       + "; ".join(f"{row['name']} ({row['error'][:60]})"
                                   for row in s["failed"][:4]))
    for shape, choice in r.get("tuner_choice", {}).items():
        out.append(f"tuner {shape:8s} gemv1 {choice['gemv1']} | gemv16 {choice['gemv16']}")
    for m, row in r.get("stack", {}).get("by_m", {}).items():
        line = (f"STACK M={m:>3s}: int4 {row['int4_us'] / 1e3:.3f} ms ({row['pct_copy']:.1f}% "
                f"copy) vs bf16 {row['bf16_us'] / 1e3:.3f} ms -> x{row['speedup_vs_bf16']:.2f}")
        if "int4_sweep_best_us" in row:
            line += (f"; sweep-best per shape {row['int4_sweep_best_us'] / 1e3:.3f} ms "
                     f"({row['sweep_best_pct_copy']:.1f}% copy, x"
                     f"{row['sweep_best_speedup_vs_bf16']:.2f})")
        out.append(line)
    if r.get("stack_error"):
        out.append("STACKS FAILED: " + r["stack_error"].strip().splitlines()[-1][:300])
    out.append("targets: M=1 >= 75% copy and >= 2.5x bf16; M=64 >= 1.0x bf16")
    return "\n".join(out)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
