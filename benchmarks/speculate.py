"""Speculative decoding benchmark (issue 24): n-gram drafts verified in one forward pass.

    python -m benchmarks.speculate cpu [--out benchmarks]      # SmolLM2 on this CPU
    python -m benchmarks.speculate host [--out benchmarks]     # per-step host cost, tiny, CPU
    python -m benchmarks.speculate gpu --out $OUT              # 8B shape, random bf16 weights
    python -m benchmarks.speculate gpu --tiny --device cpu     # the GPU part's code on a CPU

All parts load the model through the normal shard path (`shard.server.loader.Shard`, warmup,
CUDA graphs for decode and verify steps) and drive it with the router's own engine
(`LocalEngine`: scheduler, n-gram proposer, adaptive rule) through the shard protocol's proto
conversion on both sides, in one process: the protobuf messages are built and read exactly as
over gRPC, without the transport (so the figures are the model's and the engine's, not the
socket's). Every step records its host costs and how the runner ran it (StepRecord).

cpu: SmolLM2-135M-Instruct (the embedded default, float32) on input-grounded chat prompts
(summarize / rewrite a given paragraph, edit given code): acceptance rate, tokens per forward pass
and decode tokens/s with and without --speculate, batch 1 and all prompts at once; outputs must
be equal token for token.

host: the per-step host cost (router, proto conversion, the shard's preparation and sampling) of
a batch-64 decode step with speculation off against --speculate 4 with the adaptive rule off at
that batch: a step that drafts nothing must cost what a --speculate 0 step costs.

gpu, one command: (0) greedy equality with and without speculation on a trained tiny llama (no
near-ties) in bf16 on the device; then a Llama-3-8B-shaped checkpoint of random bf16 weights:
(1) the verify step's time for k = 1..8 draft tokens at batch 1 against the plain decode step
(CUDA graph replays, 1k context) and by batch size; (2) where a verify step's logits differ from
a decode step's (row 0 of a verify step, a batch-2 decode row, against a batch-1 decode);
(3) decode tokens/s at batch 1 with and without speculation on random prompts (the output does
not repeat: acceptance ~0) and on prompts of one token repeated, where the model's own greedy
output loops (high acceptance, reported); (4) batch 64 with the adaptive rule
(--speculate-max-batch-size) against no speculation, interleaved A B B A, with per-step host
costs and the runner's path for every step.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

# Input-grounded tasks: the answer copies or edits text given in the prompt.
_PARAGRAPH = (
    "The Great Barrier Reef, off the coast of Queensland in Australia, is the largest coral reef "
    "system in the world. It is made up of nearly three thousand individual reefs and nine "
    "hundred islands stretching over two thousand three hundred kilometres. The reef can be seen "
    "from outer space and is the biggest single structure made by living organisms. Rising sea "
    "temperatures have caused mass coral bleaching events in recent years, and scientists warn "
    "that the reef could lose much of its coral cover within a few decades."
)
_CODE = '''def average(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def largest(values):
    best = values[0]
    for value in values:
        if value > best:
            best = value
    return best
'''
GROUNDED_TASKS: list[str] = [
    f"Summarize the following paragraph in two sentences.\n\n{_PARAGRAPH}",
    f"Rewrite the following paragraph in simpler words, keeping every fact.\n\n{_PARAGRAPH}",
    (
        "Rename the variable `values` to `numbers` everywhere in this Python code and return "
        f"the whole code.\n\n{_CODE}"
    ),
    f"Add a docstring to each function of this Python code and return it.\n\n{_CODE}",
    f"Repeat the following paragraph exactly, word for word.\n\n{_PARAGRAPH}",
    (
        "Make `average` return 0 for an empty list in this Python code and return the whole "
        f"code.\n\n{_CODE}"
    ),
]


@functools.lru_cache(maxsize=4)
def _chat_tokenizer(model_dir: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(model_dir: Path | str, task: str) -> list[int]:
    """The task as one user message through the model's chat template, as token ids."""
    tok = _chat_tokenizer(str(model_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": task}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False).input_ids


# ---- the engine over an in-process shard -----------------------------------------------------


@dataclass
class StepRecord:
    """Host-side facts of one engine step (the `host` part and the GPU batch rows)."""

    rows: int  # sequences in the step (plan.batch_size)
    decoding_only: bool  # no prefill chunk in the step
    drafted: int  # draft tokens the step carried
    path: str  # how the runner ran it: decode_graph, verify_graph, eager (ModelRunner.last_path)
    decode_shaped: bool  # every row computes one token (a plain decode step's runner inputs)
    convert_s: float  # thread time of both sides' proto conversion
    prepare_s: float  # the shard's host work before the forward pass (StepTimings.prepare_ns)
    sample_s: float  # the shard's work after it: sampling, stopping, emitting (decode_ns)
    # Thread time of the shard's step minus that of runner.execute: its host work, robust to
    # other load on a CPU with one torch thread (on a GPU it also holds the wait for the device).
    shard_cpu_s: float
    router_s: float = 0.0  # the router's thread time for the step (LocalEngine.step_cpu_s)


class InProcessShard:
    """The engine's ShardBackend over a Shard in this process: every step's request is built
    by the router's converter, read by the shard's, and the answer goes back the same way."""

    def __init__(self, shard) -> None:
        self.shard = shard
        self.cpu_seconds = 0.0
        self._ids = itertools.count(1)
        self._batch_id: int | None = None
        self._batch_ids: list[int] = []
        self.records: list[StepRecord] = []
        self.engine = None  # the LocalEngine driving it: its router CPU time per step
        self._router_seen = 0.0
        self._execute_s = 0.0  # thread time in runner.execute during the current step
        runner = shard.runner
        execute = type(runner).execute

        def timed_execute(step):  # an instance attribute: the class's method, timed
            t = time.thread_time()
            try:
                return execute(runner, step)
            finally:
                self._execute_s += time.thread_time() - t

        runner.execute = timed_execute

    def close(self) -> None:
        """Gives the runner its own execute back."""
        self.shard.runner.__dict__.pop("execute", None)

    async def step(self, plan):
        from service.shard_client import convert as rc
        from shard.server import convert as sc

        engine = self.shard.engine
        runner = self.shard.runner
        if self.engine is not None:  # the previous step's router time is booked by now
            now = self.engine.step_cpu_s
            if self.records:
                self.records[-1].router_s = now - self._router_seen
            self._router_seen = now
        runner.last_path = ""
        self._execute_s = 0.0
        t0 = time.thread_time()
        if plan.chunks:
            req = rc.prefill_request(plan, next(self._ids), self._batch_id, self._batch_ids)
            args = sc.prefill_from_proto(req)
            t1 = time.thread_time()
            result = engine.prefill(*args)
        else:
            req = rc.decode_request(plan, self._batch_id, self._batch_ids)
            args = sc.decode_from_proto(req)
            t1 = time.thread_time()
            result = engine.decode(*args)
        t2 = time.thread_time()
        resp = (sc.prefill_to_proto if plan.chunks else sc.decode_to_proto)(result)
        out = rc.step_output(resp)
        t3 = time.thread_time()
        tm = result.timings
        drafted = sum(len(d) for _, d in plan.drafts)
        self.records.append(StepRecord(
            rows=plan.batch_size, decoding_only=not plan.chunks, drafted=drafted,
            path=runner.last_path, decode_shaped=not plan.chunks and not drafted,
            convert_s=(t1 - t0) + (t3 - t2), prepare_s=tm.prepare_ns * 1e-9,
            sample_s=tm.decode_ns * 1e-9, shard_cpu_s=(t2 - t1) - self._execute_s,
        ))
        self._batch_id, self._batch_ids = out.batch_id, out.batch_request_ids
        return out

    def close_records(self) -> None:
        """Books the last step's router time (after the engine stopped)."""
        if self.engine is not None and self.records:
            self.records[-1].router_s = self.engine.step_cpu_s - self._router_seen

    async def filter(self, keep_ids: list[int]) -> None:
        if self._batch_id is None:
            return
        if keep_ids:
            ref = self.shard.engine.filter_batch(self._batch_id, keep_ids)
            self._batch_ids = list(ref.request_ids)
        else:
            self.shard.engine.clear_cache(self._batch_id)
            self._batch_id, self._batch_ids = None, []


@dataclass
class RunResult:
    outputs: list[list[int]]
    generated: int
    seconds: float  # first token of the first request to the last token of the last
    decode_steps: int  # engine steps after the prompts' prefill
    proposed: int
    accepted: int
    cpu_seconds: float = 0.0  # this process's CPU time over the whole run (all threads)
    records: list[StepRecord] = field(default_factory=list)  # every engine step, in order
    gc_seconds: float = 0.0  # time in the garbage collector during the run
    gc_full: int = 0  # full (generation 2) collections during the run

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0


class _GcTimer:
    """gc.callbacks entry: time spent in collections, and how many were full ones."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.full += info["generation"] == 2


async def _run(shard, prompts: list[list[int]], new_tokens: int, speculate: int,
               spec_max_batch: int, ignore_eos: bool, prefill_budget: int) -> RunResult:
    from service.engine.contracts import SamplingConfig, StoppingConfig, ValidatedRequest
    from service.engine.engine import EngineConfig, LocalEngine

    runner = shard.runner
    backend = InProcessShard(shard)
    shard.engine.clear_cache(None)
    # Every run starts with the collector in the same state, as the router's scheduler process
    # does after startup (service/app/engine_link.tune_gc: collect, then freeze what is left);
    # the collector's passes during the run are timed (a full pass can take ~100 ms here).
    gc.collect()
    gc.freeze()
    gc_time = _GcTimer()
    gc.callbacks.append(gc_time)
    cfg = EngineConfig(
        num_blocks=runner.num_blocks, block_size=runner.block_size,
        max_batch_prefill_tokens=prefill_budget, max_batch_size=max(len(prompts), 1),
        max_concurrent_requests=max(len(prompts), 1), waiting_served_ratio=0.0,
        speculate=speculate, speculate_max_batch_size=spec_max_batch,
        enable_prefix_cache=False,  # every configuration computes every prompt
    )
    engine = LocalEngine(cfg, backend)  # type: ignore[arg-type]
    backend.engine = engine
    await engine.start()
    cpu0 = time.process_time()
    times: list[list[float]] = [[] for _ in prompts]  # arrival of each token
    first_steps: list[int] = []

    async def one(i: int, ids: list[int]) -> list[int]:
        req = ValidatedRequest(f"b{i}", tuple(ids), SamplingConfig(),
                               StoppingConfig(new_tokens, ignore_eos_token=ignore_eos))
        out = []
        async for ev in engine.submit(req):
            if not out:
                first_steps.append(engine.stats().steps)
            times[i].append(time.perf_counter())
            out.append(ev.token.id)
        return out

    try:
        outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        cpu = time.process_time() - cpu0
        st = engine.stats()
    finally:
        await engine.stop()
        backend.close_records()
        backend.close()
        gc.callbacks.remove(gc_time)
    # Decode only: the tokens after the last request's first one (every prompt prefilled).
    start = max(t[0] for t in times)
    end = max(t[-1] for t in times)
    return RunResult(
        outputs=list(outputs), generated=sum(1 for ts in times for t in ts if t > start),
        seconds=end - start, decode_steps=st.steps - max(first_steps),
        proposed=st.spec_proposed_tokens, accepted=st.spec_accepted_tokens, cpu_seconds=cpu,
        records=backend.records, gc_seconds=gc_time.seconds, gc_full=gc_time.full,
    )


def _row(name: str, r: RunResult, base: RunResult | None) -> dict:
    return {
        "run": name,
        "decode_tokens": r.generated,
        "decode_steps": r.decode_steps,
        "tokens_per_forward": round(r.generated / max(r.decode_steps, 1), 3),
        "acceptance": round(r.accepted / r.proposed, 3) if r.proposed else None,
        "proposed": r.proposed,
        "accepted": r.accepted,
        "tok_s": round(r.tok_s, 2),
        "speedup": round(r.tok_s / base.tok_s, 3) if base and base.tok_s else None,
        "equal_to_reference": (r.outputs == base.outputs) if base else None,
        # Robust to other load on a shared machine: CPU time of the whole run (prefill too).
        "cpu_seconds": round(r.cpu_seconds, 2),
        "cpu_speedup": round(base.cpu_seconds / r.cpu_seconds, 3)
        if base and r.cpu_seconds else None,
        "gc_ms": round(r.gc_seconds * 1e3, 1),
        "gc_full": r.gc_full,
    }


def _table(rows: list[dict]) -> str:
    head = ("| run | decode tokens | forward passes | tokens / pass | acceptance | tok/s | speedup "
            "| CPU s (speedup) | GC ms (full) | equal |\n|---|---|---|---|---|---|---|---|---|---|\n")
    out = []
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} %"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        eq = "-" if r["equal_to_reference"] is None else ("yes" if r["equal_to_reference"] else "NO")
        cpu = f"{r['cpu_seconds']:.1f}"
        if r["cpu_speedup"] is not None:
            cpu += f" ({r['cpu_speedup']:.2f}x)"
        out.append(f"| {r['run']} | {r['decode_tokens']} | {r['decode_steps']} | "
                   f"{r['tokens_per_forward']:.2f} | {acc} | {r['tok_s']:.2f} | {sp} | {cpu} "
                   f"| {r.get('gc_ms', 0):.0f} ({r.get('gc_full', 0)}) | {eq} |")
    return head + "\n".join(out) + "\n"


def host_summary(records: list[StepRecord], above: int, thread_times: bool = False) -> dict:
    """Per-step host costs over the decode-only steps with more than `above` rows (the steps the
    adaptive rule leaves undrafted): medians in microseconds, and how the runner ran them. The
    shard's share is its thread time outside the forward pass (`thread_times`: a CPU with one
    torch thread) or its prepare + sampling wall time (a GPU, where the thread also waits)."""
    import statistics

    steps = [r for r in records if r.decoding_only and r.rows > above]
    if not steps:
        return {"steps": 0}

    def med(values) -> float:
        return round(statistics.median(values) * 1e6, 1)

    paths: dict[str, int] = {}
    for r in steps:
        paths[r.path] = paths.get(r.path, 0) + 1
    return {
        "steps": len(steps),
        "drafted_steps": sum(1 for r in steps if r.drafted),
        "decode_shaped_steps": sum(1 for r in steps if r.decode_shaped),
        "paths": paths,
        "router_us": med([r.router_s for r in steps]),
        "convert_us": med([r.convert_s for r in steps]),
        "prepare_us": med([r.prepare_s for r in steps]),
        "sample_us": med([r.sample_s for r in steps]),
        "shard_cpu_us": med([r.shard_cpu_s for r in steps]),
        "host_us": med([r.router_s + r.convert_s + (
            r.shard_cpu_s if thread_times else r.prepare_s + r.sample_s) for r in steps]),
    }


def _host_table(rows: list[dict]) -> str:
    out = [("| run | steps | drafted steps | runner path | router µs | proto µs "
            "| shard prepare µs | shard sample µs | shard thread µs | host µs / step |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["host"]
        if not h["steps"]:
            out.append(f"| {r['run']} | 0 | - | - | - | - | - | - | - | - |")
            continue
        paths = ", ".join(f"{k or '?'} {v}" for k, v in sorted(h["paths"].items()))
        out.append(f"| {r['run']} | {h['steps']} | {h['drafted_steps']} | {paths} | "
                   f"{h['router_us']:.0f} | {h['convert_us']:.0f} | {h['prepare_us']:.0f} | "
                   f"{h['sample_us']:.0f} | {h['shard_cpu_us']:.0f} | {h['host_us']:.0f} |")
    return "\n".join(out) + "\n"


# ---- host ------------------------------------------------------------------------------------
async def _call_counts(shard, prompts: list[list[int]], new_tokens: int, speculate: int,
                       spec_max_batch: int, budget: int) -> tuple[dict[str, int], int]:
    """Calls of every Python function during one run under cProfile (both sides of the
    protocol, the engine, the scheduler), and the run's engine steps."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        r = await _run(shard, prompts, new_tokens, speculate, spec_max_batch, True, budget)
    finally:
        prof.disable()
    counts: dict[str, int] = {}
    for entry in prof.getstats():
        code = entry.code
        name = code if isinstance(code, str) else (
            f"{Path(code.co_filename).name}:{code.co_firstlineno} {code.co_name}")
        counts[name] = counts.get(name, 0) + entry.callcount
    return counts, len(r.records)


def _count_diff(a: tuple[dict[str, int], int], b: tuple[dict[str, int], int]) -> dict:
    """Functions called a different number of times in run b than in run a (excluding the
    benchmark's own and the profiler's bookkeeping)."""
    (ca, steps_a), (cb, steps_b) = a, b
    skip = ("speculate.py", "cProfile", "_lsprof")
    diff = {k: [ca.get(k, 0), cb.get(k, 0)] for k in sorted(set(ca) | set(cb))
            if ca.get(k, 0) != cb.get(k, 0) and not any(x in k for x in skip)}
    return {"steps": [steps_a, steps_b], "functions": len(set(ca) | set(cb)),
            "calls": [sum(ca.values()), sum(cb.values())], "differing": diff}


def _calls_md(calls: dict, configs: list) -> str:
    head = (f"Function calls over one whole run under cProfile ({configs[0][0]} / "
            f"{configs[1][0]}): {calls['calls'][0]} / {calls['calls'][1]} calls of "
            f"{calls['functions']} functions in {calls['steps'][0]} / {calls['steps'][1]} engine "
            "steps. Functions called a different number of times (all calls of the run, "
            "admission and finish included):\n")
    out = [head, "| function | calls (off) | calls (adaptive) |", "|---|---|---|"]
    out += [f"| `{k}` | {a} | {b} |" for k, (a, b) in calls["differing"].items()]
    return "\n".join(out) + "\n"




def run_host(args) -> dict:
    """Per-step host cost at batch `--batch` with speculation off against `--speculate` with the
    adaptive rule off at this batch (`--speculate-max-batch-size` below it): a tiny model on this
    CPU, one torch thread, the configurations interleaved `--reps` times. The medians are over
    the decode-only steps with more running requests than the rule's limit."""
    import random
    import statistics

    import torch

    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    torch.set_num_threads(1)
    model_dir = make_tiny_model(args.workdir / "tiny-llama", TinyModelSpec("llama"))
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="float32", device="cpu",
                              kv_cache_memory_mb=64), Dist())
    total = args.prompt_tokens + args.new_tokens
    shard.warmup(WarmupSpec(args.prompt_tokens, total, args.batch * args.prompt_tokens,
                            args.batch, speculate_tokens=args.speculate,
                            speculate_max_batch_size=args.spec_max_batch))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_tokens)]
               for _ in range(args.batch)]
    budget = args.batch * args.prompt_tokens  # every prompt in the first step
    adaptive = f"--speculate {args.speculate} --speculate-max-batch-size {args.spec_max_batch}"
    configs = [("--speculate 0", 0), (adaptive, args.speculate)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    loop = asyncio.new_event_loop()
    try:
        for rep in range(args.reps):
            order = configs if rep % 2 == 0 else configs[::-1]  # ABBA: drift cancels
            for name, k in order:
                r = loop.run_until_complete(_run(shard, prompts, args.new_tokens, k,
                                                 args.spec_max_batch, True, budget))
                runs[name].append(host_summary(r.records, args.spec_max_batch, True) | {
                    "outputs": r.outputs, "gc_ms": r.gc_seconds * 1e3})
        # The same runs once more under cProfile: which functions each configuration calls,
        # and how often. Deterministic, unlike the timings on a shared machine.
        counts = [loop.run_until_complete(_call_counts(
            shard, prompts, args.new_tokens, k, args.spec_max_batch, budget)) for _, k in configs]
    finally:
        loop.close()
    calls = _count_diff(counts[0], counts[1])
    ref = runs[configs[0][0]][0]["outputs"]
    rows = []
    for name, _ in configs:
        reps = runs[name]
        keys = ("router_us", "convert_us", "prepare_us", "sample_us", "shard_cpu_us", "host_us")
        host = dict(reps[0], **{k: round(statistics.median(x[k] for x in reps), 1)
                                for k in keys})
        host.pop("outputs")
        host.pop("gc_ms")
        rows.append({"run": name, "host": host,
                     "host_us_per_rep": [x["host_us"] for x in reps],
                     "gc_ms_per_rep": [round(x["gc_ms"], 1) for x in reps],
                     "equal_to_reference": all(x["outputs"] == ref for x in reps)})
    base, spec = rows[0]["host"]["host_us"], rows[1]["host"]["host_us"]
    res = {"part": "host", "model": "tiny llama (vocab 500), float32, one thread",
           "batch": args.batch, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "reps": args.reps, "rows": rows,
           "ratio": round(spec / base, 3), "load_average": list(os.getloadavg()),
           "calls": calls}
    md = (f"## Host cost per decode step at batch {args.batch}: speculation off vs adaptive rule "
          f"off at this batch\n\nTiny llama on this CPU (one torch thread), {args.batch} requests "
          f"of {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, {args.reps} "
          f"interleaved repetitions (ABBA); medians over the decode-only steps with more than "
          f"{args.spec_max_batch} requests (µs per step; thread times except the shard's "
          f"prepare and sample columns, which are wall time; host = router + proto + shard "
          f"thread, the shard's thread time outside the forward pass):\n\n" + _host_table(rows) +
          "\nPer repetition (host µs / step): " + "; ".join(
              f"{r['run']}: {r['host_us_per_rep']}" for r in rows) +
          "\n\nTime in the garbage collector per repetition (ms): " + "; ".join(
              f"{r['run']}: {r['gc_ms_per_rep']}" for r in rows) +
          f"\n\nAdaptive / off: {res['ratio']:.3f}. Outputs equal: "
          f"{all(r['equal_to_reference'] for r in rows)}.\n\n" + _calls_md(calls, configs))
    _write(args.out, "speculate_host", res, md)
    return res


# ---- cpu -------------------------------------------------------------------------------------


def _cpu_step_costs(shard, context: int, max_k: int, reps: int = 3, iters: int = 5) -> list[dict]:
    """CPU time of one batch-1 step computing 1 + k tokens at `context`, on ONE thread and
    measured with thread_time (min over interleaved repetitions): the verify step's cost
    relative to a decode step, robust to other processes on a shared machine (wall-clock
    tokens/s is not)."""
    import torch

    from shard.runner.model_runner import StepInputs

    runner = shard.runner
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    table = list(range(math.ceil((context + max_k + 1) / runner.block_size)))
    vocab = runner.model.vocab_size
    ks = [0, 1, 2, 4, max_k] if max_k > 4 else list(range(max_k + 1))
    times: dict[int, list[float]] = {k: [] for k in ks}
    try:
        for _ in range(reps):
            for k in ks:
                q = k + 1
                step = StepInputs([(7 * j + 3) % vocab for j in range(q)],
                                  list(range(context - 1, context - 1 + q)), [q],
                                  [context - 1 + q], [table], list(range(q)))
                runner.execute(step)
                t = time.thread_time()
                for _ in range(iters):
                    runner.execute(step)
                times[k].append((time.thread_time() - t) / iters * 1e3)
    finally:
        torch.set_num_threads(threads)
    base = min(times[0])
    return [{"k": k, "tokens": k + 1, "cpu_ms": round(min(v), 2),
             "vs_decode": round(min(v) / base, 3)} for k, v in times.items()]


def run_cpu(args) -> dict:
    import torch

    from service.app.launcher import cache_dir, ensure_local_model
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    torch.set_num_threads(args.threads)
    _, model_dir = ensure_local_model(None, None, cache_dir())
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="float32", device="cpu",
                              kv_cache_memory_mb=256), Dist())
    shard.warmup(WarmupSpec(512, 512 + args.new_tokens, 512, 8, speculate_tokens=args.speculate,
                            speculate_max_batch_size=8))
    parts = set(args.parts.split(","))
    tasks = GROUNDED_TASKS[: args.tasks] if "tasks" in parts else []
    prompts = [chat_prompt_ids(model_dir, t) for t in tasks]
    rows: list[dict] = []
    per_task = []
    res = {"part": "cpu", "model": "SmolLM2-135M-Instruct float32", "threads": args.threads,
           "new_tokens": args.new_tokens, "speculate": args.speculate, "rows": rows,
           "prompt_tokens": [len(p) for p in prompts],
           "machine": platform.processor() or platform.machine(),
           "load_average_at_start": list(os.getloadavg())}
    if "costs" in parts:
        res["step_costs"] = _cpu_step_costs(shard, 200, args.speculate * 2)

    def save() -> None:  # after every row: a long run killed midway keeps what it measured
        md = ""
        if "step_costs" in res:
            md += ("## CPU: one batch-1 step of 1 + k tokens at context 200 (SmolLM2, float32, "
                   "one thread, CPU ms per step)\n\n| draft tokens k | CPU ms | vs decode |\n"
                   "|---|---|---|\n" + "".join(
                       f"| {r['k']} | {r['cpu_ms']:.1f} | {r['vs_decode']:.2f}x |\n"
                       for r in res["step_costs"]) + "\n")
        if rows:
            md += (f"## CPU: SmolLM2-135M-Instruct, float32, {args.threads} thread(s), greedy, "
                   f"up to {args.new_tokens} new tokens (EOS ends earlier)\n\n" + _table(rows))
        _write(args.out, "speculate_cpu", res, md, quiet=True)

    loop = asyncio.new_event_loop()
    try:
        for i, p in enumerate(prompts):  # batch 1, one task at a time
            base = loop.run_until_complete(
                _run(shard, [p], args.new_tokens, 0, 1, False, 512))
            spec = loop.run_until_complete(
                _run(shard, [p], args.new_tokens, args.speculate, 1, False, 512))
            per_task.append((base, spec))
            rows.append(_row(f"task {i + 1}, batch 1, --speculate 0", base, None))
            rows.append(_row(f"task {i + 1}, batch 1, --speculate {args.speculate}", spec, base))
            save()
        if per_task:
            tot = _sum([b for b, _ in per_task]), _sum([s for _, s in per_task])
            rows.append(_row("all tasks, batch 1, --speculate 0", tot[0], None))
            rows.append(_row(f"all tasks, batch 1, --speculate {args.speculate}", tot[1],
                             tot[0]))
        save()
        if "batch" in parts:
            base = loop.run_until_complete(
                _run(shard, prompts, args.new_tokens, 0, 8, False, 512))
            rows.append(_row(f"all {len(prompts)} at once, --speculate 0", base, None))
            save()
            for cap in (1, 8):
                spec = loop.run_until_complete(
                    _run(shard, prompts, args.new_tokens, args.speculate, cap, False, 512))
                rows.append(_row(f"all {len(prompts)} at once, --speculate {args.speculate} "
                                 f"--speculate-max-batch-size {cap}", spec, base))
                save()
    finally:
        loop.close()
    res["load_average_at_end"] = list(os.getloadavg())
    save()
    print((args.out / "speculate_cpu.md").read_text())
    return res


