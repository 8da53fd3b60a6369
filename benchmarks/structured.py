"""Structured output benchmarks (issue 22); results in benchmarks/STRUCTURED.md.

    # CPU: both libraries on our tokenizers (xgrammar only when installed: pip install
    # xgrammar==0.2.8), then the ITL of an unconstrained stream while 20 new schemas compile
    python -m benchmarks.structured --parts libraries,itl --out /tmp/structured

    # GPU (one command, < 3 min on an H100): decode throughput at batch 64 on the
    # Llama-3-8B shape, every sequence JSON-constrained vs unconstrained
    python -m benchmarks.structured --parts gpu --out $OUT

Parts:
- `libraries`: for llguidance and xgrammar, on SmolLM2's tokenizer (49,152 entries), a tiny test
  model's and (gpu part only) a synthetic 128,256-entry byte-level vocabulary: tokenizer set-up
  time, grammar compile time p50/p99 over the schema suite (tests/helpers/schemas.py), and the
  per-step bitmask time at batch 1/64/256 with the ten-optional-property schema (every row a
  matcher at a different point of a valid output; each step fills every row, then every row
  consumes its next token).
- `itl`: a real `tokenwire launch` (SmolLM2 on CPU): one unconstrained GenerateStream runs while
  20 requests with 20 new schemas arrive; the stream's inter-token latency during that window
  against before it.
- `gpu`: the shard's own engine (`BatchState`: prefill, then decode steps with CUDA graphs) on a
  random Llama-3-8B-shaped checkpoint with a 128,256-entry byte-level tokenizer; batch 64, every
  sequence constrained by a JSON schema vs none; tokens/s and the step time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers.schemas import SCHEMAS, TEN_OPTIONAL

# A valid output of TEN_OPTIONAL in the grammar's separators: the rows replay it.
TEN_OPTIONAL_SAMPLE = (
    '{"id": 1042, "name": "Ada Lovelace", "email": "ada@example.com", "age": 36, '
    '"active": true, "score": 9.75, "tags": ["math", "engines"], "city": "London", '
    '"country": "United Kingdom", "notes": "first programmer"}'
)
BATCHES = (1, 64, 256)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# ---- tokenizers ---------------------------------------------------------------------------------


def smollm2_dir(cache: Path) -> Path:
    from service.app.launcher import ensure_local_model

    return ensure_local_model(None, None, cache)[1]


def tiny_dir(cache: Path) -> Path:
    from service.app.launcher import ensure_tiny_model

    return ensure_tiny_model(cache)


def write_bytelevel_tokenizer(model_dir: Path, vocab_size: int, specials: dict[int, str]) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` entries for the random 8B checkpoint:
    the 256 byte symbols, then words and word pieces of English text (pydoc's topics, shipped
    with every Python) with and without a leading space, digits and punctuation runs, then
    `specials` at their ids. No merges: encoding yields bytes (prompt lengths are exact either
    way); what matters here is the decoding side, which the grammar's token trie is built from."""
    import re as _re
    from pydoc_data.topics import topics

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_symbols = {b: c for b, c in zip(range(256), _byte_chars())}
    text = "\n".join(topics.values())
    words = sorted(set(_re.findall(r"[A-Za-z]+|[0-9]{1,3}|[^\sA-Za-z0-9]{1,3}", text)))
    pieces: list[str] = []
    for w in words:
        pieces += [w, " " + w]
        for k in range(2, len(w)):
            pieces += [w[:k], " " + w[:k], w[k:]]
    vocab: dict[str, int] = {}
    for c in sorted(alphabet, key=lambda ch: ord(ch)):
        vocab.setdefault(c, len(vocab))
    limit = min(specials) if specials else vocab_size
    for p in pieces:
        if len(vocab) >= limit:
            break
        sym = "".join(to_symbols[b] for b in p.encode())
        vocab.setdefault(sym, len(vocab))
    n = 0
    while len(vocab) < limit:  # filler: rare byte triples (unique for n < 2**24)
        sym = "".join(to_symbols[(n >> shift) & 255] for shift in (0, 8, 16))
        vocab.setdefault(sym + to_symbols[ord("~")], len(vocab))
        n += 1
    for i in range(limit, vocab_size):
        vocab[specials.get(i, f"<|reserved_special_token_{i - limit}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials.values()])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[min(specials)],
        "eos_token": specials[min(specials) + 1], "model_max_length": 8192,
    }))


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's symbols)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(
        range(0xAE, 0xFF + 1)
    )
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


