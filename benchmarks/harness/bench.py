"""`python -m benchmarks.harness` (formerly `python -m benchmarks.harness`): the GPU benchmark of issue 7, in one
process tree, in one go.

1. writes a Llama-3-8B-shaped random bf16 checkpoint (safetensors written tensor by tensor, never a
   full fp32 model in RAM) and a word-level tokenizer of the same 128,256 entries to local disk;
   lm_head's rows of the EOS tokens are zero, so greedy decoding never picks EOS (logit 0 against
   the positive maximum of 128k random logits) and every request generates exactly
   max_new_tokens: "EOS ignored" without any API extension;
2. ceilings: device copy bandwidth (bytes read + written) and bf16 matmul rate;
3. loads the checkpoint through the normal shard path (`shard.server.loader.Shard`) and times decode
   steps (batch 1..256, ~1k contexts; eager and CUDA graph) against the memory roofline, and
   prefill (1x4096, 16x512) against the compute roofline;
4. end to end: `tokenwire launch` (real router + shard over gRPC), 1,000 ShareGPT-like requests
   submitted at once from separate client processes over GenerateStream;
5. `transformers` generate() on the same checkpoint at batch 1 and 64;
and writes RESULTS.md + results.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import vllm_side
from benchmarks.harness.load_stats import summarize_streams
from benchmarks.harness.timing import (
    ab_variants,
    cuda_time_ms,
    decode_step,
    measure_ceilings,
    prefill_step,
    replay_ms_under,
    wall_time_ms,
)
from shard.testing.checkpoint import BOS_ID, EOS_ID, SHAPES, write_checkpoint
from shard.testing.ports import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "GPU benchmark: ceilings, decode, prefill, end to end, HF baseline"
    a = parser.add_argument
    a("--workdir", type=Path, default=Path("/tmp/tokenwire-bench"),
      help="where the random checkpoint is written (local disk)")
    a("--out", type=Path, default=Path("benchmarks"), help="RESULTS.md and results.json go here")
    a("--parts", default="ceilings,decode,prefill,engine,e2e,hf",
      help="comma-separated subset of ceilings,decode,prefill,engine,e2e,hf,vllm_offline,"
           "vllm_served (engine: the engine-only bound of the e2e workload, "
           "benchmarks/harness/engine_part.py; vllm_*: the e2e workload through vLLM, offline "
           "and served, in --vllm-python's interpreter, benchmarks/harness/vllm_side.py)")
    a("--model-type", choices=sorted(SHAPES), default="llama",
      help="shape of the random checkpoint: llama (Llama-3-8B), qwen3 (Qwen3-8B: per-head "
           "q/k norms, 36 layers, 151,936 vocabulary) or gemma2 (Gemma-2-9B: soft-capped "
           "attention and logits, local/global layers, head_dim 256; its KV is 344 KB a token, "
           "so --context 512 at batch 256 on an 80 GB card)")
    a("--num-layers", type=int, default=None,
      help="layers of the random model (default: the shape's, 32 = Llama-3-8B, 36 = Qwen3-8B, "
           "42 = Gemma-2-9B)")
    a("--decode-batches", default="1,8,32,64,128,256")
    a("--context", type=int, default=1024, help="context length of decode benchmarks")
    a("--requests", type=int, default=1000, help="end-to-end requests")
    a("--clients", type=int, default=4, help="load-client processes")
    a("--e2e-timeout", type=float, default=300.0)
    a("--tuning-cache-dir", default=None,
      help="the e2e deployment's --tuning-cache-dir (default: the shard's own default)")
    a("--e2e-overlap", choices=["on", "off", "both"], default="both",
      help="e2e with the router's --overlap, --no-overlap, or both (A/B, one after the other)")
    a("--engine-profile-start", type=int, default=200,
      help="engine part: first step of the torch.profiler window (GPU-busy fraction)")
    a("--engine-profile-stop", type=int, default=400, help="engine part: its last step")
    a("--engine-trace-dir", type=Path, default=None,
      help="engine part, overlap run: write a CPU+CUDA Chrome trace and the synchronizing "
           "operations (torch sync debug mode) of --engine-trace-steps here")
    a("--engine-trace-steps", type=lambda v: tuple(int(x) for x in v.split(":")),
      default=(450, 462), help="engine part: steps A:B of the Chrome trace, after the "
           "GPU-busy window (default 450:462)")
    a("--e2e-profile-from-step", type=lambda v: None if v == "none" else int(v), default=0,
      help="e2e: the shard records its device timeline from this step to shutdown (profiler "
           "trace: GPU-busy fraction; step times: gaps); 'none': off")
    a("--e2e-warmup-requests", type=int, default=64,
      help="e2e: requests (at most 16 new tokens each) sent and finished before the timed run, "
           "as the engine-only runs are preceded by a warm-up run")
    # 1,024 / 6,144: the best of the H100 sweep of issue 44 (benchmarks/RESULTS.md): every
    # request of the 1,000 admitted at once (TTFT p99), steps short enough for ITL p99.
    a("--e2e-max-batch-size", type=int, default=1024,
      help="router --max-batch-size for the end-to-end run (decode graphs cover up to 1,024)")
    a("--e2e-max-batch-prefill-tokens", type=int, default=6144,
      help="router --max-batch-prefill-tokens for the end-to-end run")
    a("--e2e-dump-streams", action="store_true",
      help="e2e: write every stream's token arrival times to <server log stem>_streams.json.gz")
    a("--e2e-launch-args", default="",
      help="e2e: extra `tokenwire launch` arguments, CLI style (they follow the harness's own, "
           "so they override them), e.g. '--waiting-served-ratio 0 --max-batch-prefill-tokens "
           "4096'")
    a("--commit", default=None, help="commit to record (default: git rev-parse)")
    a("--port", type=int, default=0, help="router port for e2e (0: a free one)")
    a("--quantize", default=None, choices=["bitsandbytes", "bitsandbytes-nf4", "fp8"],
      help="quantize the linear layers (as `tokenwire shard --quantize`)")
    a("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3fn", "fp8_e5m2"],
      help="KV cache storage (as `tokenwire shard --kv-cache-dtype`)")
    a("--kv-cache-rotation", default="hadamard", choices=["hadamard", "none"],
      help="fp8 KV caches: keys stored rotated or not (as `tokenwire shard --kv-cache-rotation`)")
    a("--router-frontends", default="auto",
      help="e2e: `launch --frontends` (router front-end processes, N or auto; default auto, the "
           "router's own default: 1 below 8 usable CPUs, else min(4, CPUs // 4), e.g. 4 on a "
           "16-core host)")
    a("--num-shard", type=int, default=1,
      help="tensor-parallel ranks: > 1 adds the `tp` part (one process per GPU over NCCL: tiny "
           "greedy vs one GPU, 8B logits vs one GPU, decode speedup) and is used by e2e")
    a("--skip-ab", action="store_true",
      help="decode: skip the A/B timings with one optimization off at a time")
    a("--model-impl", choices=["auto", "native", "transformers"], default="auto",
      help="which code serves the model (as `tokenwire shard --model-impl`): transformers "
           "forces the transformers backend, for comparison with the native path")
    a("--all-reduce", choices=["auto", "nccl"], default="auto",
      help="TP all-reduce (as `tokenwire shard --all-reduce`)")
    vllm_side.add_arguments(parser)


# ---- measurements ---------------------------------------------------------------------------------



# Bytes per linear weight element by --quantize (nf4: 4 bits + one absmax byte per 64).
WEIGHT_BYTES = {None: 2.0, "fp8": 1.0, "bitsandbytes": 1.0, "bitsandbytes-nf4": 0.5 + 1 / 64}


def model_bytes(cfg: dict, quantize: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    h, inter, v, L = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                      cfg["num_hidden_layers"])
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kvh = cfg["num_key_value_heads"]
    linear = L * (h * (heads * hd + 2 * kvh * hd) + heads * hd * h + 3 * h * inter)
    qk_norms = L * 2 * hd if cfg.get("model_type") == "qwen3" else 0
    norms = 4 if cfg.get("model_type") in ("gemma2", "gemma3_text") else 2  # per layer: sandwich
    others = L * norms * h + qk_norms + h + v * h  # norms, final norm, LM head: always in bf16
    kv_elem = 2 if kv_cache_dtype == "auto" else 1
    return {
        "matmul_params_per_token": linear,
        # all but the embedding table (gathered)
        "weights_read_per_step": int(WEIGHT_BYTES[quantize] * linear + 2 * others),
        "kv_bytes_per_token": 2 * L * kvh * hd * kv_elem,
        "lm_head_params": v * h,
        "layers": L, "heads": cfg["num_attention_heads"], "head_dim": hd,
    }


def bench_model(model_dir: Path, args, ceilings: dict, parts: set[str]) -> dict:
    """Decode and prefill through the real shard loading path and ModelRunner."""
    import torch

    from shard.distributed.groups import Dist
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner
    from shard.server.loader import Shard, ShardConfig

    t0 = time.perf_counter()
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16", device="cuda",
                              quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                              kv_cache_rotation=args.kv_cache_rotation,
                              model_impl=args.model_impl), Dist())
    load_s = time.perf_counter() - t0
    runner = shard.runner
    cfg = json.loads((model_dir / "config.json").read_text())
    mb = model_bytes(cfg, args.quantize, args.kv_cache_dtype)
    bs = runner.block_size
    batches = [int(b) for b in args.decode_batches.split(",")]
    ctx = args.context
    per = math.ceil(ctx / bs)
    num_blocks = max(max(batches) * per, 16 * math.ceil(512 / bs), math.ceil(4096 / bs)) + 1
    runner.allocate_kv_cache(num_blocks)
    for k, v in runner.kv_cache:  # random K/V: never time on zeros
        for cache in (k, v):
            if cache.dtype.itemsize == 1:  # fp8: no normal_ kernel; fill through bf16
                cache.copy_(torch.randn(cache.shape, dtype=torch.bfloat16, device=cache.device))
            else:
                cache.normal_()
    out: dict = {"load_seconds": load_s, "attention_backend": shard.info.attention_backend,
                 "model_impl": shard.info.model_impl,
                 "block_size": bs, "num_blocks": num_blocks, "decode": [], "prefill": []}
    bw, rate = ceilings["copy_bytes_per_s"], ceilings["bf16_flops_per_s"]
    if "decode" in parts:
        graphs = CudaGraphDecodeRunner(runner.forward, runner.device, bs, max(batches),
                                       per, buckets=sorted(batches))
        out["graph_capture_seconds"] = graphs.capture()
        for b in batches:
            step = decode_step(b, ctx, bs)
            dev = runner.prepare(step)

            def eager_step(dev=dev):
                return runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)

            def graph_step(step=step):
                return graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)

            eager = cuda_time_ms(eager_step, iters=10)
            g = graphs.graphs[graphs.bucket(b)]
            # The wall timing fills the graph's static inputs with this step; only then may the
            # bare replay be timed (replaying stale inputs would time a different step).
            full = wall_time_ms(graph_step, iters=30)
            replay = cuda_time_ms(g.replay, iters=30)
            # Graph vs eager logits: the same computation.
            ref = runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)
            got = graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)
            agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
            bytes_ = mb["weights_read_per_step"] + b * ctx * mb["kv_bytes_per_token"]
            roof_ms = bytes_ / bw * 1e3
            # At large batches the GEMMs turn compute-bound: their FLOPs / matmul rate.
            mm_floor = 2 * (mb["matmul_params_per_token"] + mb["lm_head_params"]) * b / rate * 1e3
            out["decode"].append({"matmul_compute_floor_ms": mm_floor,
                "batch": b, "context": ctx, "eager_ms": eager, "graph_replay_ms": replay,
                "graph_step_wall_ms": full, "roofline_ms": roof_ms, "bytes": bytes_,
                "pct_of_roofline": roof_ms / replay * 100, "tokens_per_s": b / replay * 1e3,
                "graph_eager_argmax_agree": agree,
            })
            print(f"decode b={b}: eager {eager:.2f} ms, graph {replay:.2f} ms (wall {full:.2f}), "
                  f"roofline {roof_ms:.2f} ms -> {roof_ms / replay * 100:.0f}%", flush=True)
            if b == min(batches):  # where the time goes at the smallest batch (graph replay)
                from benchmarks.harness.kernel_profile import profile_kernels

                out["decode"][-1]["profile"] = profile_kernels(g.replay, calls=5)
                print(json.dumps(out["decode"][-1]["profile"]), flush=True)
        del graphs
        gc.collect()
        torch.cuda.empty_cache()
        # A/B in this process: the same step with one optimization switched off at a time.
        for name, setting in ({} if args.skip_ab else ab_variants(runner)).items():
            times = replay_ms_under(runner, setting, batches, ctx, bs, per)
            for entry in out["decode"]:
                entry[f"graph_replay_ms_{name}"] = times[entry["batch"]]
                print(f"decode b={entry['batch']} {name}: graph {times[entry['batch']]:.2f} ms",
                      flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    if "prefill" in parts:
        for n, length in ((1, 4096), (16, 512)):
            step = prefill_step(n, length, bs)
            dev = runner.prepare(step)

            def prefill_fwd(dev=dev):
                return runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)

            ms = cuda_time_ms(prefill_fwd, iters=5, warmup=2)
            tokens = n * length
            flops = (2 * mb["matmul_params_per_token"] * tokens + 2 * mb["lm_head_params"] * n
                     + 4 * n * (length * length / 2) * mb["head_dim"] * mb["heads"] * mb["layers"])
            roof_ms = flops / rate * 1e3
            out["prefill"].append({
                "seqs": n, "length": length, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
                "flops": flops, "roofline_ms": roof_ms, "pct_of_roofline": roof_ms / ms * 100,
            })
            print(f"prefill {n}x{length}: {ms:.1f} ms, {tokens / ms * 1e3:.0f} tok/s, "
                  f"roofline {roof_ms:.1f} ms -> {roof_ms / ms * 100:.0f}%", flush=True)
    runner.kv_cache = None
    shard = runner = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ---- end to end -----------------------------------------------------------------------------------


def sharegpt_like(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs: lognormal, means ~200 and ~180 (ShareGPT-like spread)."""
    import random

    rng = random.Random(seed)
    sigma = 1.0
    out = []
    for _ in range(n):
        i = rng.lognormvariate(math.log(200) - sigma**2 / 2, sigma)
        o = rng.lognormvariate(math.log(180) - sigma**2 / 2, sigma)
        out.append((int(min(max(i, 4), 2000)), int(min(max(o, 4), 1000))))
    return out