def _sum(runs: list[RunResult]) -> RunResult:
    return RunResult(
        outputs=[o for r in runs for o in r.outputs], generated=sum(r.generated for r in runs),
        seconds=sum(r.seconds for r in runs), decode_steps=sum(r.decode_steps for r in runs),
        proposed=sum(r.proposed for r in runs), accepted=sum(r.accepted for r in runs),
        cpu_seconds=sum(r.cpu_seconds for r in runs),
        records=[x for r in runs for x in r.records],
        gc_seconds=sum(r.gc_seconds for r in runs), gc_full=sum(r.gc_full for r in runs),
    )


# ---- gpu -------------------------------------------------------------------------------------


def _verify_step_times(shard, context: int, max_k: int, vocab: int) -> list[dict]:
    """ms of one step at batch 1: plain decode (k = 0) and verify steps of 1 + k tokens, as
    CUDA graph replays when captured (else eager wall time, e.g. on a CPU check)."""
    import torch

    from benchmarks.harness.timing import cuda_time_ms
    from shard.runner.model_runner import StepInputs

    runner = shard.runner
    bs = runner.block_size
    table = list(range(math.ceil((context + max_k + 1) / bs)))
    out = []
    cuda = runner.device.type == "cuda"
    for k in range(max_k + 1):
        q = k + 1
        step = StepInputs(
            token_ids=[(7 * j + 3) % vocab for j in range(q)],
            positions=list(range(context - 1, context - 1 + q)),
            query_lens=[q], seq_lens=[context - 1 + q], block_tables=[table],
            logits_indices=list(range(q)),
        )
        d = runner.prepare(step)  # eager reference (the same K/V lands in the same slots)
        eager = runner.forward(d.input_ids, d.positions, d.meta, d.logits_indices).float()
        got = runner.execute(step).float()  # stages the graph's inputs when captured
        diff = float((got - eager).abs().max())
        same_argmax = got.argmax(-1).tolist() == eager.argmax(-1).tolist()
        graph = None
        if k == 0 and runner.graphs is not None:
            graph = runner.graphs.graphs[1]
        elif k > 0 and q in runner.verify_graphs:
            graph = runner.verify_graphs[q].graphs[1]
        if graph is not None:
            ms = cuda_time_ms(graph.replay, iters=30)
            how = "graph"
        elif cuda:
            ms = cuda_time_ms(lambda s=step: runner.execute(s), iters=20)
            how = "eager"
        else:
            t = time.perf_counter()
            for _ in range(5):
                runner.execute(step)
            ms = (time.perf_counter() - t) / 5 * 1e3
            how = "eager"
        out.append({"k": k, "tokens": q, "ms": round(ms, 4), "how": how,
                    "max_abs_diff_vs_eager": diff, "argmax_equal_eager": same_argmax})
        if cuda:
            torch.cuda.synchronize()
    base = out[0]["ms"]
    for r in out:
        r["vs_decode"] = round(r["ms"] / base, 3)
    return out