# ---- libraries --------------------------------------------------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, model_dir: Path, vocab_size: int, eos: int, threads: int) -> None:
        import llguidance
        import llguidance.torch as lltorch
        from tokenizers import Tokenizer

        from service.engine.contracts import GrammarSpec
        from service.generation.grammar import json_schema_spec

        self._ll, self._lt = llguidance, lltorch
        self._spec: type[GrammarSpec] = GrammarSpec
        self._json_spec = json_schema_spec
        t0 = time.perf_counter()
        text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).to_str()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(threads)
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        source = self._json_spec(schema).source
        grammar = self._ll.LLMatcher.grammar_from_json_schema(source)
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.tokenize_str(text)

    def consume(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def consume_batch(self, pairs: list[tuple[Any, int]]) -> None:
        self.executor.consume_token_par(pairs)

    def bitmask(self, batch: int):
        return self._lt.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask) -> None:
        self._lt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )


class XGrammar:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab_size: int, eos: int, threads: int) -> None:
        import transformers
        import xgrammar

        self._xg = xgrammar
        t0 = time.perf_counter()
        hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads,
                                                 cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.hf = hf
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )

    def matcher(self, compiled: Any) -> Any:
        return self._xg.GrammarMatcher(compiled)

    def tokenize(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def consume(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)

    def consume_batch(self, pairs: list[tuple[Any, int]]) -> None:
        self.batch.batch_accept_token([m for m, _ in pairs], [t for _, t in pairs])

    def bitmask(self, batch: int):
        return self._xg.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


def bench_library(lib, steps: int) -> dict[str, Any]:
    """Compile times over the suite and per-step mask (and consume) times at each batch."""
    compile_ms = []
    for _, _, schema in SCHEMAS:
        t0 = time.perf_counter()
        lib.compile(schema)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    compiled = lib.compile(TEN_OPTIONAL)
    ten_compile_ms = (time.perf_counter() - t0) * 1e3
    tokens = lib.tokenize(TEN_OPTIONAL_SAMPLE)
    result: dict[str, Any] = {
        "setup_s": round(lib.setup_s, 3),
        "compile_ms_p50": round(statistics.median(compile_ms), 3),
        "compile_ms_p99": round(_pct(compile_ms, 0.99), 3),
        "compile_ms_max": round(max(compile_ms), 3),
        "ten_optional_compile_ms": round(ten_compile_ms, 3),
        "mask": {},
    }
    for batch in BATCHES:
        matchers, cursors = [], []
        for i in range(batch):
            m = lib.matcher(compiled)
            start = (i * 7) % (len(tokens) - steps - 1)  # rows at different points
            for t in tokens[:start]:
                lib.consume(m, t)
            matchers.append(m)
            cursors.append(start)
        bitmask = lib.bitmask(batch)
        lib.fill(matchers, bitmask)  # warm-up (lazy lexer states)
        fill_ms, consume_ms = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            lib.fill(matchers, bitmask)
            t1 = time.perf_counter()
            lib.consume_batch([(m, tokens[c]) for m, c in zip(matchers, cursors)])
            t2 = time.perf_counter()
            cursors = [c + 1 for c in cursors]
            fill_ms.append((t1 - t0) * 1e3)
            consume_ms.append((t2 - t1) * 1e3)
        result["mask"][batch] = {
            "fill_ms_p50": round(statistics.median(fill_ms), 4),
            "fill_ms_mean": round(statistics.fmean(fill_ms), 4),
            "consume_ms_p50": round(statistics.median(consume_ms), 4),
            "per_row_us": round(statistics.median(fill_ms) * 1e3 / batch, 2),
        }
    return result


def part_libraries(args: argparse.Namespace) -> dict[str, Any]:
    cache = args.cache
    tokenizers_ = {
        "smollm2": (smollm2_dir(cache), 49152, 2),
        "tiny": (tiny_dir(cache), None, None),
    }
    out: dict[str, Any] = {"threads": args.threads}
    for tname, (model_dir, vocab, eos) in tokenizers_.items():
        if vocab is None:
            config = json.loads((model_dir / "config.json").read_text())
            vocab, eos = config["vocab_size"], config["eos_token_id"]
        for cls in (LLGuidance, XGrammar):
            key = f"{cls.name}/{tname}"
            try:
                lib = cls(model_dir, vocab, eos, args.threads)
            except ImportError as error:
                out[key] = {"skipped": f"not installed ({error})"}
                print(key, "skipped:", error, flush=True)
                continue
            out[key] = bench_library(lib, args.steps)
            print(key, json.dumps(out[key]), flush=True)
    return out


# ---- ITL while schemas compile ----------------------------------------------------------------


def part_itl(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from google.protobuf import json_format
    from tokenwire.v1 import generate_pb2 as gpb
    from tokenwire.v1 import generate_pb2_grpc as gpb_grpc

    from tests.helpers.processes import launch

    model_dir = smollm2_dir(args.cache) if args.itl_model == "smollm2" else tiny_dir(args.cache)
    work = Path(args.out) / "itl-work"
    work.mkdir(parents=True, exist_ok=True)
    dep = launch(work, "--model-id", str(model_dir), "--dtype", "float32",
                 "--kv-cache-memory-mb", "512", "--max-total-tokens", "1024",
                 "--max-concurrent-requests", "64", http=False, timeout=400.0)
    try:
        channel = grpc.insecure_channel(dep.target)
        stub = gpb_grpc.TextGenerationStub(channel)
        prompt = "<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n"
        if args.itl_model == "tiny":
            prompt = "Tell me a long story."
        stream_req = gpb.GenerateRequest(
            inputs=prompt,
            parameters=gpb.GenerateParameters(max_new_tokens=args.stream_tokens),
        )
        arrivals: list[float] = []
        windows: dict[str, tuple[float, float]] = {}

        def burst(name: str, grammar: bool) -> None:
            """20 requests at once, short prompts (little prefill work), one token each; with
            `grammar`, each brings a schema never seen before (a distinct property name)."""
            start = time.monotonic()
            threads = []
            for i in range(20):
                req = gpb.GenerateRequest(inputs="Hi", parameters=gpb.GenerateParameters(
                    max_new_tokens=1))
                if grammar:
                    key = f"field_{i}_{os.getpid()}_{time.time_ns()}"
                    schema = {"type": "object", "properties": {
                        key: {"type": "string", "maxLength": 8},
                        "n": {"type": "integer", "minimum": 0, "maximum": i + 5}},
                        "required": [key], "additionalProperties": False}
                    req.parameters.grammar.type = "json"
                    json_format.ParseDict(schema, req.parameters.grammar.value)
                t = threading.Thread(target=stub.Generate, args=(req,), kwargs={"timeout": 300})
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            windows[name] = (start, time.monotonic())

        def flood() -> None:
            for name, grammar, after in (("unconstrained", False, 20), ("new_schemas", True, 40)):
                while len(arrivals) < after:  # the stream runs steadily before each burst
                    if stream_done.is_set():
                        return
                    time.sleep(0.01)
                burst(name, grammar)

        stream_done = threading.Event()
        flooder = threading.Thread(target=flood)
        flooder.start()
        for _ in stub.GenerateStream(stream_req, timeout=900):
            arrivals.append(time.monotonic())
        stream_done.set()
        flooder.join()
        if len(windows) < 2:
            raise RuntimeError(f"the stream ended after {len(arrivals)} tokens, before the bursts")
        channel.close()
    finally:
        dep.stop()
    gaps = [(b, (b - a) * 1e3) for a, b in itertools.pairwise(arrivals)]

    def stats(values: list[float]) -> dict[str, float]:
        return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2),
                "n": len(values)}

    first = windows["unconstrained"][0]
    out: dict[str, Any] = {"model": args.itl_model, "stream_tokens": len(arrivals),
                           "steady_itl_ms": stats([g for t, g in gaps if t < first][5:])}
    for name, (start, end) in windows.items():
        # Gaps that end inside the burst, and the first one after it (it spans its end).
        inside = [g for t, g in gaps if start <= t <= end]
        after = [g for t, g in gaps if t > end][:1]
        out[f"{name}_burst"] = {"window_s": round(end - start, 3),
                                "itl_ms": stats(inside + after)}
    return out


