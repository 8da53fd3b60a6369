"""`--parts engine` of the GPU benchmark: the engine-only bound of the end-to-end workload (the
same 1,000 requests, lengths and greedy sampling as part e2e), with overlap off and on, in one
process (benchmarks/harness/engine_bound.py), plus the pure-GPU bound and the GPU-busy fraction
of a steady-state window from a torch.profiler trace (CUDA kernels only).
"""

from __future__ import annotations

import gc
from pathlib import Path

from benchmarks.harness.engine_bound import EngineBoundConfig, WorkRequest, drive


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
    warm = shard.warmup(WarmupSpec(max_input_tokens=2048, max_total_tokens=4096,
                                   max_batch_prefill_tokens=8192, max_batch_size=max_batch))
    engine = shard.engine
    workload = sharegpt_workload(engine.tokenizer, args.requests)
    cfg = EngineBoundConfig(max_batch_prefill_tokens=8192, max_batch_size=max_batch)
    out: dict = {"num_blocks": warm.num_blocks, "block_size": warm.block_size,
                 "requests": len(workload), "runs": {}}
    # Warm-up: compiles the prefill shapes' kernels outside the timed runs.
    drive(engine, workload[: min(64, len(workload))], cfg, warm.num_blocks, warm.block_size,
          overlap=True)
    tokens = {}
    for mode in ("off", "on"):
        window = KernelWindow(args.engine_profile_start, args.engine_profile_stop) if cuda else None
        try:
            res = drive(engine, workload, cfg, warm.num_blocks, warm.block_size,
                        overlap=mode == "on", on_step=window)
        finally:
            if window is not None:
                window.close()
        summary = res.summary()
        summary["mean_gpu_step_ms"] = res.gpu_ms / max(res.steps, 1)
        if window is not None:
            summary["profiled_steps"] = [window.start, window.stop]
            summary["profiled_kernels"] = window.kernels
            summary["profiled_gpu_busy_fraction"] = window.busy
        out["runs"][mode] = summary
        tokens[mode] = (res.tokens, res.finish)
        print(f"engine-only bound, overlap {mode}: {summary}", flush=True)
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
