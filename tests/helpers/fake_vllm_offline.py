"""A stand-in for `<vllm python> -m benchmarks.harness.vllm_offline ...` in harness tests (no vLLM
here): parses the command line with vllm_offline's own parser and writes the result JSON that
vllm_offline would, as if vLLM had generated every request's exact length; its arguments are
echoed for the test to read."""

from __future__ import annotations

import json
import sys

from benchmarks.harness.bench import sharegpt_like
from benchmarks.harness.vllm_offline import engine_kwargs, parse_args
from benchmarks.harness.vllm_side import summarize_offline

if __name__ == "__main__":
    if sys.argv[1:3] != ["-m", "benchmarks.harness.vllm_offline"]:
        sys.exit(f"unexpected command line: {sys.argv}")
    args = parse_args(sys.argv[3:])
    print("args:", json.dumps({"model": str(args.model), "requests": args.requests,
                               "warmup": args.warmup_requests, "max_model_len":
                               args.max_model_len, "engine": engine_kwargs(args.engine_args)}))
    lengths = sharegpt_like(args.requests)
    rows = [(n_in + 1, n_out, "length") for n_in, n_out in lengths]
    args.out.write_text(json.dumps(summarize_offline(rows, lengths, 2.0, 60.0)))
