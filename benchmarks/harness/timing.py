"""Timers, step builders and A/B switches the benchmark harness shares between its single-GPU
(bench.py) and tensor-parallel (tp.py) parts."""

from __future__ import annotations

import math
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from shard.testing.checkpoint import BOS_ID


def cuda_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median of per-iteration CUDA-event times."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


# nvidia-smi's fields for gpu_state, in its order
_GPU_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw",
               "clocks_throttle_reasons.active")


def gpu_state(index: int = 0) -> dict[str, str]:
    """GPU `index`'s SM and memory clocks (MHz), temperature (C), power (W) and active throttle
    reasons (a bit mask) from nvidia-smi, read right after a timing loop: step times that drift
    within one process can be set against the clocks. {} where nvidia-smi does not answer."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(_GPU_FIELDS)}",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
            check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.split(",")]
    return dict(zip(_GPU_FIELDS, values, strict=False)) if len(values) == len(_GPU_FIELDS) else {}


def wall_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median host wall time per call, synchronised (what a serving step really costs)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_ceilings() -> dict:
    import torch

    n = 1 << 30  # 2 GiB of bf16 per buffer
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x), iters=20)
    copy_bw = 2 * n * 2 / (ms / 1e3)
    x = y = None  # free before the matmul buffers
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms_mm = cuda_time_ms(lambda: a @ b, iters=20)
    rate = 2 * m**3 / (ms_mm / 1e3)
    a = b = None
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": rate}


def decode_step(batch: int, context: int, block_size: int, vocab: int = BOS_ID):
    from shard.runner.model_runner import StepInputs

    per = math.ceil(context / block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    return StepInputs(
        token_ids=[(17 * i + 5) % vocab for i in range(batch)],
        positions=[context - 1] * batch,
        query_lens=[1] * batch,
        seq_lens=[context] * batch,
        block_tables=tables,
        logits_indices=list(range(batch)),
    )


@contextmanager
def attribute_set(obj: object, name: str, value: object) -> Iterator[None]:
    """obj.name = value inside the block, restored after."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


def ab_variants(runner) -> dict[str, AbstractContextManager]:
    """{name: a context manager that switches one decode optimization off} for the A/B timings
    of replay_ms_under: "no_pdl" (programmatic dependent launch), "unfused_rotary" (rotary +
    cache store as their own kernel before decode attention) and "q_through_memory" (the fused
    kernel's rotated q parked in memory and read back), where they apply."""
    from shard.kernels import pdl

    variants: dict[str, AbstractContextManager] = {}
    if pdl.enabled(runner.device):
        variants["no_pdl"] = pdl.override(False)
    if runner.attention.fuse_rotary_into_decode:
        variants["unfused_rotary"] = attribute_set(runner.attention, "fuse_rotary_into_decode",
                                                   False)
        from shard.kernels import attention_decode

        variants["q_through_memory"] = attention_decode.q_through_memory()
    return variants


def replay_ms_under(
    runner, setting: AbstractContextManager, batches: list[int], context: int, block_size: int,
    blocks_per_seq: int,
) -> dict[int, float]:
    """{batch: decode graph replay ms} with the graphs captured under `setting` (a context
    manager that switches a code path, e.g. pdl.override(False)): an A/B against the step timed
    before, in the same process. One eager step per batch comes first, because kernels compile a
    variant per setting and capture cannot compile. Under tensor parallelism every rank calls it
    alike (the steps are collective)."""
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    out: dict[int, float] = {}
    with setting:
        for b in batches:
            dev = runner.prepare(decode_step(b, context, block_size))
            runner.forward(dev.input_ids, dev.positions, dev.meta, dev.logits_indices)
        graphs = CudaGraphDecodeRunner(runner.forward, runner.device, block_size, max(batches),
                                       blocks_per_seq, buckets=sorted(batches))
        graphs.capture()
        for b in batches:
            # Stage a real step first: capture leaves lengths of 0 (nothing attended).
            step = decode_step(b, context, block_size)
            graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)
            out[b] = cuda_time_ms(graphs.graphs[graphs.bucket(b)].replay, iters=30)
        del graphs
    return out


def prefill_step(num_seqs: int, length: int, block_size: int, vocab: int = BOS_ID):
    from shard.runner.model_runner import StepInputs

    per = math.ceil(length / block_size)
    step = StepInputs([], [], [], [], [], [])
    for i in range(num_seqs):
        step.token_ids.extend((31 * j + i) % vocab for j in range(length))
        step.positions.extend(range(length))
        step.query_lens.append(length)
        step.seq_lens.append(length)
        step.block_tables.append(list(range(i * per, (i + 1) * per)))
        step.logits_indices.append((i + 1) * length - 1)
    return step