def _break_even_acceptance(ratio: float, k: int) -> float | None:
    """Per-draft acceptance a at which a verify step of k drafts, costing `ratio` decode steps,
    yields as many tokens per second: (1 - a^(k+1)) / (1 - a) = ratio (bisection)."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= k + 1:
        return None  # never pays
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < ratio:
            lo = a
        else:
            hi = a
    return round(hi, 3)


def _batch_sweep(shard, context: int, k: int, batches: list[int], vocab: int) -> list[dict]:
    """Decode step vs verify step of k drafts per request, by batch size (CUDA graph replays):
    where verifying stops paying, which sets --speculate-max-batch-size's default."""
    from benchmarks.harness.timing import cuda_time_ms
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    runner = shard.runner
    if runner.graphs is None:
        return []
    bs = runner.block_size
    per = math.ceil((context + k + 1) / bs)
    q = k + 1
    graphs = CudaGraphDecodeRunner(runner.forward, runner.device, bs, max(batches),
                                   per + 1, buckets=sorted(batches), query_len=q)
    graphs.capture(pool=runner.graphs.pool)
    out = []
    for b in batches:
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        runner.graphs.run([(5 * i + 1) % vocab for i in range(b)], [context - 1] * b,
                          [context] * b, tables)
        dec = cuda_time_ms(runner.graphs.graphs[runner.graphs.bucket(b)].replay, iters=20)
        graphs.run_ragged([(3 * j + 1) % vocab for j in range(b * q)],
                          [context - 1 + (j % q) for j in range(b * q)], [q] * b,
                          [context - 1 + q] * b, tables)
        ver = cuda_time_ms(graphs.graphs[b].replay, iters=20)
        ratio = ver / dec
        out.append({"batch": b, "decode_ms": round(dec, 3), f"verify_k{k}_ms": round(ver, 3),
                    "ratio": round(ratio, 3),
                    "break_even_acceptance": _break_even_acceptance(ratio, k)})
    del graphs
    return out


