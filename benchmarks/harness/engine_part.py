"""`--parts engine` of the GPU benchmark: the engine-only bound of the end-to-end workload (the
same 1,000 requests, lengths and greedy sampling as part e2e), with overlap off and on, in one
process (benchmarks/harness/engine_bound.py), plus the pure-GPU bound and the GPU-busy fraction
of a steady-state window from a torch.profiler trace (CUDA kernels only).
"""

from __future__ import annotations

import gc
from pathlib import Path

from benchmarks.harness.engine_bound import EngineBoundConfig, WorkRequest, drive
from shard.runtime.gc_pacing import GcPacer
from shard.server.step_profile import export_trace_gz


def busy_fraction(intervals: list[tuple[float, float]]) -> float:
    """Share of [first start, last end] covered by the union of the (start, end) intervals."""
    if not intervals:
        return float("nan")
    intervals = sorted(intervals)
    covered = 0.0
    cur_s, cur_e = intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    covered += cur_e - cur_s
    span = max(e for _, e in intervals) - intervals[0][0]
    return covered / span if span > 0 else float("nan")


class KernelWindow:
    """on_step callback of `drive`: traces CUDA kernels from step `start` to step `stop`."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self._prof = None
        self.busy: float = float("nan")
        self.kernels = 0

    def __call__(self, step: int) -> None:
        import torch

        if step == self.start:
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            )
            self._prof.__enter__()
        elif step == self.stop and self._prof is not None:
            self.close()

    def close(self) -> None:
        import torch

        prof, self._prof = self._prof, None
        if prof is None:
            return
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        spans = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        self.kernels = len(spans)
        self.busy = busy_fraction(spans)


class TraceWindow:
    """on_step callback: a CPU + CUDA torch.profiler trace of steps [start, stop), exported as
    a gzipped Chrome trace (chrome://tracing, ui.perfetto.dev), and, over the same steps,
    torch's sync debug mode: every operation that makes the host wait for the device is
    written with its Python stack to `syncs_path` (a launch path must have none)."""

    def __init__(self, start: int, stop: int, trace_path: Path, syncs_path: Path) -> None:
        self.start, self.stop = start, stop
        self.trace_path, self.syncs_path = trace_path, syncs_path
        self._prof = None
        self._syncs: list[str] = []
        self._old_showwarning = None

    def __call__(self, step: int) -> None:
        import torch

        if step == self.start:
            import traceback
            import warnings

            self._old_showwarning = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                self._syncs.append(f"{message}\n{''.join(traceback.format_stack(limit=14))}")

            warnings.showwarning = show
            warnings.simplefilter("always")
            self._prof = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
            torch.cuda.set_sync_debug_mode("warn")
        elif step == self.stop:
            self.close()

    def close(self) -> None:
        import warnings

        import torch

        prof, self._prof = self._prof, None
        if prof is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        if self._old_showwarning is not None:
            warnings.showwarning = self._old_showwarning
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        export_trace_gz(prof, self.trace_path)
        self.syncs_path.write_text(f"{len(self._syncs)} synchronizing operations in steps "
                                   f"[{self.start}, {self.stop})\n\n" + "\n".join(self._syncs))


def gap_analysis(kinds: list[str], step_ms: list[float], gaps_ms: list[float]) -> dict:
    """Where the device waited between steps: gaps_ms[k] is the device time between the end
    of step k and the start of step k+1 (input copies, placeholder kernels, and any wait for
    the host to queue it), grouped by the kind of step k+1; plus the window's busy share
    (step time over step time + gaps)."""
    import statistics

    n = min(len(kinds), len(step_ms), len(gaps_ms) + 1)
    if n < 2:
        return {}
    out: dict = {"steps": n, "busy_fraction": sum(step_ms[:n]) / (sum(step_ms[:n])
                                                                  + sum(gaps_ms[: n - 1]))}
    for kind in sorted(set(kinds[1:n])):
        idx = [k for k in range(n - 1) if kinds[k + 1] == kind]
        g = sorted(gaps_ms[k] for k in idx)
        out[kind] = {
            "steps": len(idx), "gap_ms_sum": sum(g), "gap_ms_p50": statistics.median(g),
            "gap_ms_p90": g[int(0.9 * (len(g) - 1))], "gap_ms_max": g[-1],
            "gpu_ms_mean": statistics.fmean(step_ms[k + 1] for k in idx),
        }
    return out


def step_analysis(res) -> dict:
    """gap_analysis of an engine run, its steps split into decode / prefill (with prompt
    chunks) / after_sync (planned after the step in flight was applied), with the host's
    launch and apply times and the mean batch of each kind."""
    import statistics

    log = res.step_log

    def kind(r) -> str:
        return "after_sync" if r.synced else ("prefill" if r.chunk_tokens else "decode")

    kinds = [kind(r) for r in log]
    out = gap_analysis(kinds, res.step_gpu_ms, res.step_gaps_ms)
    for name in ("decode", "prefill", "after_sync"):
        recs = [r for r in log[1:] if kind(r) == name]
        if name not in out or not recs:
            continue
        applied = [1e3 * (r.apply_end - r.apply_start) for r in recs
                   if r.apply_end == r.apply_end]  # not NaN
        out[name].update({
            "batch_mean": statistics.fmean(r.batch for r in recs),
            "launch_ms_p50": statistics.median(1e3 * (r.launch_end - r.launch_start)
                                               for r in recs),
            "apply_ms_p50": statistics.median(applied) if applied else float("nan"),
        })
    decode = [(r.batch, ms) for r, ms in zip(log, res.step_gpu_ms) if kind(r) == "decode"]
    if decode:  # what a token waits in a pure decode step (batch-weighted: per token)
        out["decode_step_ms_token_weighted"] = (sum(b * ms for b, ms in decode)
                                                / sum(b for b, _ in decode))
        out["decode_batch_token_weighted"] = (sum(b * b for b, _ in decode)
                                              / sum(b for b, _ in decode))
    return out


def sharegpt_workload(
    tokenizer, n: int, max_input: int = 2048, max_total: int = 4096
) -> list[WorkRequest]:
    """Part e2e's requests as token ids: its prompts through the checkpoint's tokenizer (with
    the e2e router's limits: at most max_input prompt tokens, max_total in all; the benchmark's
    word-level tokenizer never reaches them, other tokenizers may)."""
    from benchmarks.harness.bench import prompt_text, sharegpt_like

    out = []
    for i, (n_in, n_out) in enumerate(sharegpt_like(n)):
        ids = tokenizer.encode(prompt_text(i, n_in)).ids[-max_input:]
        # ids only: the shard's work as served (the router detokenizes, issue 23 item 3)
        out.append(WorkRequest(ids, min(n_out, max_total - len(ids)), ids_only=True))
    return out


def bench_engine(model_dir: Path, args, device: str = "cuda") -> dict:
    """Engine-only bound, overlap off then on (and a short warm-up run first)."""
    import torch

    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    cuda = device == "cuda"
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if cuda else "float32",
                              device=device, quantize=args.quantize,
                              kv_cache_dtype=args.kv_cache_dtype), Dist())
    max_batch = args.e2e_max_batch_size
    # Warmup sizes the KV cache after a worst-case prefill of at least one whole prompt.
    budget = getattr(args, "e2e_max_batch_prefill_tokens", 8192)
    warm = shard.warmup(WarmupSpec(max_input_tokens=2048, max_total_tokens=4096,
                                   max_batch_prefill_tokens=max(budget, 2048),
                                   max_batch_size=max_batch))
    engine = shard.engine
    workload = sharegpt_workload(engine.tokenizer, args.requests)
    cfg = EngineBoundConfig(max_batch_prefill_tokens=budget, max_batch_size=max_batch)
    out: dict = {"num_blocks": warm.num_blocks, "block_size": warm.block_size,
                 "requests": len(workload), "runs": {}}
    # Warm-up: compiles the prefill shapes' kernels outside the timed runs.
    drive(engine, workload[: min(64, len(workload))], cfg, warm.num_blocks, warm.block_size,
          overlap=True)
    # The served router's GC policy (shard.runtime.gc_pacing): no full collection inside a run.
    thresholds = gc.get_threshold()
    pacer = GcPacer()
    pacer.install()
    tokens = {}
    try:
        for mode in ("off", "on"):
            pacer.idle()  # between runs, as a served engine between bursts
            collections = pacer.full_collections
            window = KernelWindow(args.engine_profile_start, args.engine_profile_stop) if cuda else None
            trace = None
            trace_dir = args.engine_trace_dir
            if cuda and trace_dir is not None and mode == "on":
                a, b = args.engine_trace_steps
                trace = TraceWindow(a, b, trace_dir / "engine_trace.json.gz",
                                    trace_dir / "engine_syncs.txt")

            def on_step(n: int, window=window, trace=trace) -> None:
                window(n)
                if trace is not None:
                    trace(n)

            try:
                res = drive(engine, workload, cfg, warm.num_blocks, warm.block_size,
                            overlap=mode == "on", on_step=on_step if window is not None else None)
            finally:
                if window is not None:
                    window.close()
                if trace is not None:
                    trace.close()
            summary = res.summary()
            summary["mean_gpu_step_ms"] = res.gpu_ms / max(res.steps, 1)
            summary["step_analysis"] = step_analysis(res)
            summary["full_gc_collections"] = pacer.full_collections - collections
            if window is not None:
                summary["profiled_steps"] = [window.start, window.stop]
                summary["profiled_kernels"] = window.kernels
                summary["profiled_gpu_busy_fraction"] = window.busy
            out["runs"][mode] = summary
            tokens[mode] = (res.tokens, res.finish)
            print(f"engine-only bound, overlap {mode}: {summary}", flush=True)
    finally:  # this process's own GC settings back (the CPU test runs in pytest's)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    out["outputs_equal"] = tokens["off"] == tokens["on"]
    # Per request: with random bf16 weights the greedy choice is often a near-tie, and a row's
    # logits in a batch of another size (the runs' batches differ a little) can flip it.
    out["requests_with_equal_outputs"] = sum(
        tokens["off"][0][i] == tokens["on"][0][i] for i in tokens["off"][0]
    )
    print(f"engine-only bound: outputs with and without overlap equal: {out['outputs_equal']}",
          flush=True)
    runner = shard.runner
    runner.kv_cache = None
    runner.graphs = None
    del shard, engine, runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out