# ---- GPU: decode at batch 64 on the 8B shape --------------------------------------------------


def _drive(engine, prompts: list[list[int]], blocks_per_seq: int, block_size: int, steps: int,
           grammar) -> dict[str, Any]:
    """Prefills every prompt (one step), then times `steps` decode steps of the whole batch."""
    import torch

    from shard.engine.contracts import BatchSpec, CachedBatchRef, RequestSpec

    engine.clear_cache(None)
    specs = [
        RequestSpec(id=i + 1, input_ids=p, cache_len=0, chunk_len=len(p),
                    blocks=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                    max_new_tokens=steps + 8, ignore_eos_token=True, grammar=grammar)
        for i, p in enumerate(prompts)
    ]
    result = engine.prefill(BatchSpec(id=1, requests=specs), None, [])
    ref = result.batch
    step_ms, sizes = [], []
    tokens = 0
    for _ in range(steps):
        if ref is None:
            break
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.decode([CachedBatchRef(ref.id, ref.request_ids)], [])
        step_ms.append((time.perf_counter() - t0) * 1e3)
        sizes.append(len(ref.request_ids))
        tokens += len(out.generations)
        ref = out.batch
    full = [ms for ms, n in zip(step_ms, sizes) if n == len(prompts)]
    return {
        "steps": len(step_ms),
        "tokens_per_s": round(tokens / (sum(step_ms) / 1e3), 1),
        "step_ms_p50_full_batch": round(statistics.median(full), 3) if full else None,
        "full_batch_steps": len(full),
    }


