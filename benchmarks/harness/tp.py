"""`python -m benchmarks.harness --num-shard N`: tensor parallel over NCCL, one process per GPU (rank r on
cuda:r), through the shard's own loading path (`shard.server.loader.Shard` with a `Dist`).

Every rank runs the same script in lockstep (collectives pair up), rank 0 reports:
1. tiny model: greedy tokens (3 prompts, a batched prefill then 32 decode steps) after the real
   Warmup (worst-case prefill, KV sizing, CUDA-graph capture with NCCL all-reduces inside);
2. Llama-3-8B shape: logits of a 1x256 prefill (to compare with one GPU);
3. decode step times on the 8B shape (CUDA graph replay, ~1k context, random K/V), the same
   measurement as the single-GPU decode part, so the speedup is a ratio of like numbers;
4. all-reduce cost of one decode step's size ([batch, hidden] bf16): eager per call, and per
   call inside a captured graph of 64 (what a 32-layer step issues).
The single-GPU references (tiny greedy, 8B logits) are computed by the caller with `Dist()`.
Works on CPU with gloo for the tiny check (tests), where timings are skipped.
"""

from __future__ import annotations

import json
import math
from contextlib import AbstractContextManager
from pathlib import Path

from benchmarks.harness.timing import (
    ab_variants,
    attribute_set,
    cuda_time_ms,
    decode_step,
    replay_ms_under,
    wall_time_ms,
)
from shard.distributed.groups import Dist
from shard.testing.ranks import greedy_rank, run_ranks
from shard.testing.tiny import greedy_tokens, load_tiny


def prefill_logits_8b(runner, length: int = 256, keep: int = 64):
    """Logits of the last `keep` positions of one `length`-token prefill ([keep, vocab] fp32,
    on the CPU)."""
    from shard.runner.model_runner import StepInputs

    bs = runner.block_size
    step = StepInputs(
        token_ids=[(31 * j + 7) % 128000 for j in range(length)],
        positions=list(range(length)),
        query_lens=[length],
        seq_lens=[length],
        block_tables=[list(range(math.ceil(length / bs)))],
        logits_indices=list(range(length - keep, length)),
    )
    return runner.execute(step).float().cpu()