def _random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (ids 10..vocab-1): a random model's greedy continuation of such a prompt
    does not repeat within a few hundred tokens (measured: acceptance ~0)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _constant_prompts(n: int, length: int, vocab: int, seed: int = 2) -> list[list[int]]:
    """Prompts of one random token repeated: with every context position the same, a random
    model's attention averages the same values whatever the query, the context term dominates
    its residual stream (the embeddings are tiny against the layers' outputs), and its greedy
    output settles into a short loop of its own (not a copy of the prompt's token): the
    high-acceptance workload. Measured on a CPU with 2 and 4 layers of this init: one token
    repeated (period 1) from the first generated token on."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab)] * length for _ in range(n)]


def _runs(tokens: list[int]) -> list[list[int]]:
    """`tokens` as [token, run length] pairs (a random model's loops are mostly runs of one)."""
    out: list[list[int]] = []
    for t in tokens:
        if out and out[-1][0] == t:
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return out


def _period(tokens: list[int], max_period: int = 64) -> tuple[int | None, int | None]:
    """(start, period): the earliest position from which `tokens` repeats with a period
    <= max_period to its end (covering at least two periods), the shortest such period;
    (None, None) if it never does."""
    best: tuple[int, int] | None = None
    n = len(tokens)
    for p in range(1, max_period + 1):
        bad = [j for j in range(p, n) if tokens[j] != tokens[j - p]]
        start = bad[-1] - p + 1 if bad else 0
        if n - start >= 2 * p and (best is None or start < best[0]):
            best = (start, p)
    return best if best is not None else (None, None)


def _row0_diffs(shard, prefix: list[int], k: int) -> dict:
    """Why greedy outputs can differ with speculation on a GPU: the logits of the token after
    `prefix` (its K/V but the last token's written first, by a prefill) computed (a) by a
    batch-1 decode step, twice (run-to-run determinism), (b) as its row of a batch-2 decode
    step (plain decoding at another batch size; the other row has the same context in other
    blocks), (c) as row 0 of a verify step of 1 + k tokens (what a speculative step emits when
    it rejects the first draft; the drafts do not reach row 0), each through the path the
    server takes (graph replays when captured). Also the top-2 margin of (a): how near the
    greedy choice is to a tie."""
    from shard.runner.model_runner import StepInputs

    runner = shard.runner
    context = len(prefix)
    per = math.ceil((context + k + 1) / runner.block_size)
    ta, tb = list(range(per)), list(range(per, 2 * per))
    n = context - 1  # prefilled tokens; the step computes token n (the last of the prefix)
    for table in (ta, tb):
        runner.execute(StepInputs(prefix[:n], list(range(n)), [n], [n], [table], [n - 1]))
    last = prefix[-1]
    drafts = [(7 * j + 3) % runner.model.vocab_size for j in range(k)]

    def run(step: StepInputs, row: int):
        out = runner.execute(step)[row].float().clone()
        return out, runner.last_path

    dec = StepInputs([last], [n], [1], [context], [ta], [0])
    a, pa = run(dec, 0)
    a2, _ = run(dec, 0)
    b, pb = run(StepInputs([last, last], [n, n], [1, 1], [context, context], [ta, tb],
                           [0, 1]), 0)
    c, pc = run(StepInputs([last, *drafts], list(range(n, n + k + 1)), [k + 1], [context + k],
                           [ta], list(range(k + 1))), 0)
    top2 = a.topk(2).values

    def cmp(x, name: str, path: str) -> dict:
        return {"compare": name, "path": path, "max_abs_diff": float((x - a).abs().max()),
                "rows_differing": int((x != a).sum()), "argmax_equal": bool(x.argmax() == a.argmax())}

    return {
        "context": context, "decode_path": pa, "top2_margin": float(top2[0] - top2[1]),
        "logit_std": float(a.std()),
        "rows": [cmp(a2, "batch-1 decode, again", pa),
                 cmp(b, "its row of a batch-2 decode step", pb),
                 cmp(c, f"row 0 of a verify step with {k} drafts", pc)],
    }


def _trained_tiny_equality(args, device: str) -> dict:
    """Greedy equality with and without speculation where outputs have no near-ties: the tiny
    llama trained on the progression task (shard/tools/tiny_training.py; top-2 margins > 1
    logit), on this device in the 8B part's dtype, CUDA graphs for decode and verify steps. Its
    outputs are periodic (period 32 / gcd(stride, 32)), so drafts are accepted once the output
    meets the prompt's terms again."""
    import torch

    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
    from shard.tools.tiny_training import RECOMMENDED_STEPS, TASK, task_prompt

    model_dir = make_tiny_model(args.workdir / "tiny-llama-trained",
                                TinyModelSpec("llama", train_steps=RECOMMENDED_STEPS))
    cuda = device == "cuda"
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if cuda else "float32",
                              device=device, kv_cache_memory_mb=64,
                              max_batch_total_tokens=8192), Dist())  # CUDA: not 90 % of the GPU
    shard.warmup(WarmupSpec(32, 96, 128, 8, speculate_tokens=4, speculate_max_batch_size=8))
    prompts = [task_prompt(9, TASK.strides[i % len(TASK.strides)], (5 * i + 1) % TASK.modulus)
               for i in range(8)]
    loop = asyncio.new_event_loop()
    rows = []
    try:
        for batch in (1, 8):
            groups = [[p] for p in prompts] if batch == 1 else [prompts]
            base = _sum([loop.run_until_complete(_run(shard, g, 64, 0, 8, True, 128))
                         for g in groups])
            spec = _sum([loop.run_until_complete(_run(shard, g, 64, 4, 8, True, 128))
                         for g in groups])
            rows.append(_row(f"trained tiny llama, batch {batch}, --speculate 0", base, None))
            rows.append(_row(f"trained tiny llama, batch {batch}, --speculate 4", spec, base))
    finally:
        loop.close()
    diag = _row0_diffs(shard, task_prompt(40, 3, 5), 4)  # in distribution: a clear choice
    del shard
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"rows": rows, "row0": diag}


