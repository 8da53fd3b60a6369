"""`<vllm python> -m benchmarks.harness.vllm_offline --model DIR --out JSON`: vLLM's engine bound of
the harness's workload, run INSIDE vLLM's interpreter by vllm_side.bench_vllm_offline.

`LLM(...)` with vLLM's defaults (bf16, seed 0, the given max model length and any extra engine
arguments), 64 short warm-up requests, then all requests in one `LLM.generate` (greedy, exactly
n_out tokens each); start-up is the `LLM(...)` construction (load, compile, graph capture).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.harness.bench import prompt_text, sharegpt_like
from benchmarks.harness.vllm_side import offline_rows, summarize_offline


def engine_kwargs(cli: str) -> dict:
    """'--max-num-batched-tokens 8192 --enforce-eager' -> {'max_num_batched_tokens': 8192,
    'enforce_eager': True}: the served part's extra CLI arguments as LLM(...) keywords."""
    import shlex

    out: dict = {}
    toks = shlex.split(cli)
    i = 0
    while i < len(toks):
        key = toks[i].lstrip("-").replace("-", "_")
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            val: object = toks[i + 1]
            try:
                val = json.loads(val)  # numbers, true/false, JSON objects
            except ValueError:
                pass
            out[key] = val
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.harness.vllm_offline")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup-requests", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--engine-args", default="")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from vllm import LLM, SamplingParams

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    t0 = time.perf_counter()
    llm = LLM(model=str(args.model), dtype="bfloat16", seed=0, max_model_len=args.max_model_len,
              **engine_kwargs(args.engine_args))
    startup_s = time.perf_counter() - t0
    lengths = sharegpt_like(args.requests)
    prompts = [prompt_text(i, n_in) for i, (n_in, _) in enumerate(lengths)]
    if args.warmup_requests:
        warm = min(args.warmup_requests, len(prompts))
        llm.generate(prompts[:warm], [params(min(o, 16)) for _, o in lengths[:warm]],
                     use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, [params(o) for _, o in lengths], use_tqdm=False)
    wall_s = time.perf_counter() - t1
    res = summarize_offline(offline_rows(outs), lengths, wall_s, startup_s)
    import vllm

    res["vllm_version"] = vllm.__version__
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