def _allreduce_cost(dist, hidden: int, batches: list[int]) -> list[dict]:
    """Per-call cost of NCCL's all-reduce and of `dist.all_reduce` (the path the layers take:
    one-shot symmetric memory for small tensors when enabled), eager and inside a CUDA graph of
    64 calls; plus a check that 64 back-to-back graph all-reduces give the exact sums."""
    import torch
    import torch.distributed as tdist

    def in_graph_us(fn, x) -> float:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(64):
                fn(x)
        return cuda_time_ms(g.replay, iters=20, warmup=3) / 64 * 1e3

    out = []
    for b in batches:
        gen = torch.Generator(device="cuda").manual_seed(100 + dist.rank)  # rank-specific
        x = torch.randn(b, hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
        nccl_sum = x.clone()
        tdist.all_reduce(nccl_sum)
        row = {"batch": b, "bytes": b * hidden * 2,
               "small_path": dist.small_all_reduce is not None
               and dist.small_all_reduce.handles(x),
               "equals_nccl": bool(torch.equal(dist.all_reduce(x.clone()), nccl_sum))}
        for name, fn in (("nccl", tdist.all_reduce), ("layers", dist.all_reduce)):
            row[f"{name}_eager_us"] = cuda_time_ms(lambda x=x, fn=fn: fn(x), iters=50,
                                                   warmup=5) * 1e3
            row[f"{name}_in_graph_us"] = in_graph_us(fn, x)
        row["eager_us"], row["in_graph_us"] = row["layers_eager_us"], row["layers_in_graph_us"]
        row["per_step_64_ms"] = row["in_graph_us"] * 64 / 1e3
        row["chain_exact"] = _chained_sums_exact(dist, b, hidden)
        out.append(row)
    return out


def _chained_sums_exact(dist, batch: int, hidden: int, calls: int = 64) -> bool:
    """64 dependent all-reduces in one CUDA graph (each input derived from the previous sum, as
    in a model), replayed 3 times with new inputs: every result equals its exact value. Catches
    a buffer reused before a peer finished reading it. Values stay small integers (exact)."""
    import torch

    base = torch.empty(batch, hidden, dtype=torch.bfloat16, device="cuda")
    results = []

    def chain():
        results.clear()
        y = base
        for _ in range(calls):
            y = dist.all_reduce(y.clone()) - y * (dist.world_size - 1)  # = y if all ranks agree
            results.append(y)

    for _ in range(2):
        chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    ok = True
    for trial in range(3):
        vals = (torch.arange(batch * hidden, device="cuda") % 13 + trial).view(batch, hidden)
        base.copy_(vals.to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        ok = ok and all(torch.equal(r, base) for r in results)
    return ok


def _capture_chains(chain, steps: dict, h, x) -> dict:
    """{name: (CUDA graph of chain(step, h, x), its output tensors)} for each step (already
    compiled: run eagerly before)."""
    import torch

    torch.cuda.synchronize()
    graphs = {}
    for name, step in steps.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = chain(step, h, x)
        graphs[name] = (g, got)
    return graphs


def _fused_norm_cost(dist, hidden: int, batches: list[int], replays: int = 3,
                     sweep_warps: bool = True) -> list[dict]:
    """The fused all-reduce + add + RMSNorm (layers.reduce_add_rms_norm, what the model calls)
    against NCCL's all-reduce + the add/norm kernel: per-call time inside a CUDA graph of 64
    calls, and exactness: 64 dependent calls (each partial derived from the previous normed
    output, as in a model), eager and as graph replays with new inputs, equal the unfused chain
    bit for bit (two ranks: both round the exact sum once). sweep_warps: also time the kernel
    at 1, 2, 4 and 8 warps (a benchmark; the tests leave it out)."""
    import torch
    import torch.distributed as tdist

    from shard.kernels.elementwise import add_rms_norm
    from shard.layers.norm import RMSNorm, reduce_add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(7)  # same weight on every rank
    norm = RMSNorm(hidden, 1e-5).cuda()
    norm.weight.data = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    share = (dist.rank + 1) / 2  # rank r's partial is h * (r + 1) / 2: exact in bf16

    def unfused(partial, x):
        total = partial.clone()
        tdist.all_reduce(total)
        return add_rms_norm(total, x, norm.weight, norm.eps)

    def chain(step, h, x, calls: int = 64) -> list:
        outs = []
        for _ in range(calls):
            h, x = step(h * share, x)
            outs.extend((h, x))
        return outs

    def fused(partial, x):
        return reduce_add_rms_norm(dist, partial, x, norm)

    out = []
    for b in batches:
        h0 = torch.randn(b, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        x0 = torch.randn(b, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        row = {"batch": b, "fused_path": dist.fused_all_reduce_norm is not None
               and dist.fused_all_reduce_norm.handles(h0)}
        exchange = dist.fused_all_reduce_norm
        state_before = exchange.state.tolist() if exchange is not None else None
        want = chain(unfused, h0, x0)
        got = chain(fused, h0, x0)
        row["eager_chain_exact"] = all(torch.equal(g, w) for g, w in zip(got, want))
        if not row["eager_chain_exact"]:  # where the chains part: for the record
            first = next(i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w))
            g, w = got[first].float(), want[first].float()
            bad_rows = (g != w).any(dim=1).nonzero().flatten().tolist()
            row["eager_first_mismatch"] = {
                "output": first, "call": first // 2, "rows": bad_rows,
                "max_abs_diff": float((g - w).abs().max()),
                "state_before": state_before, "state_after": exchange.state.tolist()}
        h_in, x_in = h0.clone(), x0.clone()
        for step in (fused, unfused):
            chain(step, h_in, x_in)  # compile/warm before capture
        graphs = _capture_chains(chain, {"fused": fused, "unfused": unfused}, h_in, x_in)
        exact = True
        for trial in range(replays):
            h_in.copy_(torch.randn(b, hidden, device="cuda", generator=gen).to(torch.bfloat16))
            x_in.copy_(torch.randn(b, hidden, device="cuda", generator=gen).to(torch.bfloat16))
            want = chain(unfused, h_in, x_in)
            graphs["fused"][0].replay()
            torch.cuda.synchronize()
            exact = exact and all(torch.equal(g, w) for g, w in zip(graphs["fused"][1], want))
        row["graph_chain_exact"] = exact
        for name, (g, _) in graphs.items():
            row[f"{name}_in_graph_us"] = cuda_time_ms(g.replay, iters=20, warmup=3) / 64 * 1e3
        if sweep_warps:
            row["fused_in_graph_us_by_warps"] = _fused_warps_sweep(dist, chain, fused, h_in, x_in)
        out.append(row)
    return out


def _pushed_linear_cost(
    dist, hidden: int, batches: list[int], steps: int = 32, replays: int = 3
) -> list[dict]:
    """A row-parallel linear + the fused all-reduce/add/norm, its GEMV pushing the output into
    the exchange buffers (RowParallelLinear.partial(push=True), what the model does) against the
    same GEMV config writing a tensor that the fused kernel then pushes, and against GEMV + NCCL
    + add_rms_norm: `steps` dependent steps (each step's input is the previous normed output),
    eager and as graph replays with new inputs, bit-equal; per-step time inside a CUDA graph."""
    import torch
    import torch.distributed as tdist

    from shard.kernels.elementwise import add_rms_norm
    from shard.kernels.gemv import gemv
    from shard.kernels.gemv_buckets import m_bucket
    from shard.layers import decode_linear
    from shard.layers.linear import PushedPartial, RowParallelLinear
    from shard.layers.norm import RMSNorm, reduce_add_rms_norm

    fused_kernel = dist.fused_all_reduce_norm
    if fused_kernel is None:
        return []
    gen = torch.Generator(device="cuda").manual_seed(11 + dist.rank)  # each rank its own slice
    # in_features hidden * world: each rank's slice is [hidden, hidden], like a TP o_proj.
    linear = RowParallelLinear(hidden * dist.world_size, hidden, False, dist).cuda()
    linear.weight.data = (torch.randn(hidden, hidden, generator=gen, device="cuda")
                          * hidden**-0.5).to(torch.bfloat16)
    norm = RMSNorm(hidden, 1e-5).cuda()
    norm.weight.data = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    record = decode_linear.tune(linear.weight, torch.bfloat16)

    def plain_gemv(h):
        return gemv(h, linear.weight, config=record[m_bucket(h.shape[0])].config)

    def taken_linear(h):
        # What the row-parallel layer computes when it does not push (decode_linear.linear: its
        # dispatcher picks the Triton GEMV or cuBLAS per M bucket from start-up timings). A
        # pushing GEMV always runs the tuned Triton config (plain_gemv's rounding).
        return linear.partial(h, push=False)

    def reduced_norm(total, x):
        tdist.all_reduce(total)
        return add_rms_norm(total, x, norm.weight, norm.eps)

    def reference_triton(h, x):
        return reduced_norm(plain_gemv(h), x)

    def reference_taken(h, x):
        return reduced_norm(taken_linear(h), x)

    def unpushed(h, x):
        return reduce_add_rms_norm(dist, plain_gemv(h), x, norm)

    def pushed(h, x):
        return reduce_add_rms_norm(dist, linear.partial(h, push=True), x, norm)

    def chain(step, h, x) -> list:
        outs = []
        for _ in range(steps):
            h, x = step(h, x)
            outs.extend((h, x))
        return outs

    out = []
    for b in batches:
        h0 = torch.randn(b, hidden, device="cuda").to(torch.bfloat16)
        x0 = torch.randn(b, hidden, device="cuda").to(torch.bfloat16)
        tdist.broadcast(h0, 0)  # replicated inputs, as the normed residual stream is
        tdist.broadcast(x0, 0)
        first = linear.partial(h0, push=True)
        choice = record[m_bucket(b)]
        row = {"batch": b, "pushes": isinstance(first, PushedPartial),
               "dispatched_backend": choice.backend.name,
               "triton_us": round(choice.triton_us, 2), "cublas_us": round(choice.cublas_us, 2)}
        reduce_add_rms_norm(dist, first, x0, norm)  # consumes that push
        # The reference is the path actually taken: the pushed GEMV's Triton config when the
        # GEMV pushes, the dispatcher's choice when it does not (cuBLAS rounds differently from
        # the Triton GEMV; comparing a cuBLAS step against a Triton reference fails whenever the
        # start-up timing picks cuBLAS for this bucket: issue 27's failure).
        reference = reference_triton if row["pushes"] else reference_taken
        got = chain(pushed, h0, x0)
        row["eager_chain_exact"] = all(
            torch.equal(g, w) for g, w in zip(got, chain(reference, h0, x0)))
        # Diagnostic: the same chain against the always-Triton reference (the old test's).
        row["eager_equals_triton_reference"] = all(
            torch.equal(g, w) for g, w in zip(got, chain(reference_triton, h0, x0)))
        chain(unpushed, h0, x0)  # every kernel variant compiled before capture
        graphs = _capture_chains(
            chain, {"pushed": pushed, "unpushed": unpushed, "nccl": reference}, h0, x0)
        exact = True
        for _ in range(replays):
            h0.copy_(torch.randn(b, hidden, device="cuda").to(torch.bfloat16))
            x0.copy_(torch.randn(b, hidden, device="cuda").to(torch.bfloat16))
            tdist.broadcast(h0, 0)
            tdist.broadcast(x0, 0)
            want = chain(reference, h0, x0)
            graphs["pushed"][0].replay()
            torch.cuda.synchronize()
            exact = exact and all(torch.equal(g, w) for g, w in zip(graphs["pushed"][1], want))
        row["graph_chain_exact"] = exact
        for name, (g, _) in graphs.items():
            row[f"{name}_step_us"] = cuda_time_ms(g.replay, iters=20, warmup=3) / steps * 1e3
        out.append(row)
    return out


def _fused_warps_sweep(dist, chain, fused, h, x) -> dict[int, float]:
    """In-graph us per fused call for 1, 2, 4 and 8 warps per row program (the kernel's one
    launch parameter worth tuning); the default is restored afterwards."""
    import torch

    kernel = dist.fused_all_reduce_norm
    if kernel is None:
        return {}
    default, out = kernel.num_warps, {}
    try:
        for warps in (1, 2, 4, 8):
            kernel.num_warps = warps
            chain(fused, h, x)  # compile before capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(fused, h, x)
            out[warps] = cuda_time_ms(g.replay, iters=20, warmup=3) / 64 * 1e3
    finally:
        kernel.num_warps = default
    return out


def bench_rank(dist: Dist, device: str, job: dict, res: dict) -> None:
    """One rank of the TP benchmark (shard.testing.ranks.run_ranks's rank_fn): the tiny greedy
    check, then on CUDA the 8B-shape decode and the all-reduce / fused-norm costs."""
    greedy_rank(dist, device, job, res)
    cuda = device.startswith("cuda")
    if job.get("model_dir") and cuda:
        res.update(_bench_8b(Path(job["model_dir"]), job, dist, device))
    if cuda and job.get("allreduce_batches"):
        res["allreduce"] = _allreduce_cost(dist, 4096, job["allreduce_batches"])
        small = [b for b in job["allreduce_batches"] if b <= 16] or [1]
        replays = int(job.get("replays", 3))  # graph replays with new inputs per exactness check
        res["fused_norm"] = _fused_norm_cost(dist, 4096, small, replays=replays,
                                             sweep_warps=bool(job.get("sweep_warps", True)))
        res["pushed_linear"] = _pushed_linear_cost(dist, 4096, small, replays=replays)


def _bench_8b(model_dir: Path, job: dict, dist, device: str) -> dict:
    import gc

    import torch

    from shard.runner.cuda_graphs import CudaGraphDecodeRunner
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16", device=device,
                              quantize=job.get("quantize"),
                              kv_cache_dtype=job.get("kv_cache_dtype", "auto")), dist)
    runner = shard.runner
    bs = runner.block_size
    batches, ctx = job["batches"], job["context"]
    per = math.ceil(ctx / bs)
    runner.allocate_kv_cache(max(max(batches) * per, 64) + 1)
    res: dict = {"logits_8b": prefill_logits_8b(runner)}
    gen = torch.Generator(device=device).manual_seed(1 + dist.rank)
    for k, v in runner.kv_cache:  # random K/V: never time on zeros
        for cache in (k, v):
            cache.copy_(torch.randn(cache.shape, dtype=torch.bfloat16, device=device,
                                    generator=gen))
    graphs = CudaGraphDecodeRunner(runner.forward, runner.device, bs, max(batches), per,
                                   buckets=sorted(batches))
    res["graph_capture_seconds"] = graphs.capture()
    res["decode"] = []
    for b in batches:
        step = decode_step(b, ctx, bs)

        def graph_step(step=step, graphs=graphs):
            return graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)

        full = wall_time_ms(graph_step, iters=30)
        replay = cuda_time_ms(graphs.graphs[graphs.bucket(b)].replay, iters=30)
        res["decode"].append({"batch": b, "context": ctx, "graph_replay_ms": replay,
                              "graph_step_wall_ms": full})
        if b == min(batches):
            # Every rank replays under the profiler (the one-shot all-reduce waits for peers).
            from benchmarks.harness.kernel_profile import profile_kernels

            graph = graphs.graphs[graphs.bucket(b)]
            res["decode"][-1]["profile"] = profile_kernels(graph.replay, calls=5)
        if dist.rank == 0:
            print(f"TP={dist.world_size} decode b={b}: graph {replay:.2f} ms (wall {full:.2f})",
                  flush=True)
            if "profile" in res["decode"][-1]:
                print(json.dumps(res["decode"][-1]["profile"]), flush=True)
    del graphs
    _ab_variants(runner, dist, res["decode"], bs, per)
    runner.kv_cache = None
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _ab_variants(runner, dist, decode: list[dict], block_size: int, blocks_per_seq: int) -> None:
    """A/B in the same processes, graphs recaptured per variant: each entry of `decode` gains
    graph_replay_ms_unpushed (the row-parallel GEMVs write tensors that the fused all-reduce
    pushes itself: the design before the GEMV epilogue push) and those of bench.ab_variants."""

    variants: dict[str, AbstractContextManager] = {}
    fused = dist.fused_all_reduce_norm
    if fused is not None:
        variants["unpushed"] = attribute_set(fused, "accept_pushes", False)
    variants.update(ab_variants(runner))
    batches = sorted(d["batch"] for d in decode)
    for name, setting in variants.items():
        times = replay_ms_under(runner, setting, batches, decode[0]["context"], block_size,
                                blocks_per_seq)
        for entry in decode:
            entry[f"graph_replay_ms_{name}"] = ms = times[entry["batch"]]
            if dist.rank == 0:
                print(f"TP={dist.world_size} decode b={entry['batch']} {name}: graph "
                      f"{ms:.2f} ms", flush=True)