def _batch_ab(shard, args, vocab: int, budget: int) -> list[dict]:
    """Batch `--batch`: --speculate 0 against the adaptive rule (no drafts above
    --speculate-max-batch-size), interleaved A B B A so that drift (clocks, temperature) cancels,
    then drafts forced at every batch size once. Each row carries the per-step host costs of
    its undrafted steps (host_summary) and how the runner ran them."""
    pb = _random_prompts(args.batch, min(512, args.context), vocab, seed=1)
    loop = asyncio.new_event_loop()
    adaptive = (f"--speculate 4 (adaptive: --speculate-max-batch-size {args.spec_max_batch})", 4,
                args.spec_max_batch)
    off = ("--speculate 0", 0, args.spec_max_batch)
    rows: list[dict] = []
    try:
        runs: dict[str, list[RunResult]] = {off[0]: [], adaptive[0]: []}
        for name, k, cap in (off, adaptive, adaptive, off):
            runs[name].append(loop.run_until_complete(
                _run(shard, pb, args.batch_tokens, k, cap, True, budget)))
        forced = loop.run_until_complete(
            _run(shard, pb, args.batch_tokens, 4, args.batch, True, budget))
    finally:
        loop.close()
    base = runs[off[0]]
    ref = _sum(base)
    for name in (off[0], adaptive[0]):
        for i, r in enumerate(runs[name]):
            row = _row(f"batch {args.batch}, {name}, run {i + 1}", r, None if name == off[0]
                       else base[i])
            row["host"] = host_summary(r.records, args.spec_max_batch)
            rows.append(row)
    both = _row(f"batch {args.batch}, {adaptive[0]}, both runs", _sum(runs[adaptive[0]]), ref)
    both["host"] = host_summary([x for r in runs[adaptive[0]] for x in r.records],
                                args.spec_max_batch)
    rows.append(both)
    row = _row(f"batch {args.batch}, --speculate 4 forced (--speculate-max-batch-size "
               f"{args.batch})", forced, base[0])
    row["host"] = host_summary(forced.records, args.spec_max_batch)
    rows.append(row)
    return rows