def write_tiny_checkpoint(model_dir: Path) -> None:
    """A random 2-layer Llama with Llama-3's vocabulary size (float32 safetensors)."""
    import torch
    import transformers

    if (model_dir / "config.json").is_file():
        return
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=128000, eos_token_id=128001,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[128001].zero_()
    model.save_pretrained(model_dir)


def part_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from service.generation.grammar import json_schema_spec
    from shard.distributed.groups import Dist
    from shard.engine.grammar import GrammarSpec
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig
    from shard.testing.checkpoint import BOS_ID, EOS_ID, write_checkpoint

    t0 = time.perf_counter()
    specials = {BOS_ID: "<|begin_of_text|>", EOS_ID: "<|end_of_text|>",
                128008: "<|eom_id|>", 128009: "<|eot_id|>"}
    if args.tiny:  # a CPU check of the whole path: 2 small layers, the real vocabulary size
        model_dir = Path(args.workdir) / "tiny-128k-bytelevel"
        write_tiny_checkpoint(model_dir)
    else:
        # The harness's checkpoint (reused when it is there), with a byte-level tokenizer of the
        # same 128,256 entries in place of its word-level one.
        base = Path(args.workdir) / f"llama3-8b-shape-{args.num_layers}l"
        write_checkpoint(base, args.num_layers)
        model_dir = Path(args.workdir) / f"{base.name}-bytelevel"
        model_dir.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            link = model_dir / f.name
            if not f.name.startswith("tokenizer") and not link.exists():
                link.symlink_to(f)
    write_bytelevel_tokenizer(model_dir, 128256, specials)
    write_s = time.perf_counter() - t0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if device == "cuda"
                              else "float32", device=device), Dist())
    batch, context = args.batch, args.context
    steps = args.decode_steps
    block_size = shard.runner.block_size
    blocks_per_seq = math.ceil((context + steps + 16) / block_size)
    shard.warmup(WarmupSpec(max_input_tokens=context, max_total_tokens=context + steps + 16,
                            max_batch_prefill_tokens=batch * context, max_batch_size=batch,
                            max_batch_total_tokens=batch * blocks_per_seq * block_size))
    # Prompts of byte tokens (ids < 256) ending in a chat-like cue; content is irrelevant.
    prompts = [[(17 * i + 5 * j) % 200 + 32 for j in range(context)] for i in range(batch)]
    # JSON that a random model keeps writing: an object of free strings (no maxLength) and an
    # unbounded array; EOS rows of the LM head are zero, the grammar never has to end.
    spec = json_schema_spec({"type": "object", "properties": {
        "title": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "items"], "additionalProperties": False})
    grammar = GrammarSpec(spec.kind, spec.source)
    shard.engine.grammars.prepare()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "batch": batch, "context": context, "num_layers": args.num_layers,
                           "checkpoint_s": round(write_s, 1),
                           "mask_threads": shard.engine.grammars._threads}
    _drive(shard.engine, prompts, blocks_per_seq, block_size, 4, None)  # warm-up
    _drive(shard.engine, prompts, blocks_per_seq, block_size, 4, grammar)
    # Alternating rounds, so that drift (clocks, other load) hits both modes alike; the median
    # round of each mode is reported.
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json_constrained": []}
    for _ in range(args.rounds):
        for name, g in (("unconstrained", None), ("json_constrained", grammar)):
            run = _drive(shard.engine, prompts, blocks_per_seq, block_size, steps, g)
            runs[name].append(run)
            print(name, json.dumps(run), flush=True)
    for name, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["tokens_per_s"])
        out[name] = {**ordered[len(ordered) // 2], "all_tokens_per_s": [r["tokens_per_s"]
                                                                       for r in rs]}
    base = out["unconstrained"]["tokens_per_s"]
    out["slowdown_pct"] = round(100 * (1 - out["json_constrained"]["tokens_per_s"] / base), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured")
    a = parser.add_argument
    a("--parts", default="libraries,itl", help="comma-separated: libraries, itl, gpu")
    a("--out", type=Path, default=Path("/tmp/structured"))
    a("--cache", type=Path, default=Path.home() / ".cache" / "tokenwire")
    a("--threads", type=int, default=max(1, min(16, (os.cpu_count() or 2) // 2)))
    a("--steps", type=int, default=30, help="libraries: mask steps per batch")
    a("--decode-steps", type=int, default=64, help="gpu: decode steps per run")
    a("--stream-tokens", type=int, default=120)
    a("--itl-model", choices=["smollm2", "tiny"], default="smollm2",
      help="itl: the served model (tiny: steps of milliseconds, so a compile stall stands out)")
    a("--workdir", type=Path, default=Path("/tmp/tokenwire-bench"))
    a("--num-layers", type=int, default=32)
    a("--batch", type=int, default=64)
    a("--context", type=int, default=512)
    a("--rounds", type=int, default=3, help="gpu: alternating unconstrained/constrained runs")
    a("--tiny", action="store_true", help="gpu part: a 2-layer model (checks the path on CPU)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for part in args.parts.split(","):
        fn = {"libraries": part_libraries, "itl": part_itl, "gpu": part_gpu}[part]
        results[part] = fn(args)
        (args.out / "structured.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