def prompt_text(idx: int, n_in: int) -> str:
    """The prompt of request `idx`: n_in random words of the word-level tokenizer."""
    import random

    rng = random.Random(idx)
    return " ".join(f"t{rng.randrange(BOS_ID)}" for _ in range(n_in))


def workload_jobs(n: int) -> list[tuple[int, int, int, str]]:
    """(index, prompt words, new tokens, prompt text) of the e2e workload's n requests."""
    return [(i, n_in, n_out, prompt_text(i, n_in)) for i, (n_in, n_out) in
            enumerate(sharegpt_like(n))]


def _client_proc(port: int, jobs: list[tuple[int, int, int]], start_at: float, queue) -> None:
    """One load-client process: all its requests at once over grpc.aio GenerateStream."""
    import asyncio

    import grpc
    from tokenwire.v1 import generate_pb2, generate_pb2_grpc

    async def one(stub, idx: int, n_in: int, n_out: int):
        prompt = prompt_text(idx, n_in)
        req = generate_pb2.GenerateRequest(
            inputs=prompt,
            parameters=generate_pb2.GenerateParameters(max_new_tokens=n_out, details=True),
        )
        t0 = time.time()
        times, reason, err, count = [], "", "", 0
        try:
            async for ev in stub.GenerateStream(req, timeout=600):
                if ev.HasField("token"):
                    times.append(time.time())
                    count += 1
                if ev.HasField("error") and ev.error:
                    err = ev.error
                if ev.HasField("details"):
                    reason = ev.details.finish_reason
        except grpc.aio.AioRpcError as exc:
            err = f"{exc.code().name}: {exc.details()}"
        return {"idx": idx, "in": n_in, "out": n_out, "t0": t0, "times": times,
                "reason": reason, "error": err, "count": count}

    async def main():
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            stub = generate_pb2_grpc.TextGenerationStub(ch)
            await ch.channel_ready()
            delay = start_at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            return await asyncio.gather(*(one(stub, *j) for j in jobs))

    queue.put(asyncio.run(main()))


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    import grpc
    from tokenwire.v1 import generate_pb2, generate_pb2_grpc

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with code {proc.returncode}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                generate_pb2_grpc.TextGenerationStub(ch).Health(generate_pb2.HealthRequest(),
                                                                timeout=2)
                return
        except grpc.RpcError:
            time.sleep(1.0)
    raise TimeoutError("router did not become healthy")