def run_gpu(args) -> dict:
    import torch

    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    t0 = time.perf_counter()
    cuda = args.device == "cuda"
    res: dict = {"part": "gpu", "device": torch.cuda.get_device_name() if cuda else "cpu"}
    try:  # first, while the device is empty (the 8B shard takes what memory is left)
        res["trained_tiny"] = _trained_tiny_equality(args, args.device)
    except Exception as exc:  # noqa: BLE001 - reported in the output; the 8B figures come next
        res["trained_tiny"] = {"error": f"{type(exc).__name__}: {exc}"}
    _partial(args.out, res)
    t_tiny = time.perf_counter()
    if args.tiny:
        from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

        model_dir = make_tiny_model(args.workdir / "tiny-llama", TinyModelSpec("llama"))
        vocab = 500
    else:
        from shard.testing.checkpoint import BOS_ID, write_checkpoint

        model_dir = args.workdir / f"llama3-8b-shape-{args.num_layers}l"
        write_checkpoint(model_dir, args.num_layers)
        vocab = BOS_ID
    written = time.perf_counter() - t_tiny
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if cuda else "float32",
                              device=args.device, kv_cache_memory_mb=None if cuda else 64),
                  Dist())
    max_k = args.max_k
    longest = max([args.context, *args.loop_contexts])
    # (The engine's prefill budget stays context + 64 below: longer prompts are chunked.)
    shard.warmup(WarmupSpec(longest + 64, longest + 512, longest + 64,
                            args.batch, speculate_tokens=max_k,
                            speculate_max_batch_size=args.spec_max_batch))
    loaded = time.perf_counter() - t_tiny - written
    res.update({"model": "tiny llama" if args.tiny else f"Llama-3-8B shape, {args.num_layers} "
                "layers, random bf16", "trained_tiny_s": round(t_tiny - t0, 1),
                "checkpoint_s": round(written, 1), "load_warmup_s": round(loaded, 1)})
    res["verify_steps"] = _verify_step_times(shard, args.context, max_k, vocab)
    res["batch_sweep"] = _batch_sweep(shard, args.context, 4, [1, 4, 8, 16, 32, 64], vocab)
    res["row0"] = _row0_diffs(shard, _random_prompts(1, args.context, vocab, seed=3)[0], 4)
    _partial(args.out, res)
    prefill = args.context + 64
    loop = asyncio.new_event_loop()
    rows: list[dict] = []
    loop_rows: list[dict] = []
    try:
        # Batch 1, random prompts of `context` tokens: the output does not repeat (honest zero).
        p1 = _random_prompts(args.b1_requests, args.context, vocab)
        base1 = _sum([loop.run_until_complete(
            _run(shard, [p], args.new_tokens, 0, args.spec_max_batch, True, prefill)) for p in p1])
        rows.append(_row("batch 1, random prompts, --speculate 0", base1, None))
        for k in sorted({4, max_k}):
            r = _sum([loop.run_until_complete(
                _run(shard, [p], args.new_tokens, k, args.spec_max_batch, True, prefill))
                for p in p1])
            rows.append(_row(f"batch 1, random prompts, --speculate {k}", r, base1))
        res["rows"] = rows
        _partial(args.out, res)
        # Batch 64 before the looping rows: the second target comes first.
        res["batch_rows"] = _batch_ab(shard, args, vocab, prefill)
        _partial(args.out, res)
        # Batch 1, one token repeated: the model's own greedy output loops (high acceptance);
        # the longer the prompt, the longer the loops last (the generated tokens shift the
        # context average less), hence several context lengths, longest last.
        res["loop_outputs"] = []
        for ctx in args.loop_contexts:
            pl = _constant_prompts(args.b1_requests, ctx, vocab)
            runs = {}
            for k in sorted({0, 4, max_k}):
                runs[k] = [loop.run_until_complete(
                    _run(shard, [p], args.new_tokens, k, args.spec_max_batch, True, prefill))
                    for p in pl]
                loop_rows.append(_row(f"batch 1, looping output, context {ctx}, --speculate {k}",
                                      _sum(runs[k]), _sum(runs[0]) if k else None))
            for o in (o for r in runs[0] for o in r.outputs):
                start, period = _period(o)
                res["loop_outputs"].append({
                    "context": ctx, "loop_from": start, "period": period,
                    "distinct": len(set(o)), "runs": len(_runs(o)), "first": o[:8]})
            res["loop_rows"] = loop_rows
            _partial(args.out, res)
    finally:
        loop.close()
    res["rows"] = rows
    res["loop_rows"] = loop_rows
    res["total_s"] = round(time.perf_counter() - t0, 1)
    _write(args.out, "speculate_gpu", res, _gpu_md(res, args))
    return res


