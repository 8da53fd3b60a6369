"""W4A16 kernels on one GPU (issue 40): correctness of the compiled GEMV / GEMM, then int4 vs bf16 on
the Llama-3-8B linear shapes (< 6 minutes on an H100; benchmarks/run_int4_device.sh runs it).

    python3 benchmarks/int4_kernels.py --out $OUT

1. Correctness (compiled kernels, not the interpreter):
   - the interpreter tests' checks (tests/shard/test_triton_int_gemv_interpreter.py,
     test_triton_int_gemm_interpreter.py) executed with CUDA as torch's default device: the same
     shapes, group sizes, zero kinds, int4 / int8, split-K and IntLinear dispatch, against the same
     torch references and bounds;
   - split-K GEMV under CUDA-graph replay: every split-K candidate on the o_proj shape captured,
     replayed 3 times, equal to the eager result each time, counters back at zero; the same for
     the split-K GEMM candidates of the 32 / 64-row buckets (dq, lop3, lop3z) at M = 17..64;
   - every Llama shape at every measured M through IntLinear's tuned path vs
     x.float() @ W_bf16.float().T (W_bf16 = the same weight dequantized to bf16): max error / max
     |ref| <= 2^-7 (bf16 output rounding is < 2^-8).
2. Speed, 32 layers of random W4A16 group-128 weights (asymmetric: fp16 scale and zero per group),
   shapes N x K: qkv 6144x4096 (q/k/v merged), o 4096x4096, gate_up 28672x4096 (merged), down
   4096x14336; each layer its own weights (an int4 stack is ~3.5 GB, far beyond the L2):
   - int4: IntLinear (GEMV up to 16 rows, dequant-fused GEMM above; configs tuned at the first
     call: the tuning time is reported);
   - bf16: F.linear (cuBLAS), and for M <= 16 the repo's bf16 GEMV (shard/kernels/gemv.py,
     tuned as the decode dispatcher does); "bf16 best" is the faster per shape, what
     shard/layers/decode_linear.py would run.
   M = 1, 16, 64, 256: one CUDA graph of the 32 layers' calls of a shape (per linear), and one of
   the whole stack (qkv, o, gate_up, down x 32 layers), replayed 5 times, median. M = 2048
   (prefill): eager, CUDA events around the 32 calls, median of 5.
   Reported: microseconds, GB/s of the int4 bytes (packed weight + scales + zeros) and % of a
   measured device copy (1 GiB copy_, read + write) and of the spec bandwidth, bf16 / int4.
   The bf16 lm_head (128256 x 4096, not quantized) is timed apart at M = 1 and stated.
Targets (issue 40): batch-1 stack >= 75 % of the int4 roofline and >= 2.5x bf16; batch 64 int4 <=
bf16; prefill int4 <= 1.3x bf16.
Writes int4_kernels.json and int4_kernels.md under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shard.kernels import int_gemv
from shard.kernels.gemv import gemv, tune_gemv
from shard.kernels.gemv_buckets import m_bucket
from shard.quantization.int_weights import IntLinear, PackedInt

LAYERS = 32
GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GRAPH_MS = (1, 16, 64, 256)
PREFILL_M = 2048
LM_HEAD = (128256, 4096)
SPEC_GBPS = {"H100": 3350.0, "H200": 4800.0}  # SXM data sheets


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device copy, read + write."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 2**30 * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def capture_graph(calls: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(a CUDA graph of calls(), what the captured calls() returned); warmed up eagerly on a side
    stream first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    return graph, outs


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median microseconds of one replay of graph (after one untimed replay)."""
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def device_header() -> dict[str, Any]:
    """A report's device facts: name, measured copy GB/s, the data sheet's GB/s (None where the
    card is not in SPEC_GBPS), the weights' group and layer count."""
    name = torch.cuda.get_device_name()
    spec = next((v for key, v in SPEC_GBPS.items() if key in name), None)
    return {"device": name, "copy_GBps": copy_bandwidth(), "spec_GBps": spec, "group": GROUP,
            "layers": LAYERS}


def graph_us(calls: Callable[[], Any], replays: int = 5) -> float:
    """Median microseconds of one replay of a CUDA graph of calls() (warmed up eagerly)."""
    graph, _ = capture_graph(calls)
    return replay_us(graph, replays)


def stack_inputs(m: int) -> dict[str, torch.Tensor]:
    """x [m, K] bf16 for each of SHAPES' linears (the hidden size; down's the MLP's)."""
    xh = torch.randn(m, 4096, device="cuda").bfloat16()
    xi = torch.randn(m, 14336, device="cuda").bfloat16()
    return {"qkv": xh, "o": xh, "gate_up": xh, "down": xi}


def run_stack(lins: dict[str, list[Callable[[torch.Tensor], Any]]],
              xs: dict[str, torch.Tensor]) -> None:
    """Every layer's four linears (lins[shape][layer]), in order, on xs."""
    for layer in range(LAYERS):
        for shape in SHAPES:
            lins[shape][layer](xs[shape])