def served_profile(rank_dir: Path) -> dict:
    """The serving shard's device timeline (`--profile-from-step`): the GPU-busy fraction from
    its profiler trace and the step-gap analysis from its step times."""
    from benchmarks.harness.engine_part import busy_fraction, gap_analysis

    trace, steps = rank_dir / "trace.json.gz", rank_dir / "steps.json"
    if not steps.is_file():
        return {}
    import gzip

    s = json.loads(steps.read_text())
    # The timed run starts after the warm-up requests and an idle second or more: analyse the
    # steps after the last such gap (the trace: the kernels after the last such idle time).
    idle_ms = 1000.0
    first = max((k + 1 for k, g in enumerate(s["gaps_ms"]) if g > idle_ms), default=0)
    out = {"first_step": s["first_step"] + first, "steps": s["steps"],
           "gaps": gap_analysis(s["kinds"][first:], s["step_ms"][first:], s["gaps_ms"][first:])}
    if trace.is_file():
        with gzip.open(trace) as f:
            events = json.loads(f.read())["traceEvents"]
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                       and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        start, last_end = 0, spans[0][1] if spans else 0.0
        for k in range(1, len(spans)):  # trace times are microseconds
            if spans[k][0] - last_end > idle_ms * 1e3:
                start = k
            last_end = max(last_end, spans[k][1])
        out.update(trace_gpu_busy_fraction=busy_fraction(spans[start:]),
                   trace_device_events=len(spans) - start)
    return out