def _gpu_md(res: dict, args) -> str:
    vs = res["verify_steps"]
    md = [f"## GPU: {res['model']} on {res['device']}, context {args.context}\n"]
    # The headline: batch-1 tokens/s with and without speculation, with the acceptance.
    md += [(f"Batch 1, tokens/s (greedy, {args.b1_requests} requests one at a time, "
            f"{args.new_tokens} new tokens each):\n"),
           "| workload | --speculate | tok/s | speedup | acceptance | tokens / pass | equal |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"] + res["loop_rows"]:
        work = (f"looping output, context {r['run'].split('context ')[1].split(',')[0]}"
                if "looping" in r["run"] else f"random prompts, context {args.context}")
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} %"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        eq = "-" if r["equal_to_reference"] is None else ("yes" if r["equal_to_reference"] else "NO")
        md.append(f"| {work} | {r['run'].rsplit(' ', 1)[-1]} | {r['tok_s']:.1f} | {sp} | {acc} "
                  f"| {r['tokens_per_forward']:.2f} | {eq} |")
    loops = "; ".join(
        f"context {o['context']}: {o['distinct']} distinct tokens in {o['runs']} runs"
        + (f", periodic from token {o['loop_from']} (period {o['period']})"
           if o["period"] else "") for o in res.get("loop_outputs", []))
    md += ["", ("Looping workload: each prompt is one random token repeated (context tokens); "
                f"the reference outputs (--speculate 0): {loops}."), ""]
    # Batch 64: adaptive rule against no speculation.
    br = res["batch_rows"]
    both = next(r for r in br if "both runs" in r["run"])
    md += [(f"Batch {args.batch} (greedy, {args.batch_tokens} new tokens each): adaptive rule / "
            f"no speculation = **{both['speedup']:.3f}x** tokens/s (runs interleaved A B B A; "
            "target: within 3 %).\n"), _table(br),
           (f"Per-step host costs of the steps with more than {args.spec_max_batch} requests "
            "(medians, µs; the runner's path for each step):\n"), _host_table(br)]
    md += ["Verify step (batch 1, CUDA graph replay) against the plain decode step:\n",
           ("| draft tokens k | tokens computed | ms | vs decode | logits vs eager (max abs diff, "
            "argmax equal) |"), "|---|---|---|---|---|"]
    md += [f"| {r['k']} | {r['tokens']} | {r['ms']:.3f} ({r['how']}) | {r['vs_decode']:.2f}x "
           f"| {r['max_abs_diff_vs_eager']:.2g}, {r['argmax_equal_eager']} |" for r in vs]
    if res["batch_sweep"]:
        md += ["", ("Verify step of 4 drafts per request against the decode step, by batch size "
                    "(graph replays; break-even: the per-draft acceptance at which speculation "
                    "gives the same tokens/s):\n"),
               "| batch | decode ms | verify (k=4) ms | ratio | break-even acceptance |",
               "|---|---|---|---|---|"]
        md += [f"| {r['batch']} | {r['decode_ms']:.3f} | {r['verify_k4_ms']:.3f} | "
               f"{r['ratio']:.2f}x | {r['break_even_acceptance']} |" for r in res["batch_sweep"]]
    md += ["", ("Greedy equality: one request's next-token logits computed four ways, against a "
                "batch-1 decode step (paths as taken):\n")]
    tt = res["trained_tiny"]
    for name, d in ((f"{res['model']}, a random prompt", res["row0"]),
                    ("trained tiny llama, a task prompt", tt.get("row0"))):
        if not d:
            continue
        md += [(f"{name} of {d['context']} tokens (top-2 margin of the decode logits "
                f"{d['top2_margin']:.3g}, logits std {d['logit_std']:.3g}):\n"),
               "| computed as | path | max abs diff | logits differing | argmax equal |",
               "|---|---|---|---|---|"]
        md += [f"| {r['compare']} | {r['path']} | {r['max_abs_diff']:.3g} | "
               f"{r['rows_differing']} | {r['argmax_equal']} |" for r in d["rows"]]
        md.append("")
    if "error" in tt:
        md.append(f"Trained tiny llama part failed: {tt['error']}\n")
    else:
        md += [("Trained tiny llama (progression task, no near-ties), 8 prompts, 64 new tokens, "
                "greedy, with and without speculation:\n"), _table(tt["rows"])]
    md.append(f"Trained tiny part {res['trained_tiny_s']} s, checkpoint {res['checkpoint_s']} s, "
              f"load + warmup {res['load_warmup_s']} s, total {res['total_s']} s.")
    return "\n".join(md) + "\n"