def compare_logits(got, want) -> dict:
    diff = (got - want).float()
    return {
        "rel_err": float(diff.norm() / want.float().norm()),
        "max_abs": float(diff.abs().max()),
        "logit_std": float(want.float().std()),
        "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
    }


def bench_tp(model_dir: Path | None, tiny_dirs: dict[str, Path], args,
             single_decode: list[dict]) -> dict:
    """TP=N on N GPUs vs one GPU: tiny greedy equality (per tiny model, e.g. random and trained
    weights), 8B logits, decode speedup."""
    import gc

    import torch

    world = args.num_shard
    batches = [int(b) for b in args.decode_batches.split(",")]
    job = {"device": "cuda", "tiny_dirs": {k: str(v) for k, v in tiny_dirs.items()},
           "model_dir": str(model_dir) if model_dir else None, "batches": batches,
           "context": args.context, "quantize": args.quantize,
           "kv_cache_dtype": args.kv_cache_dtype, "allreduce_batches": [1, 8, 64, 256],
           "all_reduce": getattr(args, "all_reduce", "auto")}
    tp = run_ranks(world, job, bench_rank)
    out: dict = {"num_shard": world, "error": tp.get("error")}
    out["tiny"] = {}
    for name, tp_tokens in tp.get("tiny_tokens", {}).items():
        single = load_tiny(tiny_dirs[name], "cuda:0", Dist())
        margins: list = []
        want = greedy_tokens(single, margins=margins)
        first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
                 for g, w in zip(tp_tokens, want)]
        out["tiny"][name] = {
            "tp_tokens": tp_tokens, "single_tokens": want, "equal": tp_tokens == want,
            "tp_graphs": tp["tiny_graphs"][name], "first_divergence": first,
            # one GPU's top-2 margin at each divergence (bf16 near-tie if small)
            "margin_at_divergence": [None if f is None else margins[f][i]
                                     for i, f in enumerate(first)],
            "min_margin_all_steps": min(min(m) for m in margins)}
        single.runner.kv_cache = None
        del single
    if model_dir and "logits_8b" in tp:
        from shard.server.loader import Shard, ShardConfig

        shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16", device="cuda:0",
                                  quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype),
                      Dist())
        shard.runner.allocate_kv_cache(64)
        single = prefill_logits_8b(shard.runner)
        out["logits_8b"] = compare_logits(tp["logits_8b"], single)
        shard.runner.kv_cache = None
        del shard
        gc.collect()
        torch.cuda.empty_cache()
        # The yardstick for "bf16 tolerance": both against an fp32 run of the same weights
        # (torch attention); TP is within tolerance when its error is one GPU's bf16 error.
        ref = Shard(ShardConfig(model_id=str(model_dir), dtype="float32", device="cuda:0",
                                attention_backend="torch"), Dist())
        ref.runner.allocate_kv_cache(64)
        fp32 = prefill_logits_8b(ref.runner)
        out["logits_8b_vs_fp32"] = {"tp": compare_logits(tp["logits_8b"], fp32),
                                    "single_gpu_bf16": compare_logits(single, fp32)}
        ref.runner.kv_cache = None
        del ref
        gc.collect()
        torch.cuda.empty_cache()
    one = {d["batch"]: d["graph_replay_ms"] for d in single_decode}
    out["decode"] = [
        dict(d, single_gpu_ms=one.get(d["batch"]),
             speedup=(one[d["batch"]] / d["graph_replay_ms"]) if d["batch"] in one else None)
        for d in tp.get("decode", [])
    ]
    out["allreduce"] = tp.get("allreduce")
    out["fused_norm"] = tp.get("fused_norm")
    out["pushed_linear"] = tp.get("pushed_linear")
    return out