def bench_e2e(model_dir: Path, args, log_path: Path, overlap: bool = True) -> dict:
    import multiprocessing as mp

    port = args.port or free_port()
    device = getattr(args, "e2e_device", "cuda")  # cpu: dry runs of the scripts without a GPU
    cmd = [
        sys.executable, "-m", "service.app.cli", "launch", "--model-id", str(model_dir),
        "--dtype", "bfloat16" if device == "cuda" else "float32", "--device", device,
        "--port", str(port),
        "--max-concurrent-requests", str(args.requests + 64),
        "--max-input-tokens", "2048", "--max-total-tokens", "4096",
        "--max-batch-prefill-tokens", str(getattr(args, "e2e_max_batch_prefill_tokens", 8192)),
        "--max-batch-size", str(args.e2e_max_batch_size),
        "--num-shard", str(args.num_shard), "--kv-cache-dtype", args.kv_cache_dtype,
        "--kv-cache-rotation", args.kv_cache_rotation,
        "--all-reduce", args.all_reduce,
        "--frontends", str(args.router_frontends),
        "--model-impl", args.model_impl,
    ] + (["--quantize", args.quantize] if args.quantize else []) + (
        [] if overlap else ["--no-overlap"]) + shlex.split(getattr(args, "e2e_launch_args", ""))
    if getattr(args, "tuning_cache_dir", None):
        cmd += ["--tuning-cache-dir", str(args.tuning_cache_dir)]
    trace_dir = args.workdir / "profiles" / log_path.stem
    if args.e2e_profile_from_step is not None:
        cmd += ["--profile-from-step", str(args.e2e_profile_from_step),
                "--profile-dir", str(trace_dir)]
    env = dict(os.environ)
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            _wait_ready(port, proc, 600)
            startup_s = time.perf_counter() - t0
            lengths = sharegpt_like(args.requests)
            jobs = [(i, n_in, n_out) for i, (n_in, n_out) in enumerate(lengths)]
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            if args.e2e_warmup_requests:  # as the engine-only runs: kernels warm, then time
                warm = [(i, n_in, min(n_out, 16)) for i, n_in, n_out in
                        jobs[: args.e2e_warmup_requests]]
                wp = ctx.Process(target=_client_proc, args=(port, warm, time.time(), queue))
                wp.start()
                warm_results = queue.get(timeout=args.e2e_timeout)
                wp.join(timeout=10)
                if any(r["error"] for r in warm_results):
                    raise RuntimeError(f"warm-up failed: {warm_results[0]['error']}")
            start_at = time.time() + 3.0
            procs = [ctx.Process(target=_client_proc,
                                 args=(port, jobs[c :: args.clients], start_at, queue))
                     for c in range(args.clients)]
            for p in procs:
                p.start()
            results = []
            for _ in procs:
                results.extend(queue.get(timeout=args.e2e_timeout + 60))
            for p in procs:
                p.join(timeout=10)
        finally:
            import signal

            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)  # a shard writing its profile takes ~10 s
            except ProcessLookupError:  # already gone (e.g. it failed to start): keep its error
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    out = summarize_streams(results, start_at, startup_s)
    if getattr(args, "e2e_dump_streams", False):  # every token's arrival time, for analysis
        import gzip

        with gzip.open(log_path.with_name(log_path.stem + "_streams.json.gz"), "wt") as f:
            json.dump({"start_at": start_at, "streams": [
                {k: r[k] for k in ("idx", "in", "out", "t0", "times")} for r in results]}, f)
    out["shard_profile"] = served_profile(trace_dir / "rank0")
    out["launch"] = {"max_batch_size": args.e2e_max_batch_size,
                     "max_batch_prefill_tokens": getattr(args, "e2e_max_batch_prefill_tokens",
                                                         8192),
                     "extra_args": getattr(args, "e2e_launch_args", "")}
    return out