def eager_us(calls: Callable[[], None], repeats: int = 5) -> float:
    calls()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def random_packed(n: int, k: int, gen: torch.Generator) -> PackedInt:
    """Random W4A16 group-128 weight in the internal layout (bytes straight, no unpacking)."""
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    scales = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 0.002 + 0.0005).half()
    zeros = torch.randint(0, 16, (n, k // GROUP), device="cuda", generator=gen).half()
    return PackedInt(qweight, scales, zeros, 4, k, GROUP, None, None)


# ------------------------------------------------------------------------------- correctness


def interpreter_checks(report: dict[str, Any]) -> None:
    """The interpreter tests' check sources, run on CUDA tensors through the compiled kernels.
    Their IntLinears take each bucket's first candidate instead of timing every candidate on toy
    shapes (correctness only here; the Llama shapes below are tuned for real)."""
    from shard.kernels import int_tuning

    real_tune = int_tuning._tune
    int_tuning._tune = lambda w, dtype: int_tuning._defaults(w)
    results = {}
    for test, marker in (("test_triton_int_gemv_interpreter", "_CHECK"),
                         ("test_triton_int_gemm_interpreter", "_CHECK"),
                         ("test_triton_int_gemm_interpreter", "_SPLIT_CHECK")):
        source = (ROOT / "tests" / "shard" / f"{test}.py").read_text()
        check = source.split(f'\n{marker} = textwrap.dedent(\n    """', 1)[1].split('"""\n)', 1)[0]
        test = f"{test}{marker}" if marker != "_CHECK" else test
        t0 = time.perf_counter()
        try:
            torch.set_default_device("cuda")
            exec(compile("import torch\n" + textwrap.dedent(check), test, "exec"), {})  # noqa: S102
            results[test] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
            results[test] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-2000:]}
        finally:
            torch.set_default_device(None)
        results[test]["seconds"] = time.perf_counter() - t0
        print(f"check {test} on CUDA: {results[test]}", flush=True)
    int_tuning._tune = real_tune
    int_tuning._MEMO.clear()
    report["interpreter_checks_on_gpu"] = results