def _partial(out: Path, res: dict) -> None:
    """What the GPU part has measured so far (a run stopped by a time limit keeps it)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculate_gpu_partial.json").write_text(json.dumps(res, indent=1))


def _write(out: Path, name: str, res: dict, md: str, quiet: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(md)
    if not quiet:
        print(md)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    cpu = sub.add_parser("cpu", help="SmolLM2 on this CPU")
    cpu.add_argument("--out", type=Path, default=Path("benchmarks/raw"))
    cpu.add_argument("--speculate", type=int, default=4)
    cpu.add_argument("--new-tokens", type=int, default=96)
    cpu.add_argument("--threads", type=int, default=2)
    cpu.add_argument("--tasks", type=int, default=len(GROUNDED_TASKS), help="first N tasks")
    cpu.add_argument("--parts", default="costs,tasks,batch",
                     help="costs (step CPU cost by k), tasks (batch 1), batch (all at once)")
    host = sub.add_parser("host", help="per-step host cost: off vs adaptive-off (tiny, CPU)")
    host.add_argument("--out", type=Path, default=Path("benchmarks/raw"))
    host.add_argument("--workdir", type=Path, default=Path("/tmp/twb"))
    host.add_argument("--speculate", type=int, default=4)
    host.add_argument("--spec-max-batch", type=int, default=16)
    host.add_argument("--batch", type=int, default=64)
    host.add_argument("--prompt-tokens", type=int, default=32)
    host.add_argument("--new-tokens", type=int, default=128)
    host.add_argument("--reps", type=int, default=8)
    gpu = sub.add_parser("gpu", help="8B shape, random weights, one GPU")
    gpu.add_argument("--out", type=Path, default=Path("benchmarks/raw"))
    gpu.add_argument("--workdir", type=Path, default=Path("/tmp/twb"))
    gpu.add_argument("--device", default="cuda")
    gpu.add_argument("--tiny", action="store_true", help="a tiny random llama (CPU check)")
    gpu.add_argument("--num-layers", type=int, default=32)
    gpu.add_argument("--context", type=int, default=1024)
    gpu.add_argument("--max-k", type=int, default=8)
    gpu.add_argument("--new-tokens", type=int, default=256)
    gpu.add_argument("--loop-contexts", type=lambda v: [int(x) for x in v.split(",")],
                     default=[1024, 4096, 7168], help="prompt lengths of the looping workload")
    gpu.add_argument("--b1-requests", type=int, default=4)
    gpu.add_argument("--batch", type=int, default=64)
    gpu.add_argument("--batch-tokens", type=int, default=128)
    gpu.add_argument("--spec-max-batch", type=int, default=16,
                     help="--speculate-max-batch-size of the adaptive runs")
    args = parser.parse_args(argv)
    if args.part == "cpu":
        run_cpu(args)
    elif args.part == "host":
        run_host(args)
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