# ---- transformers baseline ----------------------------------------------------------------------


def bench_hf(model_dir: Path) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    out = {}
    for batch, n_in, n_out in ((1, 128, 128), (64, 512, 128)):
        ids = torch.randint(0, BOS_ID, (batch, n_in), device="cuda")
        kw = {"max_new_tokens": n_out, "min_new_tokens": n_out, "do_sample": False,
                  "pad_token_id": EOS_ID, "attention_mask": torch.ones_like(ids)}
        model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = model.generate(ids, **kw)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        new = (gen.shape[1] - n_in) * batch
        out[f"batch{batch}"] = {"batch": batch, "input": n_in, "output": n_out, "seconds": s,
                                "output_tokens_per_s": new / s}
        print(f"transformers batch {batch}: {new / s:.1f} tok/s", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ---- report -------------------------------------------------------------------------------------


def _commit(args) -> str:
    if args.commit:
        return args.commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def _engine_section(res: dict, L: list[str]) -> None:
    """Engine-only bound, pure-GPU bound and served e2e of the same workload, side by side."""
    eng = res.get("engine")
    if not eng:
        return
    L.append(f"\n## Engine-only bound vs served ({eng['requests']} requests at once, same call)\n"
             "| path | overlap | req/s | output tok/s | wall s | GPU busy | ITL p50 / p99 ms | "
             "steps, mean batch |\n|---|---|---|---|---|---|---|---|\n")
    gpu_ms = float("nan")
    for mode, r in eng["runs"].items():
        busy = r.get("profiled_gpu_busy_fraction", r["gpu_busy_fraction"])
        L.append(f"| engine only (scheduler + shard in one process) | {mode} | "
                 f"{r['requests_per_s']:.1f} | {r['output_tokens_per_s']:.0f} | "
                 f"{r['wall_seconds']:.1f} | {busy:.0%} | - | {r['steps']}, "
                 f"{r['mean_batch']:.0f} |\n")
        gpu_ms = r["mean_gpu_step_ms"]
    on = eng["runs"].get("on") or next(iter(eng["runs"].values()))
    L.append(f"| pure GPU (sum of the steps' device time) | - | "
             f"{on['gpu_bound_requests_per_s']:.1f} | {on['gpu_bound_output_tokens_per_s']:.0f} | "
             f"{on['gpu_seconds']:.1f} | 100% | - | {on['steps']}, {on['mean_batch']:.0f} |\n")
    for key, mode in (("e2e", "on"), ("e2e_no_overlap", "off")):
        e = res.get(key)
        if not e:
            continue
        prof = e.get("shard_profile") or {}
        if "trace_gpu_busy_fraction" in prof:
            busy_txt = f"{prof['trace_gpu_busy_fraction']:.0%} (trace)"
        else:
            busy_txt = f"~{on['gpu_seconds'] / e['wall_seconds']:.0%} (est.)"
        L.append(f"| served (router + shard over gRPC, streaming) | {mode} | "
                 f"{e['requests_per_s']:.1f} | {e['output_tokens_per_s']:.0f} | "
                 f"{e['wall_seconds']:.1f} | {busy_txt} | {e['itl_p50_ms']:.1f} / "
                 f"{e['itl_p99_ms']:.1f} | - |\n")
    L.append(f"\nOutputs of the engine runs with and without overlap equal: "
             f"{eng['outputs_equal']} ({eng.get('requests_with_equal_outputs')} of "
             f"{eng['requests']} requests token for token). GPU busy: engine rows from a "
             "torch.profiler trace of "
             f"steps {on.get('profiled_steps')} (union of CUDA kernel intervals over their span; "
             "the profiler's own pauses are left out of the engine runs' wall time); served "
             "rows from the shard's profiler trace from step "
             f"{res.get('e2e', {}).get('shard_profile', {}).get('first_step')} to the end "
             "(`--profile-from-step`). Mean device time per step (engine, overlap on): "
             f"{gpu_ms:.2f} ms.\n")
    sa = on.get("step_analysis") or {}
    dec = sa.get("decode") or {}
    decode_ms = sa.get("decode_step_ms_token_weighted", float("nan"))
    if dec:
        L.append(f"\nPure decode steps of the engine run (overlap on): {dec['steps']} steps, "
                 f"mean batch {dec['batch_mean']:.0f}, mean device time "
                 f"{dec['gpu_ms_mean']:.2f} ms; per token (batch-weighted: batch "
                 f"{sa.get('decode_batch_token_weighted', float('nan')):.0f}) "
                 f"{decode_ms:.2f} ms. Steps with prompt chunks: "
                 f"{(sa.get('prefill') or {}).get('steps', 0)}, mean device time "
                 f"{(sa.get('prefill') or {}).get('gpu_ms_mean', float('nan')):.2f} ms.\n")
    for key in ("e2e", "e2e_no_overlap"):
        e = res.get(key)
        if e:
            bound = on["requests_per_s"]
            L.append(f"- {key}: {e['requests_per_s'] / bound:.0%} of the engine-only bound "
                     f"(overlap on); ITL p50 / mean GPU step = "
                     f"{e['itl_p50_ms'] / gpu_ms:.2f}; ITL p50 / decode step per token = "
                     f"{e['itl_p50_ms'] / decode_ms:.2f}\n")
            gaps = (e.get("shard_profile") or {}).get("gaps")
            if gaps:
                L.append(f"  - shard device timeline: busy {gaps['busy_fraction']:.1%} of "
                         f"steps {e['shard_profile']['first_step']}..end; "
                         + "; ".join(f"{k}: {v['steps']} steps, gaps sum "
                                     f"{v['gap_ms_sum'] / 1e3:.2f} s (p50 {v['gap_ms_p50']:.2f}"
                                     f", p90 {v['gap_ms_p90']:.2f} ms)"
                                     for k, v in gaps.items() if isinstance(v, dict)) + "\n")
    gaps = {k: v for k, v in sa.items() if isinstance(v, dict)}
    if gaps:
        L.append("  - engine run (overlap on) device timeline: busy "
                 f"{sa['busy_fraction']:.1%}; " + "; ".join(
                     f"{k}: {v['steps']} steps, gaps sum {v['gap_ms_sum'] / 1e3:.2f} s, host "
                     f"launch p50 {v.get('launch_ms_p50', float('nan')):.2f} ms"
                     for k, v in gaps.items()) + "\n")


def write_report(res: dict, path: Path) -> None:
    L = []
    c = res.get("ceilings", {})
    L.append("# tokenwire benchmark results\n")
    L.append(f"- device: {res['device']}\n- date: {res['date']}\n- commit: {res['commit']}\n"
             f"- torch {res['torch']}, triton {res['triton']}\n- model: "
             f"{SHAPES[res.get('model_type', 'llama')][2]}, random "
             f"bf16, {res.get('num_layers')} layers\n"
             f"- quantize: {res.get('quantize') or 'none'}, KV cache: "
             f"{res.get('kv_cache_dtype', 'auto')}, shards (e2e): {res.get('num_shard', 1)}\n")
    if c:
        L.append(f"\n## Ceilings\n| copy bandwidth (read+write) | bf16 matmul 8192³ |\n|---|---|\n"
                 f"| {c['copy_bytes_per_s'] / 1e12:.2f} TB/s | "
                 f"{c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s |\n")
    m = res.get("model", {})
    if m.get("decode"):
        L.append(f"\n## Decode step (context {m['decode'][0]['context']}, attention "
                 f"{m['attention_backend']}, block {m['block_size']})\n"
                 "| batch | eager ms | CUDA graph ms | graph step wall ms | memory roofline ms | "
                 "% of roofline (graph) | tok/s | matmul compute floor ms | graph ms without "
                 "PDL | graph ms, rotary unfused |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for d in m["decode"]:
            L.append(f"| {d['batch']} | {d['eager_ms']:.2f} | {d['graph_replay_ms']:.2f} | "
                     f"{d['graph_step_wall_ms']:.2f} | {d['roofline_ms']:.2f} | "
                     f"{d['pct_of_roofline']:.0f}% | {d['tokens_per_s']:.0f} | "
                     f"{d.get('matmul_compute_floor_ms', float('nan')):.2f} | "
                     f"{d.get('graph_replay_ms_no_pdl', float('nan')):.2f} | "
                     f"{d.get('graph_replay_ms_unfused_rotary', float('nan')):.2f} |\n")
    if m.get("prefill"):
        L.append("\n## Prefill\n| shape | ms | tokens/s | compute roofline ms | % of roofline |\n"
                 "|---|---|---|---|---|\n")
        for p in m["prefill"]:
            L.append(f"| {p['seqs']}×{p['length']} | {p['ms']:.1f} | {p['tokens_per_s']:.0f} | "
                     f"{p['roofline_ms']:.1f} | {p['pct_of_roofline']:.0f}% |\n")
    _engine_section(res, L)
    e = res.get("e2e")
    if e:
        L.append(f"\n## End to end (router + shard over gRPC, {e['requests']} requests at once)\n"
                 "| req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | ok | mean in/out |"
                 "\n|---|---|---|---|---|---|\n"
                 f"| {e['requests_per_s']:.1f} | {e['output_tokens_per_s']:.0f} | "
                 f"{e['ttft_p50_ms']:.0f} / {e['ttft_p99_ms']:.0f} | {e['itl_p50_ms']:.1f} / "
                 f"{e['itl_p99_ms']:.1f} | {e['ok']} | {e['mean_input']:.0f} / "
                 f"{e['mean_output']:.0f} |\n\nfinish reasons: {e['finish_reasons']}; exact "
                 f"output lengths: {e['exact_lengths']}/{e['requests']}; errors: {e['errors']}\n")
    vllm_side.side_by_side_section(res, L)
    tp = res.get("tp")
    if tp:
        n = tp["num_shard"]
        L.append(f"\n## Tensor parallel: {n} GPUs (NCCL) vs one\n")
        for name, t in (tp.get("tiny") or {}).items():
            L.append(f"- tiny llama ({name} weights) greedy ({len(t['tp_tokens'])} seqs x "
                     f"{len(t['tp_tokens'][0])} tokens, warmup + CUDA graphs): equal to one GPU: "
                     f"{t['equal']} (smallest top-2 margin {t['min_margin_all_steps']:.4f})\n")
        if tp.get("logits_8b"):
            g = tp["logits_8b"]
            L.append(f"- 8B shape, 1x256 prefill logits vs one GPU: rel. error "
                     f"{g['rel_err']:.2e}, max |diff| {g['max_abs']:.3f} (logit std "
                     f"{g['logit_std']:.2f}), argmax agree {g['argmax_agree']:.3f}\n")
            f32 = tp.get("logits_8b_vs_fp32")
            if f32:
                L.append(f"- vs an fp32 run of the same weights: TP rel. error "
                         f"{f32['tp']['rel_err']:.2e}, one GPU bf16 "
                         f"{f32['single_gpu_bf16']['rel_err']:.2e}\n")
        if tp.get("decode"):
            L.append("\n| batch | one GPU graph ms | TP graph ms | TP wall ms | speedup | TP "
                     "without GEMV push ms | TP without PDL ms | TP rotary unfused ms |\n"
                     "|---|---|---|---|---|---|---|---|\n")
            for d in tp["decode"]:
                one, sp = d.get("single_gpu_ms"), d.get("speedup")
                L.append(f"| {d['batch']} | {one if one is None else f'{one:.2f}'} | "
                         f"{d['graph_replay_ms']:.2f} | {d['graph_step_wall_ms']:.2f} | "
                         f"{sp if sp is None else f'{sp:.2f}x'} | "
                         f"{d.get('graph_replay_ms_unpushed', float('nan')):.2f} | "
                         f"{d.get('graph_replay_ms_no_pdl', float('nan')):.2f} | "
                         f"{d.get('graph_replay_ms_unfused_rotary', float('nan')):.2f} |\n")
        if tp.get("allreduce"):
            L.append("\n| all-reduce [batch, 4096] bf16 | layers' path | eager us | in graph us "
                     "| x64 per step ms | NCCL in graph us | 64 chained sums exact |\n"
                     "|---|---|---|---|---|---|---|\n")
            for a in tp["allreduce"]:
                route = "one-shot symm. mem." if a.get("small_path") else "NCCL"
                L.append(f"| batch {a['batch']} | {route} | {a['eager_us']:.1f} | "
                         f"{a['in_graph_us']:.1f} | {a['per_step_64_ms']:.2f} | "
                         f"{a.get('nccl_in_graph_us', float('nan')):.1f} | "
                         f"{a.get('chain_exact')} |\n")
        if tp.get("fused_norm"):
            L.append("\n| all-reduce + add + RMSNorm [batch, 4096] bf16 | fused kernel used | "
                     "fused in graph us | NCCL + add_rms_norm in graph us | 64-call chain equal "
                     "(eager / graph) |\n|---|---|---|---|---|\n")
            for a in tp["fused_norm"]:
                L.append(f"| batch {a['batch']} | {a['fused_path']} | "
                         f"{a['fused_in_graph_us']:.1f} | {a['unfused_in_graph_us']:.1f} | "
                         f"{a['eager_chain_exact']} / {a['graph_chain_exact']} |\n")
        if tp.get("pushed_linear"):
            L.append("\n| row-parallel GEMV [batch, 4096] x [4096, 4096] + fused all-reduce/norm "
                     "| GEMV pushes | pushed step us | unpushed step us | GEMV + NCCL + norm us "
                     "| 32-step chain equal (eager / graph) |\n|---|---|---|---|---|---|\n")
            for a in tp["pushed_linear"]:
                L.append(f"| batch {a['batch']} | {a['pushes']} | {a['pushed_step_us']:.1f} | "
                         f"{a['unpushed_step_us']:.1f} | {a['nccl_step_us']:.1f} | "
                         f"{a['eager_chain_exact']} / {a['graph_chain_exact']} |\n")
    hf = res.get("hf")
    if hf:
        L.append("\n## transformers generate() baseline\n| batch | in/out | output tok/s |\n"
                 "|---|---|---|\n")
        for v in hf.values():
            L.append(f"| {v['batch']} | {v['input']}/{v['output']} | "
                     f"{v['output_tokens_per_s']:.1f} |\n")
    if res.get("errors"):
        L.append(f"\n## Errors\n```\n{json.dumps(res['errors'], indent=1)}\n```\n")
    path.write_text("".join(L))


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("the benchmark harness needs a CUDA GPU", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "device": torch.cuda.get_device_name(), "date": datetime.datetime.now(
            datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(args), "torch": torch.__version__, "triton": triton.__version__,
        "host": platform.node(), "num_layers": args.num_layers, "errors": {},
        "quantize": args.quantize, "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_rotation": args.kv_cache_rotation,
        "num_shard": args.num_shard, "model_impl": args.model_impl,
        "model_type": args.model_type, "context": args.context,
    }
    shape, _, stem = SHAPES[args.model_type]
    if args.num_layers is None:
        args.num_layers = res["num_layers"] = shape["num_hidden_layers"]
    model_dir = args.workdir / f"{stem}-{args.num_layers}l"
    t0 = time.perf_counter()
    res["checkpoint"] = write_checkpoint(model_dir, args.num_layers, args.model_type)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)

    def save():
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
        write_report(res, args.out / "RESULTS.md")

    def attempt(name, fn):
        try:
            res[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing part must not lose the others
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
        save()

    res["ceilings"] = measure_ceilings()
    print(json.dumps(res["ceilings"]), flush=True)
    save()
    if parts & {"decode", "prefill"}:
        attempt("model", lambda: bench_model(model_dir, args, res["ceilings"], parts))
    if args.num_shard > 1 and "decode" in parts:
        from benchmarks.harness.tp import bench_tp
        from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
        from shard.tools.tiny_training import RECOMMENDED_STEPS

        # Random weights sit at near-ties (bf16 rounding decides them); the trained model's
        # choices are clear, so it is the one whose greedy tokens must be equal.
        tiny = {"random": make_tiny_model(args.workdir / "tiny-llama", TinyModelSpec("llama")),
                "trained": make_tiny_model(args.workdir / "tiny-llama-trained",
                                           TinyModelSpec("llama", train_steps=RECOMMENDED_STEPS))}
        single = res.get("model", {}).get("decode", [])
        attempt("tp", lambda: bench_tp(model_dir, tiny, args, single))
        print(json.dumps(res.get("tp"), indent=1), flush=True)
    if "engine" in parts:
        from benchmarks.harness.engine_part import bench_engine

        attempt("engine", lambda: bench_engine(model_dir, args))
    if "e2e" in parts:
        if args.e2e_overlap in ("on", "both"):
            attempt("e2e", lambda: bench_e2e(model_dir, args, args.out / "e2e_server.log"))
            print(json.dumps(res.get("e2e")), flush=True)
        if args.e2e_overlap in ("off", "both"):
            attempt("e2e_no_overlap", lambda: bench_e2e(
                model_dir, args, args.out / "e2e_server_no_overlap.log", overlap=False))
            print(json.dumps(res.get("e2e_no_overlap")), flush=True)
    if parts & {"vllm_offline", "vllm_served"}:
        torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free at its start
        res["vllm_python"] = args.vllm_python
    if "vllm_offline" in parts:
        res["gpu_free_before_vllm_offline"] = vllm_side.wait_for_free_gpu(torch.cuda.mem_get_info)
        attempt("vllm_offline", lambda: vllm_side.bench_vllm_offline(
            model_dir, args, args.out / "vllm_offline.log"))
        print(json.dumps(res.get("vllm_offline")), flush=True)
    if "vllm_served" in parts:
        res["gpu_free_before_vllm_served"] = vllm_side.wait_for_free_gpu(torch.cuda.mem_get_info)
        attempt("vllm_served", lambda: vllm_side.bench_vllm_served(
            model_dir, args, args.out / "vllm_server.log", workload_jobs(args.requests)))
        print(json.dumps(res.get("vllm_served")), flush=True)
    if "hf" in parts:
        attempt("hf", lambda: bench_hf(model_dir))
    save()
    print((args.out / "RESULTS.md").read_text())
    return 0 if not res["errors"] else 1
