"""Issue 43, part 2: a Llama-3-70B-shaped model served with `--num-shard 4` on one 4-GPU host, in
one call (benchmarks/run_tp4_70b_device.sh runs it; benchmarks/harness/scale.py says what each
part measures).

    python -m benchmarks.tp_scale --out DIR [--layers 80] [--tp4-layers 8,16,80] [--tp2-layers 8,16]
    python -m benchmarks.tp_scale --fake --out DIR    # the same on CPU (gloo, a small model)

Parts, each saved as soon as it ends (results.json, RESULTS.md under --out): ceilings (copy
bandwidth, bf16 matmul), checkpoint (written under --write-budget-s), decode at TP=4 per layer
count, decode at TP=2 (GPUs 0 and 1), end to end (`tokenwire launch --num-shard 4`, the harness's
workload, with the shards' start-up log lines and host memory). The end-to-end part starts only
if --e2e-latest-start-s has not passed (what is not run is said, never guessed). Every part
shares one GEMV tuning cache (--tuning-cache-dir): the TP=4 ranks measure each shape once
between them, and the e2e deployment reads what the TP=4 part measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.harness import scale

START = time.time()


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--out", type=Path, required=True)
    a("--workdir", type=Path, default=None,
      help="model directories (default: /dev/shm/tw70b when the tmpfs has room, else /tmp/tw70b)")
    a("--layers", type=int, default=80, help="layers to write (80 = Llama-3-70B)")
    a("--tp4-layers", default="8,16,80", help="layer counts measured at TP=4 (capped at written)")
    a("--tp2-layers", default="8,16", help="layer counts measured at TP=2 (GPUs 0, 1)")
    a("--batches", default="1,64,256", help="TP=4 decode batches")
    a("--tp2-batches", default="1,64", help="TP=2 decode batches")
    a("--context", type=int, default=1024)
    a("--write-budget-s", type=float, default=150.0,
      help="no checkpoint file is started after this many seconds of writing")
    a("--rank-timeout-s", type=float, default=300.0)
    a("--requests", type=int, default=1000, help="end-to-end requests (the harness's workload)")
    a("--e2e-latest-start-s", type=float, default=300.0,
      help="start the end-to-end part only before this many seconds since start")
    a("--e2e-timeout", type=float, default=240.0)
    a("--tuning-cache-dir", type=Path, default=None,
      help="the GEMV tuning cache every part shares (the ranks of a part tune a shape once, "
      "later parts and the e2e deployment read it; default: OUT/gemv_tuning, fresh per run)")
    a("--skip", default="", help="comma-separated parts to skip: tp4,tp2,e2e")
    a("--fake", action="store_true",
      help="CPU dry run: a small model of the same structure, gloo ranks, eager steps")


def elapsed() -> float:
    return time.time() - START


def pick_workdir(need_bytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir():
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize > 1.1 * need_bytes:
            return shm / "tw70b"
    return Path("/tmp/tw70b")


def checkpoint_bytes(cfg: dict, layers: int) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kvh, hd = cfg["num_key_value_heads"], h // cfg["num_attention_heads"]
    per_layer = h * (2 * h + 2 * kvh * hd) + 3 * h * inter + 2 * h
    return 2 * (layers * per_layer + 2 * v * h + h)


def run_tp(world: int, dirs: list[tuple[int, Path]], batches: list[int], args, cfg: dict
           ) -> dict[str, Any]:
    from shard.testing.ranks import run_ranks

    job = {"device": "cpu" if args.fake else "cuda", "models": [[n, str(d)] for n, d in dirs],
           "batches": batches, "context": args.context, "hidden": cfg["hidden_size"],
           "vocab": cfg["vocab_size"], "tuning_cache_dir": str(args.tuning_cache_dir)}
    t0 = time.time()
    res = run_ranks(world, job, scale.scale_rank, timeout_s=args.rank_timeout_s)
    res["num_shard"] = world
    res["seconds"] = time.time() - t0
    return res


STARTUP_LINE = re.compile(r"rank(\d+) \w+ [\w.]+: ((start-up|weights|warmup):.*)")


def startup_lines(log_path: Path) -> dict[str, list[str]]:
    """Each rank's start-up log lines (join, weights, model ready, warmup) and the launcher's
    phase lines from the launch log."""
    out: dict[str, list[str]] = {}
    if log_path.is_file():
        for line in log_path.read_text(errors="replace").splitlines():
            m = STARTUP_LINE.search(line)
            if m:
                out.setdefault(f"rank{m.group(1)}", []).append(m.group(2))
            elif line.startswith("tokenwire launch: "):
                # the launcher's phases: shards loaded in N s, router warm-up, ready in N s
                out.setdefault("launcher", []).append(line.removeprefix("tokenwire launch: "))
    return out


def run_e2e(model: Path, args, res: dict) -> dict[str, Any]:
    from benchmarks.harness import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    e2e_args = p.parse_args([
        "--num-shard", "4", "--requests", str(args.requests), "--workdir", str(args.out),
        "--e2e-timeout", str(args.e2e_timeout), "--e2e-profile-from-step", "none",
        "--tuning-cache-dir", str(args.tuning_cache_dir),
        *(["--e2e-warmup-requests", "2", "--clients", "2"] if args.fake else []),
    ])
    e2e_args.e2e_device = "cpu" if args.fake else "cuda"
    log_path = args.out / "e2e_server.log"
    sampler = scale.ShardMemorySampler(model).start()
    t0 = time.time()
    try:
        out = bench.bench_e2e(model, e2e_args, log_path)
    finally:
        sampler.stop()
    out["host_memory_startup"] = sampler.summary(until=t0 + out["startup_seconds"])
    out["host_memory_whole_run"] = sampler.summary()
    out["startup_log"] = startup_lines(log_path)
    return out


def write_report(res: dict, path: Path) -> None:
    L = ["# Llama-3-70B shape, tensor parallel on one host (issue 43)\n",
         (f"- device: {res.get('device')} x {res.get('gpus')}; date {res['date']}; commit "
          f"{res['commit']}; torch {res.get('torch')}\n")]
    c = res.get("ceilings") or {}
    if c:
        L.append(f"- ceilings (GPU 0): copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                 f"{c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s\n")
    ck = res.get("checkpoint") or {}
    if ck:
        L.append(f"- checkpoint: {ck['layers']} of {ck['asked_layers']} layers written "
                 f"({ck['bytes'] / 1e9:.1f} GB) in {ck['seconds']:.0f} s by {ck['writers']} "
                 f"processes into {ck['store']}; errors {ck['errors'] or 'none'}\n")
    an = res.get("analysis") or {}
    for world, t in sorted((an.get("tp") or {}).items(), key=lambda kv: -int(kv[0])):
        step_kind = "eager wall, --fake" if "fake" in str(res.get("device")) else "CUDA graph replay"
        L.append(f"\n## TP={world}: decode step ({step_kind}, context "
                 f"{res.get('context')}), per-GPU roofline\n"
                 "| layers | batch | step ms | roofline ms | = memory ms | + collectives ms | "
                 "% of roofline | bytes per GPU (GB) |\n|---|---|---|---|---|---|---|---|\n")
        for r in t["rows"]:
            L.append(f"| {r['layers']} | {r['batch']} | {r['step_ms']:.2f} | "
                     f"{r.get('roofline_ms', float('nan')):.2f} | "
                     f"{r.get('memory_ms', float('nan')):.2f} | "
                     f"{r.get('comm_ms', float('nan')):.2f} | "
                     f"{r.get('pct_of_roofline', float('nan')):.0f}% | "
                     f"{r.get('bytes_per_gpu', float('nan')) / 1e9:.2f} |\n")
        for b, f in t["fits"].items():
            ext = next(v for k, v in f.items() if k.startswith("extrapolated"))
            L.append(f"- batch {b}: {f['fixed_ms']:.3f} ms fixed + {f['ms_per_layer']:.4f} ms per "
                     f"layer -> {an['target_layers']} layers: {ext:.2f} ms\n")
    if an.get("speedup_tp4_over_tp2"):
        L.append("\n## TP=4 over TP=2 (step time ratio)\n")
        for k, v in an["speedup_tp4_over_tp2"].items():
            L.append(f"- {k}: {v:.2f}x\n")
    for key in ("tp4", "tp2"):
        tp = res.get(key) or {}
        if tp.get("error"):
            L.append(f"\n{key} error: {tp['error']}\n")
        if tp.get("allreduce"):
            L.append(f"\n## {key}: collectives at hidden {res['hidden']} (in-graph us per call)\n"
                     "| batch | layers' all-reduce | path | NCCL | fused all-reduce + norm | "
                     "logits all-gather |\n|---|---|---|---|---|---|\n")
            fused = {r["batch"]: r for r in tp.get("fused_norm") or []}
            gather = tp.get("gather_us") or {}
            for r in tp["allreduce"]:
                b = r["batch"]
                f = fused.get(b, {}).get("fused_in_graph_us")
                g = gather.get(b, gather.get(str(b)))
                L.append(f"| {b} | {r['in_graph_us']:.1f} | "
                         f"{'one-shot' if r['small_path'] else 'NCCL'} | "
                         f"{r['nccl_in_graph_us']:.1f} | {'-' if f is None else f'{f:.1f}'} | "
                         f"{'-' if g is None else f'{g:.1f}'} |\n")
        for m in tp.get("models") or []:
            if m.get("error"):
                L.append(f"\n{key}, {m['layers']} layers: error {m['error']}\n")
                continue
            L.append(f"\n{key}, {m['layers']} layers: per rank (join s / load s / host anon peak "
                     "while loading GiB / first eager step s / graph capture s / weights GiB):"
                     "\n")
            for r in m["ranks"]:
                cap = r.get("graph_capture_s")
                L.append(f"- rank {r['rank']}: {r['init_distributed_s']:.1f} / {r['load_s']:.1f} / "
                         f"{r['host_anon_peak_gib_while_loading']:.2f} / "
                         f"{r['first_eager_step_s']:.1f} / "
                         f"{'-' if cap is None else f'{cap:.1f}'} / {r['weights_gib']:.2f}\n")
    e = res.get("e2e") or {}
    if e.get("requests"):
        L.append(f"\n## End to end: launch --num-shard 4, {e['requests']} requests at once\n"
                 "| req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | ok | mean in/out |"
                 " start-up s |\n|---|---|---|---|---|---|---|\n"
                 f"| {e['requests_per_s']:.2f} | {e['output_tokens_per_s']:.0f} | "
                 f"{e['ttft_p50_ms']:.0f} / {e['ttft_p99_ms']:.0f} | {e['itl_p50_ms']:.1f} / "
                 f"{e['itl_p99_ms']:.1f} | {e['ok']} | {e['mean_input']:.0f} / "
                 f"{e['mean_output']:.0f} | {e['startup_seconds']:.0f} |\n\n"
                 f"finish reasons {e['finish_reasons']}; exact lengths {e['exact_lengths']}; "
                 f"errors {e['errors']}\n")
        hm = e.get("host_memory_startup") or {}
        L.append(f"\nHost memory during start-up: shards' anonymous RSS summed, peak "
                 f"{hm.get('shards_anon_sum_peak_gib', 0):.2f} GiB; host used peak "
                 f"{hm.get('host_used_peak_gib', 0):.1f} GiB (first sample "
                 f"{hm.get('host_used_first_gib') or 0:.1f} GiB); per shard peak "
                 f"{json.dumps(hm.get('per_shard_peak_gib'))}\n\nShard start-up log:\n")
        for rank, lines in sorted((e.get("startup_log") or {}).items()):
            for line in lines:
                L.append(f"- {rank}: {line}\n")
    if res.get("errors"):
        L.append(f"\n## Errors\n```\n{json.dumps(res['errors'], indent=1)}\n```\n")
    if res.get("not_run"):
        L.append(f"\nNot run: {res['not_run']}\n")
    path.write_text("".join(L))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_scale", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.tuning_cache_dir = args.tuning_cache_dir or args.out / "gemv_tuning"
    # `timeout` sends SIGTERM: leave through SystemExit so that the e2e part's `finally` stops
    # the launched deployment (its own process session) instead of leaving it on the GPUs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skip = set(args.skip.split(",")) - {""}
    import torch

    cfg = dict(scale.FAKE_SHAPE if args.fake else scale.LLAMA3_70B)
    gpus = 0 if args.fake else torch.cuda.device_count()
    if not args.fake and gpus < 4:
        print(f"needs 4 GPUs, found {gpus}", file=sys.stderr)
        return 2
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=False).stdout.strip() or "unknown",
        "device": "cpu (--fake)" if args.fake else torch.cuda.get_device_name(0), "gpus": gpus,
        "torch": torch.__version__, "shape": cfg, "context": args.context,
        "hidden": cfg["hidden_size"], "errors": {}, "not_run": [], "timeline_s": {}}

    def save() -> None:
        res["timeline_s"]["saved_at"] = round(elapsed(), 1)
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        write_report(res, args.out / "RESULTS.md")

    def attempt(name: str, fn) -> None:
        print(f"[{elapsed():.0f} s] {name} ...", flush=True)
        try:
            res[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing part must not lose the others
            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
        res["timeline_s"][name] = round(elapsed(), 1)
        res["analysis"] = scale.analyse(res, args.layers)
        save()
        print(f"[{elapsed():.0f} s] {name} done", flush=True)

    if not args.fake:
        from benchmarks.harness.timing import measure_ceilings

        attempt("ceilings", measure_ceilings)
    workdir = args.workdir or pick_workdir(checkpoint_bytes(cfg, args.layers))
    store = workdir / "store"
    devices = ["cpu"] * 2 if args.fake else [f"cuda:{i}" for i in range(gpus)]
    attempt("checkpoint", lambda: scale.write_store(store, cfg, args.layers, devices,
                                                    args.write_budget_s))
    written = (res.get("checkpoint") or {}).get("layers", 0)
    if written == 0:
        res["not_run"].append("everything after the checkpoint: no complete model was written")
        save()
        return 1
    print(f"checkpoint: {written} layers; free in {workdir}: "
          f"{shutil.disk_usage(workdir).free / 1e9:.0f} GB", flush=True)

    def dirs(spec: str) -> list[tuple[int, Path]]:
        layers = sorted({min(n, written) for n in _ints(spec)})
        return [(n, scale.model_dir(store, workdir, cfg, n)) for n in layers]

    if "tp4" not in skip:
        attempt("tp4", lambda: run_tp(4, dirs(args.tp4_layers), _ints(args.batches), args, cfg))
    if "tp2" not in skip:
        attempt("tp2", lambda: run_tp(2, dirs(args.tp2_layers), _ints(args.tp2_batches), args,
                                      cfg))
    if "e2e" in skip:
        res["not_run"].append("e2e (--skip)")
    elif elapsed() > args.e2e_latest_start_s:
        res["not_run"].append(f"e2e: {elapsed():.0f} s had passed (latest start "
                              f"{args.e2e_latest_start_s:.0f} s)")
    else:
        biggest = dirs(str(written))[-1][1]
        attempt("e2e", lambda: run_e2e(biggest, args, res))
    save()
    print(f"[{elapsed():.0f} s] wrote {args.out / 'RESULTS.md'} and results.json", flush=True)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
