"""Tiny-model greedy runs through the shard's own loading path: the tensor-parallel equality
checks of the GPU tests and the benchmark harness (TP=N greedy tokens must equal one GPU's)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from shard.distributed.groups import Dist
from shard.runner.model_runner import StepInputs
from shard.runner.warmup import WarmupSpec
from shard.server.loader import Shard, ShardConfig
from shard.tools.tiny_training import read_task, task_prompts

PROMPT_LENS = (17, 5, 45)
GREEDY_STEPS = 32


def tiny_prompts(vocab: int, model_dir: Path | str | None = None) -> list[list[int]]:
    """The greedy check's prompts: in-distribution task prompts for a model trained by
    `make-tiny-model --train-steps` (its task card says which), arbitrary ids otherwise."""
    task = read_task(model_dir) if model_dir is not None else None
    if task is not None:
        return task_prompts(PROMPT_LENS, task)
    return [[(37 * i + 11 * j + 3) % vocab for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def greedy_tokens(shard: Shard, steps: int = GREEDY_STEPS,
                  margins: list[list[float]] | None = None) -> list[list[int]]:
    """Batched prefill of the tiny prompts, then `steps` decode steps (CUDA graphs when the
    shard captured them); returns each sequence's generated tokens (and appends each step's
    top-2 logit margins per sequence to `margins` when given)."""
    runner = shard.runner
    bs = runner.block_size
    prompts = tiny_prompts(runner.model.vocab_size, shard.cfg.model_id)
    per = math.ceil((max(len(p) for p in prompts) + steps + 1) / bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    step = StepInputs([], [], [], [], [], [])
    for p, t in zip(prompts, tables):
        step.token_ids.extend(p)
        step.positions.extend(range(len(p)))
        step.query_lens.append(len(p))
        step.seq_lens.append(len(p))
        step.block_tables.append(t)
        step.logits_indices.append(len(step.token_ids) - 1)
    def pick(logits: torch.Tensor) -> list[int]:  # [num_seqs, vocab]
        if margins is not None:
            top2 = logits.float().topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
        return logits.argmax(-1).tolist()

    last = pick(runner.execute(step))
    out = [[t] for t in last]
    lens = [len(p) for p in prompts]
    for _ in range(steps - 1):
        dec = StepInputs(
            token_ids=last,
            positions=list(lens),
            query_lens=[1] * len(prompts),
            seq_lens=[n + 1 for n in lens],
            block_tables=tables,
            logits_indices=list(range(len(prompts))),
        )
        last = pick(runner.execute(dec))
        lens = [n + 1 for n in lens]
        for o, t in zip(out, last):
            o.append(t)
    return out


def load_tiny(model_dir: Path, device: str, dist: Dist) -> Shard:
    """The tiny model as `tokenwire shard` serves it (bf16 on CUDA, fp32 on CPU), warmed up."""
    cuda = device.startswith("cuda")
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if cuda else "float32",
                              device=device, kv_cache_memory_mb=None if cuda else 4), dist)
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
    return shard