def splitk_graph_check(report: dict[str, Any]) -> None:
    n, k = SHAPES["o"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = random_packed(n, k, gen)
    ref_w = w.dequantize(torch.float32)
    counters = torch.zeros(n // 8, dtype=torch.int32, device="cuda")
    rows = []
    for m in (1, 4):
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = x.float() @ ref_w.t()
        for config in int_gemv.candidates(m, GROUP, k):
            if config.split_k == 1:
                continue
            out: list[torch.Tensor] = []

            def calls(x: torch.Tensor = x, config: int_gemv.GemvConfig = config,
                      out: list[torch.Tensor] = out) -> None:
                out.clear()
                for _ in range(3):
                    out.append(int_gemv.int4_gemv(x, w.qweight, w.scales, w.zeros, GROUP,
                                                  config=config, counters=counters))

            eager = int_gemv.int4_gemv(x, w.qweight, w.scales, w.zeros, GROUP, config=config,
                                       counters=counters)
            graph_us(calls, replays=3)  # captured, replayed 1 + 3 times
            torch.cuda.synchronize()
            same = all(torch.equal(o, eager) for o in out)
            err = float((eager.float() - ref).abs().max() / ref.abs().max())
            ok = same and err <= 2**-7 and int(counters.abs().sum()) == 0
            rows.append({"m": m, "config": config.as_dict(), "replays_equal_eager": same,
                         "max_err": err, "ok": ok})
            print(f"split-K graph M={m} {config}: equal {same} err {err:.1e} ok {ok}", flush=True)
    report["splitk_graph_check"] = rows


# ------------------------------------------------------------------------------------- speed


def family(config: str) -> str | None:
    """A GEMM candidate's family for the 32 / 64-row report (None: a GEMV config)."""
    if "GemmConfig" not in config:
        return None
    path = config.split("path='")[1].split("'")[0]
    if path == "dq":
        return ("dq split-K" if "split_k=1," not in config
                else "dq 8 warps" if "warps=8" in config else "dq")
    return path


def families(candidate_us: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per shape and GEMM bucket 32 / 64: the fastest candidate of each family (dq, dq 8 warps,
    dq split-K, lop3, lop3z, cublas, offset) and how many of it failed or were wrong."""
    out: dict[str, dict[str, Any]] = {}
    for key, times in candidate_us.items():
        if "/gemm/" not in key or int(key.rsplit("/", 1)[1]) > 64:
            continue
        fams: dict[str, dict[str, Any]] = {}
        for config, us in times.items():
            fam = family(config)
            if fam is None:
                continue
            row = fams.setdefault(fam, {"us": float("inf"), "config": None, "inf": 0})
            row["inf"] += us == float("inf")
            if us < row["us"]:
                row["us"], row["config"] = us, config
        out[key] = fams
    return out


def print_families(fams: dict[str, dict[str, Any]]) -> None:
    for key, rows in fams.items():
        best = min(r["us"] for r in rows.values())
        print(f"family {key}: " + "; ".join(
            f"{fam} {r['us']:.1f} us (x{best / r['us']:.2f} of best, {r['inf']} failed)"
            for fam, r in sorted(rows.items(), key=lambda kv: kv[1]["us"])), flush=True)
        for fam, r in sorted(rows.items(), key=lambda kv: kv[1]["us"])[:3]:
            print(f"  {fam}: {r['config']}", flush=True)


def lop3_vs_rest(candidate_us: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per shape and GEMV / GEMM bucket: the fastest lop3 candidate (PRMT / LOP3 inline-PTX
    unpack; GEMV buckets 1..16, GEMM path "lop3" at 32 / 64) against the fastest of the others,
    and how many lop3 candidates did not run or gave a wrong result (int_tuning checks their
    output before timing them; inf)."""

    def is_lop3(config: str) -> bool:
        return "lop3=True" in config or "path='lop3" in config  # lop3 and lop3z

    out: dict[str, dict[str, Any]] = {}
    for key, times in candidate_us.items():
        lop3 = {c: us for c, us in times.items() if is_lop3(c)}
        rest = {c: us for c, us in times.items() if not is_lop3(c)}
        if not lop3 or not rest:
            continue
        best_l = min(lop3, key=lop3.__getitem__)
        best_r = min(rest, key=rest.__getitem__)
        out[key] = {"lop3_us": lop3[best_l], "lop3_config": best_l, "other_us": rest[best_r],
                    "other_config": best_r, "speedup": rest[best_r] / lop3[best_l],
                    "lop3_inf": sum(us == float("inf") for us in lop3.values())}
    return out


def int4_bytes(lin: IntLinear) -> int:
    return lin.weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--m64", action="store_true",
                    help="only the 32 / 64-row GEMM buckets (main_m64: ~2 minutes)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.m64:
        main_m64(args.out)
        return
    t_start = time.perf_counter()
    torch.manual_seed(0)
    report: dict[str, Any] = device_header()
    bandwidth, spec = report["copy_GBps"], report["spec_GBps"]
    print(f"{report['device']}: copy {bandwidth:.0f} GB/s (spec {spec})", flush=True)

    def save() -> None:
        (args.out / "int4_kernels.json").write_text(json.dumps(report, indent=1, default=str))

    if not args.skip_checks:
        interpreter_checks(report)
        splitk_graph_check(report)
        gemm_splitk_graph_check(report)
        save()

    gen = torch.Generator(device="cuda").manual_seed(0)
    int4: dict[str, list[IntLinear]] = {}
    bf16: dict[str, list[torch.Tensor]] = {}
    tuning_s: dict[str, float] = {}
    bf16_gemv_cfg: dict[str, dict] = {}
    for shape, (n, k) in SHAPES.items():
        int4[shape] = [IntLinear(random_packed(n, k, gen)) for _ in range(LAYERS)]
        bf16[shape] = [lin.packed.dequantize(torch.bfloat16) for lin in int4[shape]]
        x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
        t0 = time.perf_counter()
        int4[shape][0](x)  # tunes every bucket of the shape (GEMV and GEMM)
        torch.cuda.synchronize()
        tuning_s[shape] = time.perf_counter() - t0
        for lin in int4[shape][1:]:
            lin(x)  # reads the tuned choice, loads it
        bf16_gemv_cfg[shape] = tune_gemv(bf16[shape][0], None, None, torch.bfloat16)
        tuned = int4[shape][0]._tuned[torch.bfloat16]
        print(f"[{time.perf_counter() - t_start:.0f} s] {shape}: int4 tuning "
              f"{tuning_s[shape]:.1f} s; GEMV "
              f"{ {b: c.as_dict() for b, c in tuned.gemv.items()} }; GEMM "
              f"{ {b: c.as_dict() for b, c in tuned.gemm.items()} }", flush=True)
    report["tuning_s"] = tuning_s
    from shard.kernels.int_tuning import TIMINGS

    # every candidate's time per shape and bucket (the next round's evidence: which variants win)
    names = {(n, k): shape for shape, (n, k) in SHAPES.items()}
    report["candidate_us"] = {f"{names.get((n, k), (n, k))}/{kind}/{bucket}": times
                              for (n, k, kind, bucket), times in TIMINGS.items()}
    for key, times in report["candidate_us"].items():
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        print(f"candidates {key}: " + "; ".join(f"{us:.1f} {c}" for c, us in ranked[:3])
              + f" ... slowest {ranked[-1][1]:.1f}", flush=True)
    report["lop3_vs_rest"] = lop3_vs_rest(report["candidate_us"])
    for key, row in report["lop3_vs_rest"].items():
        print(f"lop3 {key}: best lop3 {row['lop3_us']:.1f} us ({row['lop3_config']}) vs best "
              f"other {row['other_us']:.1f} us ({row['other_config']}) -> x{row['speedup']:.2f}; "
              f"lop3 candidates rejected as wrong or failed: {row['lop3_inf']}", flush=True)
    report["families"] = families(report["candidate_us"])
    print_families(report["families"])
    report["int4_configs"] = {
        s: {"gemv": {b: c.as_dict() for b, c in lins[0]._tuned[torch.bfloat16].gemv.items()},
            "gemm": {b: c.as_dict() for b, c in lins[0]._tuned[torch.bfloat16].gemm.items()}}
        for s, lins in int4.items()}
    bytes_int4 = {s: int4_bytes(lins[0]) for s, lins in int4.items()}
    bytes_bf16 = {s: ws[0].nbytes for s, ws in bf16.items()}
    report["bytes_per_layer"] = {"int4": bytes_int4, "bf16": bytes_bf16}

    # Correctness of the tuned paths on the real shapes.
    checks = {}
    for shape, (n, k) in SHAPES.items():
        for m in (*GRAPH_MS, PREFILL_M):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.float() @ bf16[shape][0].float().t()
            y = int4[shape][0](x)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            checks[f"{shape}/M={m}"] = {"max_err": err, "ok": err <= 2**-7}
            if err > 2**-7:
                print(f"CHECK FAILED {shape} M={m}: err {err:.2e}", flush=True)
    report["llama_shape_checks"] = checks
    print(f"llama-shape checks: {sum(c['ok'] for c in checks.values())}/{len(checks)} ok; worst "
          f"{max(c['max_err'] for c in checks.values()):.2e}", flush=True)
    save()

    rows: dict[str, dict[str, Any]] = {}
    for shape, (n, k) in SHAPES.items():
        for m in (*GRAPH_MS, PREFILL_M):
            x = torch.randn(m, k, device="cuda").bfloat16()
            timer = graph_us if m in GRAPH_MS else eager_us
            lins, ws = int4[shape], bf16[shape]
            t_int4 = timer(lambda lins=lins, x=x: [lin(x) for lin in lins]) / LAYERS
            t_cublas = timer(lambda ws=ws, x=x: [F.linear(x, w) for w in ws]) / LAYERS
            row = {"int4_us": t_int4, "bf16_cublas_us": t_cublas}
            if m <= 16:
                cfg = bf16_gemv_cfg[shape][m_bucket(m)]
                row["bf16_gemv_us"] = timer(
                    lambda ws=ws, x=x, cfg=cfg: [gemv(x, w, config=cfg) for w in ws]) / LAYERS
            row["bf16_best_us"] = min(v for key, v in row.items() if key.startswith("bf16_"))
            row["speedup_vs_bf16_best"] = row["bf16_best_us"] / t_int4
            row["int4_GBps"] = bytes_int4[shape] / (t_int4 / 1e6) / 1e9
            row["pct_copy"] = 100 * row["int4_GBps"] / bandwidth
            rows[f"{shape}/M={m}"] = row
            print(f"{shape:8s} M={m:5d} int4 {t_int4:8.1f} us ({row['int4_GBps']:5.0f} GB/s, "
                  f"{row['pct_copy']:4.1f}% copy) cuBLAS {t_cublas:8.1f} us"
                  + (f" bf16 GEMV {row['bf16_gemv_us']:7.1f} us" if "bf16_gemv_us" in row else "")
                  + f" -> x{row['speedup_vs_bf16_best']:.2f}", flush=True)
        save()
    report["per_linear"] = rows

    # Whole 32-layer stacks (the four linears of every layer, in order).
    stacks: dict[str, dict[str, Any]] = {}
    stack_bytes = LAYERS * sum(bytes_int4.values())
    for m in (*GRAPH_MS, PREFILL_M):
        timer = graph_us if m in GRAPH_MS else eager_us
        xs = stack_inputs(m)

        def int4_stack(xs: dict[str, torch.Tensor] = xs) -> None:
            run_stack(int4, xs)

        def bf16_stack(m: int = m, xs: dict[str, torch.Tensor] = xs) -> None:
            for layer in range(LAYERS):
                for shape in SHAPES:
                    row = rows[f"{shape}/M={m}"]
                    if m <= 16 and row["bf16_gemv_us"] < row["bf16_cublas_us"]:
                        gemv(xs[shape], bf16[shape][layer],
                             config=bf16_gemv_cfg[shape][m_bucket(m)])
                    else:
                        F.linear(xs[shape], bf16[shape][layer])

        t_int4 = timer(int4_stack)
        t_bf16 = timer(bf16_stack)
        gbps = stack_bytes / (t_int4 / 1e6) / 1e9
        stacks[str(m)] = {"int4_us": t_int4, "bf16_best_us": t_bf16,
                          "speedup_vs_bf16": t_bf16 / t_int4, "int4_GBps": gbps,
                          "pct_copy": 100 * gbps / bandwidth,
                          "pct_spec": None if spec is None else 100 * gbps / spec}
        print(f"stack M={m:5d}: int4 {t_int4 / 1e3:7.3f} ms ({gbps:5.0f} GB/s, "
              f"{100 * gbps / bandwidth:4.1f}% copy) bf16 {t_bf16 / 1e3:7.3f} ms "
              f"x{t_bf16 / t_int4:.2f}", flush=True)
    report["stack"] = {"int4_bytes": stack_bytes,
                       "bf16_bytes": LAYERS * sum(bytes_bf16.values()), "by_m": stacks}
    save()

    bf16.clear()
    torch.cuda.empty_cache()
    head = torch.randn(*LM_HEAD, device="cuda").bfloat16() * 0.01
    x = torch.randn(1, LM_HEAD[1], device="cuda").bfloat16()
    head_cfg = tune_gemv(head, None, None, torch.bfloat16)
    report["lm_head_bf16_M1"] = {
        "bytes": head.nbytes,
        "cublas_us": graph_us(lambda: [F.linear(x, head) for _ in range(4)]) / 4,
        "gemv_us": graph_us(lambda: [gemv(x, head, config=head_cfg[1]) for _ in range(4)]) / 4,
    }
    print(f"lm_head bf16 M=1 (not quantized; apart from the stacks): "
          f"{report['lm_head_bf16_M1']}", flush=True)
    report["seconds"] = time.perf_counter() - t_start
    save()
    (args.out / "int4_kernels.md").write_text(markdown(report))
    print(markdown(report))


# ------------------------------------------------------------- the 32 / 64-row buckets alone

M64_BUCKETS = (32, 64)
_TOP = 6  # candidates per shape and bucket re-timed in CUDA graphs


def _compile_worker(job: tuple[int, list[dict[str, Any]]]) -> list[str]:
    """Compiles (by launching once, on small weights with the Llama shapes' specializations:
    N, K, strides divisible by 16, whole tiles) GEMM candidates into Triton's disk cache, so that
    the tuning in the parent process finds them. Returns failures."""
    from shard.kernels.int_gemm import GemmConfig, int_gemm

    rows, configs = job
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_packed(512, 2048, gen)
    x = torch.randn(rows, 2048, device="cuda").bfloat16()
    failed = []
    for raw in configs:
        config = GemmConfig(**raw)
        try:
            int_gemm(x, w.qweight, w.scales, w.zeros, GROUP, config=config)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the tuner reports it again
            failed.append(f"{config}: {type(exc).__name__}: {str(exc)[:200]}")
    return failed


def precompile(workers: int = 12) -> dict[str, Any]:
    """Every 32 / 64-row GEMM candidate compiled in parallel processes (spawned: CUDA)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from shard.kernels import int_gemm

    jobs: list[tuple[int, list[dict[str, Any]]]] = []
    for rows in M64_BUCKETS:
        pool = [c.as_dict() for c in int_gemm.candidates(rows, GROUP, 4096) if c.path != "cublas"]
        jobs += [(rows, pool[i::workers // len(M64_BUCKETS)])
                 for i in range(workers // len(M64_BUCKETS))]
    t0 = time.perf_counter()
    failed: list[str] = []
    # (a worker that dies, e.g. an LLVM abort in Triton's compile, breaks the pool instead of
    # hanging it; the tuner then compiles what is missing itself)
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            failed = [f for part in ex.map(_compile_worker, jobs) for f in part]
    except BrokenProcessPool as exc:
        failed.append(f"a compile worker died: {exc}")
    return {"seconds": time.perf_counter() - t0, "failed": failed}


def gemm_splitk_graph_check(report: dict[str, Any]) -> None:
    """Every split-K GEMM candidate (dq, lop3, lop3z) of the 32 / 64-row buckets on the o_proj
    shape: three calls captured in a CUDA graph and replayed, equal to the eager call each time,
    counters back at zero, within 2^-7 of the fp32 reference."""
    from shard.kernels.int_gemm import candidates, int_gemm

    n, k = SHAPES["o"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = random_packed(n, k, gen)
    ref_w = w.dequantize(torch.float32)
    counters = torch.zeros(n // 8, dtype=torch.int32, device="cuda")
    rows = []
    for m in (64, 40, 32, 17):
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = x.float() @ ref_w.t()
        for config in candidates(max(32, 1 << (m - 1).bit_length()), GROUP, k):
            if config.split_k == 1:
                continue
            out: list[torch.Tensor] = []

            def calls(x: torch.Tensor = x, config: Any = config,
                      out: list[torch.Tensor] = out) -> None:
                out.clear()
                for _ in range(3):
                    out.append(int_gemm(x, w.qweight, w.scales, w.zeros, GROUP, config=config,
                                        counters=counters))

            try:
                eager = int_gemm(x, w.qweight, w.scales, w.zeros, GROUP, config=config,
                                 counters=counters)
                graph_us(calls, replays=3)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported
                rows.append({"m": m, "config": config.as_dict(), "ok": False,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(f"GEMM split-K graph M={m} {config}: FAILED {exc}", flush=True)
                continue
            same = all(torch.equal(o, eager) for o in out)
            err = float((eager.float() - ref).abs().max() / ref.abs().max())
            ok = same and err <= 2**-7 and int(counters.abs().sum()) == 0
            rows.append({"m": m, "config": config.as_dict(), "replays_equal_eager": same,
                         "max_err": err, "ok": ok})
            if not ok:
                print(f"GEMM split-K graph M={m} {config}: equal {same} err {err:.1e} FAILED",
                      flush=True)
    print(f"GEMM split-K graph checks: {sum(r['ok'] for r in rows)}/{len(rows)} ok", flush=True)
    report["gemm_splitk_graph_check"] = rows


def main_m64(out: Path) -> None:
    """The 32 / 64-row GEMM buckets alone (~2 minutes on an H100): candidates compiled in
    parallel; the new kernel paths' interpreter checks on CUDA and split-K under graph replay;
    per Llama shape IntLinear tuned for buckets 32 and 64 only (every candidate checked where
    new, timed by the tuner's do_bench), each bucket's 6 fastest re-timed in CUDA graphs over the
    32 layers' weights (as a decode step runs them); per-linear int4 vs cuBLAS and 32-layer
    stacks at M = 32 and 64 (IntLinear's choice, and the graph-fastest candidate per shape
    forced). Writes int4_kernels_m64.{json,md}; prints `family`, `graph`, `stack` lines."""
    from shard.kernels import int_tuning
    from shard.kernels.int_gemm import GemmConfig, gemm_bucket, int_gemm

    t_start = time.perf_counter()
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    report: dict[str, Any] = {"device": name, "copy_GBps": bandwidth, "group": GROUP,
                              "layers": LAYERS, "buckets": M64_BUCKETS}
    print(f"{name}: copy {bandwidth:.0f} GB/s", flush=True)

    def save() -> None:
        (out / "int4_kernels_m64.json").write_text(json.dumps(report, indent=1, default=str))

    report["precompile"] = precompile()
    print(f"[{time.perf_counter() - t_start:.0f} s] precompiled in "
          f"{report['precompile']['seconds']:.0f} s; failed: {report['precompile']['failed']}",
          flush=True)
    # the interpreter test of the new paths (dq split-K, lop3z), compiled, on CUDA
    source = (ROOT / "tests" / "shard" / "test_triton_int_gemm_interpreter.py").read_text()
    check = source.split('_SPLIT_CHECK = textwrap.dedent(\n    """', 1)[1].split('"""\n)', 1)[0]
    try:
        torch.set_default_device("cuda")
        exec(compile("import torch\n" + textwrap.dedent(check), "split_check", "exec"), {})  # noqa: S102
        report["split_check_on_gpu"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
        report["split_check_on_gpu"] = {"ok": False,
                                        "error": "".join(traceback.format_exception(exc))[-2000:]}
    finally:
        torch.set_default_device(None)
    print(f"check split / lop3z paths on CUDA: {report['split_check_on_gpu']}", flush=True)
    gemm_splitk_graph_check(report)
    save()

    # IntLinear tuned for the GEMM buckets 32 and 64 only (int_tuning reads these globals)
    int_tuning.M_BUCKETS = ()
    int_tuning.GEMM_M_BUCKETS = M64_BUCKETS
    gen = torch.Generator(device="cuda").manual_seed(0)
    int4: dict[str, list[IntLinear]] = {}
    bf16: dict[str, list[torch.Tensor]] = {}
    tuning_s: dict[str, float] = {}
    for shape, (n, k) in SHAPES.items():
        int4[shape] = [IntLinear(random_packed(n, k, gen)) for _ in range(LAYERS)]
        bf16[shape] = [lin.packed.dequantize(torch.bfloat16) for lin in int4[shape]]
        x = torch.zeros(64, k, device="cuda", dtype=torch.bfloat16)
        t0 = time.perf_counter()
        int4[shape][0](x)
        torch.cuda.synchronize()
        tuning_s[shape] = time.perf_counter() - t0
        for lin in int4[shape][1:]:
            lin(x)
        tuned = int4[shape][0]._tuned[torch.bfloat16]
        print(f"[{time.perf_counter() - t_start:.0f} s] {shape}: tuning {tuning_s[shape]:.1f} s; "
              f"{ {b: str(c) for b, c in tuned.gemm.items()} }", flush=True)
    report["tuning_s"] = tuning_s
    names = {(n, k): shape for shape, (n, k) in SHAPES.items()}
    report["candidate_us"] = {f"{names.get((n, k), (n, k))}/{kind}/{bucket}": times
                              for (n, k, kind, bucket), times in int_tuning.TIMINGS.items()}
    for key, times in report["candidate_us"].items():
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        print(f"candidates {key}: " + "; ".join(f"{us:.1f} {c}" for c, us in ranked[:4]),
              flush=True)
    report["families"] = families(report["candidate_us"])
    print_families(report["families"])
    report["int4_configs"] = {s: {b: c.as_dict() for b, c in lins[0]._tuned[torch.bfloat16]
                                  .gemm.items()} for s, lins in int4.items()}
    save()

    # each bucket's fastest candidates re-timed in CUDA graphs over the 32 layers' weights
    graph: dict[str, dict[str, float]] = {}
    graph_best: dict[tuple[str, int], GemmConfig] = {}
    configs = {str(c): c for m in M64_BUCKETS for c in
               (*int_tuning.int_gemm.candidates(m, GROUP, 4096),
                *int_tuning.int_gemm.candidates(m, GROUP, 14336))}
    for shape, (n, k) in SHAPES.items():
        for m in M64_BUCKETS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ranked = sorted(report["candidate_us"][f"{shape}/gemm/{m}"].items(),
                            key=lambda kv: kv[1])[:_TOP]
            times = {}
            for label, _ in ranked:
                c = configs[label]
                lins = int4[shape]
                try:
                    times[label] = graph_us(lambda c=c, x=x, lins=lins: [
                        int_gemm(x, lin.packed.qweight, lin.packed.scales, lin.packed.zeros,
                                 GROUP, config=c, counters=lin.splitk_counters)
                        for lin in lins]) / LAYERS
                except Exception as exc:  # noqa: BLE001 - reported
                    print(f"graph {shape}/{m} {c}: failed {exc}", flush=True)
                    times[label] = float("inf")
            graph[f"{shape}/{m}"] = times
            best = min(times, key=times.__getitem__)
            graph_best[(shape, m)] = configs[best]
            print(f"graph {shape}/gemm/{m}: " + "; ".join(
                f"{us:.1f} (tuner {dict(ranked)[c]:.1f}) {c}" for c, us in
                sorted(times.items(), key=lambda kv: kv[1])), flush=True)
    report["graph_us"] = graph
    save()

    checks, rows, stacks = {}, {}, {}
    for shape, (n, k) in SHAPES.items():
        for m in (*M64_BUCKETS, 40):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.float() @ bf16[shape][0].float().t()
            err = float((int4[shape][0](x).float() - ref).abs().max() / ref.abs().max())
            checks[f"{shape}/M={m}"] = {"max_err": err, "ok": err <= 2**-7}
            if err > 2**-7:
                print(f"CHECK FAILED {shape} M={m}: err {err:.2e}", flush=True)
        for m in M64_BUCKETS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            lins, ws = int4[shape], bf16[shape]
            t_int4 = graph_us(lambda lins=lins, x=x: [lin(x) for lin in lins]) / LAYERS
            t_cublas = graph_us(lambda ws=ws, x=x: [F.linear(x, w) for w in ws]) / LAYERS
            rows[f"{shape}/M={m}"] = {"int4_us": t_int4, "bf16_cublas_us": t_cublas,
                                      "speedup": t_cublas / t_int4}
            print(f"{shape:8s} M={m:3d} int4 {t_int4:7.1f} us cuBLAS {t_cublas:7.1f} us "
                  f"-> x{t_cublas / t_int4:.2f}", flush=True)
    report["llama_shape_checks"] = checks
    print(f"llama-shape checks: {sum(c['ok'] for c in checks.values())}/{len(checks)} ok",
          flush=True)
    report["per_linear"] = rows
    for m in M64_BUCKETS:
        xs = stack_inputs(m)

        def int4_stack(xs: dict[str, torch.Tensor] = xs) -> None:
            run_stack(int4, xs)

        def forced_stack(m: int = m, xs: dict[str, torch.Tensor] = xs) -> None:
            for layer in range(LAYERS):
                for shape in SHAPES:
                    lin = int4[shape][layer]
                    int_gemm(xs[shape], lin.packed.qweight, lin.packed.scales, lin.packed.zeros,
                             GROUP, config=graph_best[(shape, gemm_bucket(m))],
                             counters=lin.splitk_counters)

        def bf16_stack(xs: dict[str, torch.Tensor] = xs) -> None:
            for layer in range(LAYERS):
                for shape in SHAPES:
                    F.linear(xs[shape], bf16[shape][layer])

        t_int4, t_forced, t_bf16 = graph_us(int4_stack), graph_us(forced_stack), graph_us(bf16_stack)
        stacks[str(m)] = {"int4_us": t_int4, "int4_graph_best_us": t_forced, "bf16_us": t_bf16,
                          "speedup": t_bf16 / t_int4, "speedup_graph_best": t_bf16 / t_forced}
        print(f"stack M={m:3d}: int4 {t_int4 / 1e3:.3f} ms (graph-best forced "
              f"{t_forced / 1e3:.3f}) bf16 {t_bf16 / 1e3:.3f} ms -> x{t_bf16 / t_int4:.2f} "
              f"(forced x{t_bf16 / t_forced:.2f})", flush=True)
    report["stack"] = stacks
    report["seconds"] = time.perf_counter() - t_start
    save()
    lines = [f"## W4A16 32 / 64-row GEMM buckets, {name} (copy {bandwidth:.0f} GB/s)", "",
             "| linear | M | int4 us | bf16 cuBLAS us | bf16 / int4 | chosen |", "|---|---|---|---|---|---|"]
    for key, row in rows.items():
        shape, m = key.split("/M=")
        lines.append(f"| {shape} | {m} | {row['int4_us']:.1f} | {row['bf16_cublas_us']:.1f} | "
                     f"{row['speedup']:.2f} | {report['int4_configs'][shape][int(m)]} |")
    lines += ["", "| stack M | int4 ms | graph-best forced ms | bf16 ms | bf16 / int4 |",
              "|---|---|---|---|---|"]
    for m, st in stacks.items():
        lines.append(f"| {m} | {st['int4_us'] / 1e3:.3f} | {st['int4_graph_best_us'] / 1e3:.3f} | "
                     f"{st['bf16_us'] / 1e3:.3f} | {st['speedup']:.2f} |")
    (out / "int4_kernels_m64.md").write_text("\n".join(lines) + "\n")
    print(f"done in {report['seconds']:.0f} s", flush=True)


def _gemv_form(c: dict[str, Any]) -> str:
    return ("W" if c.get("wide") else "D" if c.get("diag") else "l" if c.get("lop3")
            else "w" if c.get("words") else "j" if c.get("join") else "h")


def markdown(r: dict[str, Any]) -> str:
    lines = [f"## W4A16 (group {r['group']}) vs bf16, Llama-3-8B shapes, {r['device']}", "",
             (f"Copy bandwidth {r['copy_GBps']:.0f} GB/s (spec {r['spec_GBps']}); int4 bytes per "
              f"layer {sum(r['bytes_per_layer']['int4'].values()):,} vs bf16 "
              f"{sum(r['bytes_per_layer']['bf16'].values()):,}; tuning "
              f"{sum(r['tuning_s'].values()):.0f} s for the four shapes."), "",
             ("| linear | M | int4 us | bf16 cuBLAS us | bf16 GEMV us | bf16 best / int4 "
              "| int4 GB/s | % copy |"), "|---|---|---|---|---|---|---|---|"]
    for key, row in r["per_linear"].items():
        shape, m = key.split("/M=")
        gemv_us = f"{row['bf16_gemv_us']:.1f}" if "bf16_gemv_us" in row else "-"
        lines.append(f"| {shape} | {m} | {row['int4_us']:.1f} | {row['bf16_cublas_us']:.1f} | "
                     f"{gemv_us} | {row['speedup_vs_bf16_best']:.2f} | {row['int4_GBps']:.0f} | "
                     f"{row['pct_copy']:.1f} |")
    lines += ["", (f"32-layer stack (q/k/v, o, gate/up, down), int4 bytes "
                   f"{r['stack']['int4_bytes']:,}:"), "",
              "| M | int4 ms | bf16 best ms | bf16 / int4 | int4 GB/s | % copy | % spec |",
              "|---|---|---|---|---|---|---|"]
    for m, s in r["stack"]["by_m"].items():
        pct_spec = "-" if s["pct_spec"] is None else f"{s['pct_spec']:.1f}"
        lines.append(f"| {m} | {s['int4_us'] / 1e3:.3f} | {s['bf16_best_us'] / 1e3:.3f} | "
                     f"{s['speedup_vs_bf16']:.2f} | {s['int4_GBps']:.0f} | {s['pct_copy']:.1f} | "
                     f"{pct_spec} |")
    lines += ["", ("Chosen kernels (GEMV bucket: W(ide) / D(iag) multi-group tiles, l(op3) / "
                   "w(ords) / j(oin) / h(alves), d(ot) / f(ma), "
                   "BNxBK / split-K; GEMM bucket: path BMxBNxBK, wf = weight first):")]
    for shape, cfg in r.get("int4_configs", {}).items():
        gemv_s = ", ".join(f"{b}: {_gemv_form(c)}"
                           f"{'d' if c['use_dot'] else 'f'}"
                           f"{c['block_n']}x{c['block_k']}/s{c['split_k']}"
                           for b, c in cfg["gemv"].items())
        gemm_s = ", ".join(f"{b}: {c.get('path', 'offset')} {c['block_m']}x{c['block_n']}x"
                           f"{c['block_k']}{' wf' if c['w_first'] else ''}"
                           f"{'/s' + str(c['split_k']) if c.get('split_k', 1) > 1 else ''}"
                           for b, c in cfg["gemm"].items())
        lines.append(f"- {shape}: GEMV {gemv_s}; GEMM {gemm_s}")
    if r.get("lop3_vs_rest"):
        lines += ["", ("Candidates: the fastest lop3 tile (PRMT / LOP3 unpack, tensor cores) "
                       "vs the fastest other, per shape and GEMV / GEMM bucket (tuning "
                       "times):"), "",
                   "| shape / bucket | lop3 us | other us | other / lop3 | lop3 wrong or failed |",
                   "|---|---|---|---|---|"]
        for key, row in r["lop3_vs_rest"].items():
            lines.append(f"| {key} | {row['lop3_us']:.1f} | {row['other_us']:.1f} | "
                         f"{row['speedup']:.2f} | {row['lop3_inf']} |")
    head = r.get("lm_head_bf16_M1")
    if head:
        lines += ["", (f"bf16 lm_head (128256 x 4096, {head['bytes']:,} B, not in the stacks) "
                       f"at M=1: cuBLAS {head['cublas_us']:.1f} us, GEMV {head['gemv_us']:.1f} us.")]
    by_m = r["stack"]["by_m"]
    lines += ["", ("Targets: batch 1 >= 75 % of copy and >= 2.5x bf16: "
                   f"{by_m['1']['pct_copy']:.1f} %, x{by_m['1']['speedup_vs_bf16']:.2f}; batch 64 "
                   f"bf16 / int4 >= 1: x{by_m['64']['speedup_vs_bf16']:.2f}; prefill int4 / bf16 "
                   f"<= 1.3: {1 / by_m[str(PREFILL_M)]['speedup_vs_bf16']:.2f}.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
