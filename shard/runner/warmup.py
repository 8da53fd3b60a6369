"""Warmup: run the worst-case prefill, then size the paged KV cache from the memory left."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, replace

import torch

from shard.distributed.groups import Dist
from shard.errors import FailedPreconditionError
from shard.runner.model_runner import ModelRunner, StepInputs


@dataclass(frozen=True)
class WarmupSpec:
    """The router's limits, which bound the worst-case prefill and the KV cache (Warmup in
    shard.proto)."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int
    max_batch_total_tokens: int | None = None
    speculate_tokens: int = 0  # most draft tokens per request and step (speculative decoding)
    speculate_max_batch_size: int = 0  # largest step with drafts


@dataclass(frozen=True)
class WarmupResult:
    """How many KV blocks fit, and so how many tokens the router may schedule."""

    num_blocks: int
    block_size: int
    max_supported_total_tokens: int
    warmup_ns: int



log = logging.getLogger(__name__)

# Larger decode batches run eagerly. 1,024: a burst of ~1,000 requests decodes in graphs too (the
# largest bucket's logits are 1,024 x vocab fp32, 0.5 GB at Llama 3's 128k vocabulary).
CUDA_GRAPH_MAX_BATCH = 1024
# On CPU the KV cache is sized from host memory (or --kv-cache-memory-mb), not from the warm-up
# prefill's peak, so a worst-case prefill measures nothing there: a short one still runs every
# kernel once and calibrates an fp8 KV cache. The full one (4,096 tokens for the default model)
# took 50-110 s of a 2-core host's start-up.
CPU_WARMUP_PREFILL_TOKENS = 256


def warmup_prefill_spec(spec: WarmupSpec, device: torch.device) -> WarmupSpec:
    """The limits the warm-up prefill is built from: the router's own on accelerators, capped at
    CPU_WARMUP_PREFILL_TOKENS on CPU."""
    if device.type != "cpu" or spec.max_batch_prefill_tokens <= CPU_WARMUP_PREFILL_TOKENS:
        return spec
    cap = CPU_WARMUP_PREFILL_TOKENS
    return replace(spec, max_batch_prefill_tokens=cap,
                   max_input_tokens=min(spec.max_input_tokens, cap))


def worst_case_prefill(spec: WarmupSpec, block_size: int, vocab_size: int = 1) -> StepInputs:
    """max_batch_prefill_tokens tokens split into prompts of at most max_input_tokens (at most
    max_batch_size of them), laid out on consecutive blocks starting at 0. Token ids are spread
    over the vocabulary (a fixed stride), so that the K/V ranges an fp8 cache calibrates on come
    from varied text rather than one repeated token."""
    step = StepInputs([], [], [], [], [], [])
    left, next_block = spec.max_batch_prefill_tokens, 0
    while left > 0 and len(step.seq_lens) < max(spec.max_batch_size, 1):
        n = min(left, spec.max_input_tokens)
        blocks = list(range(next_block, next_block + math.ceil(n / block_size)))
        next_block += len(blocks)
        first = len(step.token_ids)
        step.token_ids.extend((7919 * (first + j) + 13) % vocab_size for j in range(n))
        step.positions.extend(range(n))
        step.query_lens.append(n)
        step.seq_lens.append(n)
        step.block_tables.append(blocks)
        step.logits_indices.append(len(step.token_ids) - 1)
        left -= n
    return step


def mixed_warmup_step(decode_rows: int, block_size: int) -> StepInputs:
    """A mixed step: a one-block prompt chunk on block 0, then `decode_rows` one-token rows, each
    a full block of context on block 1 (they all write its last slot: warmup K/V is garbage)."""
    step = StepInputs([], [], [], [], [], [])
    step.token_ids.extend(range(1, block_size + 1))
    step.positions.extend(range(block_size))
    step.query_lens.append(block_size)
    step.seq_lens.append(block_size)
    step.block_tables.append([0])
    step.logits_indices.append(block_size - 1)
    for _ in range(decode_rows):
        step.logits_indices.append(len(step.token_ids))
        step.token_ids.append(1)
        step.positions.append(block_size - 1)
        step.query_lens.append(1)
        step.seq_lens.append(block_size)
        step.block_tables.append([1])
    return step


