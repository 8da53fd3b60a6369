"""Per-token cost of the transformers backend does not grow with the context (CPU).

    python benchmarks/transformers_backend_context.py [--model-types qwen3,gemma2,...]
        [--short 64] [--long 2048] [--steps 32] [--reps 3]

For each model type, a tiny random model (shard/tools/tiny_any.py: 2 layers, hidden 64) is
served through the transformers backend by the shard's own loader (paged KV cache, torch
attention backend), and tiny Llama through the native path for reference. One sequence is
prefilled to `--short` tokens and one to `--long`; then `--steps` batch-1 decode steps are timed
on each (the runner's execute: host step -> tensors -> forward), alternately, --reps times; the
median step is reported. The recompute fallback this backend replaced re-ran the whole context
every step (3.3x to 56x slower per token at a 1,600-token prompt than at 4 tokens); the issue's
bar is long/short <= 1.5. Exit status 1 when any model misses it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BAR = 1.5


def decode_step_ms(runner, prompt_len: int, steps: int, reps: int, first_block: int) -> float:
    """Median ms of one batch-1 decode step at context ~prompt_len."""
    from shard.runner.model_runner import StepInputs

    bs = runner.block_size
    blocks = list(range(first_block, first_block + -(-(prompt_len + steps * reps + 1) // bs)))
    prompt = [(7 * i + 3) % 400 + 3 for i in range(prompt_len)]
    runner.execute(StepInputs(prompt, list(range(prompt_len)), [prompt_len], [prompt_len],
                              [blocks], [prompt_len - 1]))
    n, token, times = prompt_len, 5, []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = runner.execute(StepInputs([token], [n], [1], [n + 1], [blocks], [0]))
            token = int(logits.argmax(-1)[0])
            n += 1
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def measure(model_dir: Path, impl: str, args: argparse.Namespace) -> tuple[float, float]:
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    total = args.long + args.steps * args.reps + 64
    shard = Shard(ShardConfig(model_id=str(model_dir), model_impl=impl,
                              kv_cache_memory_mb=64), Dist())
    shard.warmup(WarmupSpec(total, total, total, 2, max_batch_total_tokens=2 * total + 64))
    runner = shard.runner
    per_seq = -(-total // runner.block_size)
    short = long = float("inf")
    for _ in range(2):  # alternate: load from other processes hits both alike
        short = min(short, decode_step_ms(runner, args.short, args.steps, args.reps, 0))
        long = min(long, decode_step_ms(runner, args.long, args.steps, args.reps, per_seq))
    return short, long


def main() -> int:
    import torch

    from shard.tools.tiny_any import write_tiny_any
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-types", default="qwen3,gemma2,phi3,gpt_neox,mixtral")
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--long", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ok = True
    print(f"decode step, batch 1, context {args.short} vs {args.long} (median ms, "
          f"{args.threads} thread(s))")
    print(f"{'model':<12} {'path':<13} {args.short:>8} {args.long:>8}  ratio")
    with tempfile.TemporaryDirectory() as tmp:
        rows: list[tuple[str, Path, str]] = [
            ("llama", make_tiny_model(Path(tmp) / "llama",
                                      TinyModelSpec("llama", max_position_embeddings=4096)),
             "native"),
        ]
        # Native Llama with 4 KV heads: the KV width of the MHA models (gpt_neox), whose
        # attention (the shared torch backend: block gather + SDPA) is twice the GQA models'.
        rows.append(("llama-mha", make_tiny_model(
            Path(tmp) / "llama-mha",
            TinyModelSpec("llama", num_kv_heads=4, max_position_embeddings=4096)), "native"))
        rows += [(t, write_tiny_any(Path(tmp) / t, t), "transformers")
                 for t in args.model_types.split(",")]
        rows.insert(1, ("llama", rows[0][1], "transformers"))
        for name, model_dir, impl in rows:
            short, long = measure(model_dir, impl, args)
            ratio = long / short
            mark = "" if impl == "native" or ratio <= BAR else f"  > {BAR}: FAIL"
            ok &= not mark
            print(f"{name:<12} {impl:<13} {short:8.2f} {long:8.2f}  {ratio:.2f}{mark}",
                  flush=True)
    print("PASS" if ok else "FAIL", f"(transformers backend: long/short <= {BAR})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
