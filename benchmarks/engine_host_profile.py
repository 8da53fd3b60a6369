"""Host-side cost of one shard decode step at large batch, on CPU (no GPU needed).

    python benchmarks/engine_host_profile.py [--batch 256] [--context 1024] [--steps 30]
        [--mode eager|graphs] [--penalties] [--profile]
        [--tokenizer DIR_OR_JSON] [--stop STR ...] [--ids-only]

A tiny llama (shard.tools.tiny_model) is loaded through the normal shard path, but the model's forward
is replaced by a stub that returns precomputed logits: what is left is exactly the Python the
shard runs per step around the GPU work — batch preparation (ModelRunner.prepare for eager steps,
or the CUDA-graph runner's staging-buffer fill with `--mode graphs`, using the real
CudaGraphDecodeRunner.run with a no-op replay), sampling bookkeeping, detokenization, stopping,
Generation objects and the DecodeResponse proto (shard/server/convert.py). Contexts are ~`context`
tokens, so block tables are ~context/16 entries per request.

`--tokenizer` puts a real tokenizer (e.g. SmolLM2's tokenizer.json) in place of the tiny one (the
tiny model's vocabulary is widened to it); `--stop` gives every request stop sequences (that never
match); `--ids-only` marks the requests as the router marks them by default (issue 23 item 3: the
router detokenizes and matches stop sequences; the shard's finish does no text work).

Prints the median per-step milliseconds of: the engine's prepare / forward(stub+staging) /
sample+detok, the proto conversion, and the whole.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


class _NoopGraph:
    def replay(self) -> None:
        pass


def _cpu_graphs(runner, max_batch: int, max_blocks: int):
    """A CudaGraphDecodeRunner whose buffers live on the CPU and whose replay does nothing: its
    run() performs the same host-side staging as on the GPU."""
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    g = CudaGraphDecodeRunner.__new__(CudaGraphDecodeRunner)
    # Re-run __init__ without pinned memory (pin_memory needs CUDA).
    real_zeros = torch.zeros

    def zeros(*a, **kw):
        kw.pop("pin_memory", None)
        return real_zeros(*a, **kw)

    torch.zeros = zeros
    try:
        CudaGraphDecodeRunner.__init__(g, runner.forward, torch.device("cpu"), runner.block_size,
                                       max_batch, max_blocks)
    finally:
        torch.zeros = real_zeros
    vocab = runner.model.vocab_size
    for n in g.buckets:
        g.graphs[n] = _NoopGraph()
        g.outputs[n] = torch.randn(n, vocab)
    return g


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", choices=("eager", "graphs"), default="eager")
    ap.add_argument("--penalties", action="store_true",
                    help="repetition_penalty 1.1 + frequency_penalty 0.1 on every row")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer.json (or its directory) to detokenize with")
    ap.add_argument("--stop", action="append", default=[],
                    help="a stop sequence of every request (repeatable)")
    ap.add_argument("--ids-only", action="store_true",
                    help="ids-only requests: no detokenization or stop matching on the shard")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from shard.distributed.groups import Dist
    from shard.engine.contracts import BatchSpec, RequestSpec
    from shard.engine.sampling import SamplingParams
    from shard.runner.warmup import WarmupSpec
    from shard.server import convert
    from shard.server.loader import Shard, ShardConfig
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="tw_hostprof_"))
    tok_json = None
    vocab_size = 512
    if args.tokenizer:
        from tokenizers import Tokenizer

        tok_json = Path(args.tokenizer)
        if tok_json.is_dir():
            tok_json = tok_json / "tokenizer.json"
        vocab_size = Tokenizer.from_file(str(tok_json)).get_vocab_size()
    model_dir = make_tiny_model(tmp / "llama", TinyModelSpec(
        arch="llama", max_position_embeddings=4096, vocab_size=vocab_size))
    if tok_json is not None:
        import shutil

        shutil.copy(tok_json, model_dir / "tokenizer.json")
    bs = 16
    per = -(-(args.context + args.steps + 40) // bs)
    total_blocks = per * args.batch + 1
    shard = Shard(ShardConfig(model_id=str(model_dir), device="cpu", block_size=bs), Dist())
    shard.warmup(WarmupSpec(max_input_tokens=64, max_total_tokens=2048,
                            max_batch_prefill_tokens=64, max_batch_size=args.batch,
                            max_batch_total_tokens=total_blocks * bs))
    runner, engine = shard.runner, shard.engine
    vocab = runner.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    bank = [torch.randn(args.batch, vocab, generator=gen) for _ in range(7)]
    calls = [0]

    def stub_forward(input_ids, positions, meta, logits_indices):
        calls[0] += 1
        n = logits_indices.shape[0]
        src = bank[calls[0] % len(bank)]
        if n <= src.shape[0]:
            return src[:n]
        return torch.randn(n, vocab, generator=gen)

    runner.forward = stub_forward
    if args.mode == "graphs":
        runner.graphs = _cpu_graphs(runner, args.batch, per)

        def run_and_vary(*a, _run=runner.graphs.run):
            out = _run(*a)
            calls[0] += 1
            return bank[calls[0] % len(bank)][: out.shape[0]]

        runner.graphs.run = run_and_vary

    sampling = SamplingParams()
    if args.penalties:
        sampling = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.1)
    refs = []
    for start in range(0, args.batch, 32):
        reqs = []
        for i in range(start, min(start + 32, args.batch)):
            ids = [(i * 7919 + j * 31) % (vocab - 3) + 3 for j in range(args.context)]
            reqs.append(RequestSpec(id=i, input_ids=ids, cache_len=0, chunk_len=len(ids),
                                    blocks=list(range(i * per, (i + 1) * per)),
                                    max_new_tokens=10_000, ignore_eos_token=True,
                                    sampling=sampling, stop_sequences=list(args.stop),
                                    ids_only=args.ids_only))
        res = engine.prefill(BatchSpec(id=start + 1, requests=reqs), None, [])
        refs.append(res.batch)
    res = engine.decode(refs, [])
    ref = res.batch
    for _ in range(3):  # warm
        res = engine.decode([ref], [])
        convert.decode_to_proto(res)
        ref = res.batch

    timings, conv, wall = [], [], []
    prof = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        if prof:
            prof.enable()
        t0 = time.perf_counter_ns()
        res = engine.decode([ref], [])
        t1 = time.perf_counter_ns()
        msg = convert.decode_to_proto(res)
        msg.SerializeToString()
        t2 = time.perf_counter_ns()
        if prof:
            prof.disable()
        ref = res.batch
        timings.append(res.timings)
        conv.append(t2 - t1)
        wall.append(t2 - t0)

    def med(xs):
        return round(statistics.median(xs) / 1e6, 3)

    summary = {
        "batch": args.batch, "context": args.context, "mode": args.mode,
        "penalties": args.penalties, "steps": args.steps, "ids_only": args.ids_only,
        "stops": len(args.stop), "tokenizer": str(args.tokenizer),
        "prepare_ms": med([t.prepare_ns for t in timings]),
        "forward_stub_ms": med([t.forward_ns for t in timings]),
        "sample_detok_ms": med([t.decode_ns for t in timings]),
        "engine_total_ms": med([t.total_ns for t in timings]),
        "proto_ms": med(conv),
        "host_total_ms": med(wall),
    }
    print(json.dumps(summary))
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