def cpu_available_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_warmup(
    runner: ModelRunner,
    spec: WarmupSpec,
    dist: Dist,
    max_positions: int,
    cuda_memory_fraction: float,
    kv_cache_memory_mb: int | None,
    flag_cap_tokens: int | None,
) -> WarmupResult:
    t0 = time.perf_counter_ns()
    bs = runner.block_size
    if spec.max_input_tokens > spec.max_total_tokens:
        raise FailedPreconditionError("--max-input-tokens must be <= --max-total-tokens")
    if spec.max_total_tokens > max_positions:
        raise FailedPreconditionError(
            f"--max-total-tokens {spec.max_total_tokens} exceeds the model's "
            f"max_position_embeddings {max_positions}; lower --max-total-tokens"
        )
    if spec.max_batch_prefill_tokens < spec.max_input_tokens:
        raise FailedPreconditionError("--max-batch-prefill-tokens must be >= --max-input-tokens")
    prefill = warmup_prefill_spec(spec, runner.device)
    step = worst_case_prefill(prefill, bs, runner.model.vocab_size)
    if runner.lora is not None:  # the LoRA kernels' intermediates count in the peak too
        step.lora_slots = [0] * len(step.seq_lens)
    device = runner.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        runner.allocate_kv_cache(sum(len(t) for t in step.block_tables) + 1)
        runner.execute_calibrating(step)  # fp8 KV caches: per-head scales from this prefill
        for rows in runner.attention.mixed_warmup_decode_rows():  # compile them before traffic
            runner.execute(mixed_warmup_step(rows, bs))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as exc:
        runner.allocate_kv_cache(0)
        raise FailedPreconditionError(
            f"the worst-case prefill of {spec.max_batch_prefill_tokens} tokens does not fit in "
            f"device memory ({exc}); lower --max-batch-prefill-tokens"
        ) from exc
    bytes_per_block = runner.kv_bytes_per_block()
    runner.kv_cache = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base_alloc
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        usable = free - int(total * (1.0 - cuda_memory_fraction)) - peak
        knob = "--cuda-memory-fraction"
    else:
        if kv_cache_memory_mb is not None:
            usable = kv_cache_memory_mb * 2**20
        else:
            usable = cpu_available_bytes() // 10
        knob = "--kv-cache-memory-mb"
    num_blocks = max(usable // bytes_per_block, 0)
    caps = [c for c in (spec.max_batch_total_tokens, flag_cap_tokens) if c]
    if caps:
        num_blocks = min(num_blocks, math.ceil(min(caps) / bs))
    num_blocks = dist.min_int(int(num_blocks))
    if num_blocks * bs < spec.max_total_tokens:
        raise FailedPreconditionError(
            f"the KV cache holds only {num_blocks * bs} tokens ({num_blocks} blocks of {bs}) but "
            f"one request may need --max-total-tokens {spec.max_total_tokens}; lower "
            f"--max-total-tokens (or --max-batch-prefill-tokens), or raise {knob} / "
            f"--max-batch-total-tokens"
        )
    prefill_s = (time.perf_counter_ns() - t0) / 1e9
    runner.allocate_kv_cache(num_blocks)
    # Decode CUDA graphs bake in the KV pool's addresses: capture after the final allocation.
    max_batch = min(max(spec.max_batch_size, 1), CUDA_GRAPH_MAX_BATCH)
    graphs_s = runner.capture_cuda_graphs(max_batch, spec.max_total_tokens)
    if spec.speculate_tokens > 0:  # verify steps: 1 + k tokens per request, k <= speculate
        graphs_s += runner.capture_verify_graphs(
            spec.speculate_tokens + 1,
            min(max(spec.speculate_max_batch_size, 1), max_batch),
            spec.max_total_tokens,
        )
    graphs = (f"decode graphs up to batch {max_batch} captured in {graphs_s:.1f} s"
              if runner.graphs is not None else "decode runs eagerly (no CUDA graphs)")
    kind = "worst-case prefill" if prefill is spec else "prefill (capped on CPU)"
    log.info("warmup: %s of %d tokens (with kernel tuning) %.1f s; KV cache %d "
             "blocks (%d tokens, %.2f GiB); %s", kind, prefill.max_batch_prefill_tokens, prefill_s,
             num_blocks, num_blocks * bs, num_blocks * bytes_per_block / 2**30, graphs)
    return WarmupResult(
        num_blocks=num_blocks,
        block_size=bs,
        max_supported_total_tokens=num_blocks * bs,
        warmup_ns=time.perf_counter_ns() - t0,
    )
