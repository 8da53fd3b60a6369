"""vLLM side by side (issue 44 item 3): the harness's exact checkpoint, tokenizer and 1,000-request
workload through a given vLLM install, offline (`LLM.generate`, engine bound) and served
(`/v1/completions`, SSE), so every GPU run can put vLLM's row under tokenwire's.

vLLM runs in its own interpreter (`--vllm-python`, e.g. the venv benchmarks/run_vllm_device.sh
builds): its pydantic/fastapi/openai set must not meet tokenwire's. This module only starts
processes, speaks HTTP and counts; nothing here imports vLLM (benchmarks/harness/vllm_offline.py
does, inside vLLM's interpreter).

Same requests as tokenwire's e2e part: `sharegpt_like(n)` lengths, `prompt_text(idx, n_in)`
prompts, greedy, exact output lengths (max_tokens = min_tokens = n_out and ignore_eos; the
checkpoint's EOS rows are zero anyway), the same 64 short warm-up requests first.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.load_stats import summarize_streams
from shard.testing.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "bench"


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
      help="parts vllm_offline / vllm_served: the interpreter that has vLLM (default: "
           "$VLLM_PYTHON); benchmarks/run_vllm_device.sh builds one")
    a("--vllm-max-model-len", type=int, default=4096,
      help="vLLM --max-model-len (tokenwire's e2e runs with --max-total-tokens 4096)")
    a("--vllm-args", default="",
      help="extra engine arguments for both vLLM parts, CLI style, given as one token (e.g. "
           "--vllm-args='--max-num-batched-tokens 8192'); default: vLLM's own defaults")
    a("--vllm-startup-timeout", type=float, default=420.0,
      help="seconds vLLM may take to load, compile and capture before it counts as failed")


# ---- the request, and vLLM's answers --------------------------------------------------------------


def completion_body(prompt: str, n_out: int, model: str = SERVED_NAME) -> dict:
    """One streamed /v1/completions request: greedy, exactly n_out tokens, usage in every chunk
    (continuous_usage_stats) so the client counts tokens, not chunks."""
    return {"model": model, "prompt": prompt, "max_tokens": n_out, "min_tokens": n_out,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


DONE = "[DONE]"


def parse_sse_line(line: bytes) -> dict | str | None:
    """One line of an SSE body: the chunk's JSON, DONE, or None (blank, comment, other field)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    return json.loads(payload)


@dataclass
class StreamState:
    """What one streamed completion has shown so far."""

    times: list[float]
    count: int = 0
    prompt_tokens: int = 0  # as vLLM's tokenizer counted the prompt (usage.prompt_tokens)
    reason: str = ""
    error: str = ""

    def apply(self, chunk: dict, now: float) -> None:
        """Fold one chunk in. An event counts as a token event (a TTFT / ITL sample) when it
        carried new tokens: usage.completion_tokens grew (continuous usage), or, without usage,
        a choice carried text."""
        if "error" in chunk:  # vLLM reports mid-stream errors as a data event
            err = chunk["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        choices = chunk.get("choices") or []
        for c in choices:
            if c.get("finish_reason"):
                self.reason = c["finish_reason"]
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            n = int(usage["completion_tokens"])
            if n > self.count and choices:
                self.times.append(now)
            self.count = max(self.count, n)
        elif any(c.get("text") for c in choices):
            self.times.append(now)
            self.count += 1


# (request index, prompt words, new tokens, prompt text): one request of the workload.
Job = tuple[int, int, int, str]


def _sse_client_proc(base_url: str, jobs: list[Job], start_at: float, queue) -> None:
    """One load-client process (as bench._client_proc for gRPC): all its requests at once, each
    a streamed POST /v1/completions on its own connection; puts the result dicts on `queue`."""
    import asyncio

    import aiohttp

    async def one(session, idx: int, n_in: int, n_out: int, prompt: str) -> dict:
        st = StreamState(times=[])
        t0 = time.time()
        try:
            async with session.post(f"{base_url}/v1/completions",
                                    json=completion_body(prompt, n_out)) as resp:
                if resp.status != 200:
                    st.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                else:
                    async for line in resp.content:  # aiohttp yields the body line by line
                        ev = parse_sse_line(line)
                        if ev == DONE:
                            break
                        if ev is not None:
                            st.apply(ev, time.time())
        except (aiohttp.ClientError, TimeoutError) as exc:
            st.error = f"{type(exc).__name__}: {exc}"
        return {"idx": idx, "in": n_in, "out": n_out, "t0": t0, "times": st.times,
                "reason": st.reason, "error": st.error, "count": st.count,
                "prompt_tokens": st.prompt_tokens}

    async def main() -> list[dict]:
        conn = aiohttp.TCPConnector(limit=0)  # one connection per stream, no pool cap
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            delay = start_at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            return await asyncio.gather(*(one(session, *j) for j in jobs))

    queue.put(asyncio.run(main()))


# ---- offline results -------------------------------------------------------------------------------


def offline_rows(request_outputs) -> list[tuple[int, int, str]]:
    """(prompt tokens, generated tokens, finish reason) of each vLLM RequestOutput, in order."""
    return [(len(o.prompt_token_ids or []), len(o.outputs[0].token_ids),
             o.outputs[0].finish_reason or "none") for o in request_outputs]


def summarize_offline(rows: list[tuple[int, int, str]], lengths: list[tuple[int, int]],
                      wall_s: float, startup_s: float) -> dict:
    """req/s and output tok/s of one `LLM.generate` over the whole workload (all submitted at
    once, so wall time is the engine bound), and whether every request got its exact length."""
    reasons: dict[str, int] = {}
    for _, _, r in rows:
        reasons[r] = reasons.get(r, 0) + 1
    out_tokens = sum(n for _, n, _ in rows)
    return {"requests": len(rows), "ok": len(rows), "wall_seconds": wall_s,
            "startup_seconds": startup_s, "requests_per_s": len(rows) / wall_s,
            "output_tokens_per_s": out_tokens / wall_s,
            "mean_prompt_tokens": sum(p for p, _, _ in rows) / max(1, len(rows)),
            "mean_output": out_tokens / max(1, len(rows)),
            "exact_lengths": sum(n == want for (_, n, _), (_, want) in zip(rows, lengths)),
            "finish_reasons": reasons}


# ---- running vLLM ---------------------------------------------------------------------------------


def vllm_env() -> dict[str, str]:
    """The environment of vLLM's processes: the repository on PYTHONPATH (for vllm_offline's
    workload imports) and nothing else of tokenwire's (its carried /tmp/site wheels pin other
    protobuf/grpc versions); no network, no usage reports. FlashInfer is not in the pack (its
    JIT needs a compiler and its cubins are ~1 GB): vLLM's sampler then takes its torch top-k /
    top-p path, which greedy requests never reach anyway."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    return env


def wait_for_free_gpu(mem_get_info, fraction: float = 0.92, timeout: float = 120.0,
                      poll_s: float = 1.0) -> float:
    """Waits until `fraction` of the device's memory is free, i.e. the previous part's processes
    (tokenwire's shard, vLLM's engine core) are gone: vLLM refuses to start when less than its
    gpu_memory_utilization (0.9) is free. Returns the free fraction seen last (below `fraction`
    after `timeout`: vLLM's own error will then say why). mem_get_info: () -> (free, total)."""
    deadline = time.monotonic() + timeout
    while True:
        free, total = mem_get_info()
        if free >= fraction * total or time.monotonic() >= deadline:
            return free / total
        time.sleep(poll_s)


def _python(args) -> str:
    if not args.vllm_python:
        raise RuntimeError("--vllm-python (or $VLLM_PYTHON) must name an interpreter with vLLM")
    return args.vllm_python


def bench_vllm_offline(model_dir: Path, args, log_path: Path) -> dict:
    """`LLM.generate` on the whole workload in vLLM's interpreter (vllm_offline.py)."""
    out_json = log_path.with_suffix(".json")
    cmd = [_python(args), "-m", "benchmarks.harness.vllm_offline", "--model", str(model_dir),
           "--requests", str(args.requests), "--warmup-requests", str(args.e2e_warmup_requests),
           "--max-model-len", str(args.vllm_max_model_len),
           f"--engine-args={args.vllm_args}",  # one token: the value itself starts with --
           "--out", str(out_json)]
    with open(log_path, "w") as logf:
        rc = subprocess.run(cmd, check=False, stdout=logf, stderr=subprocess.STDOUT,
                            env=vllm_env(), cwd=REPO_ROOT,
                            timeout=args.vllm_startup_timeout + args.e2e_timeout).returncode
    if rc != 0 or not out_json.is_file():
        raise RuntimeError(f"vLLM offline exited with {rc}; see {log_path.name}")
    return json.loads(out_json.read_text())


def served_command(python: str, model_dir: Path, port: int, args) -> list[str]:
    """vLLM's OpenAI server on the harness's checkpoint, its defaults otherwise."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(args.vllm_max_model_len)] + shlex.split(args.vllm_args)


def wait_http_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until GET /health answers 200 (vLLM's readiness: model loaded, graphs captured)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM server not ready after {timeout:.0f} s")


def run_sse_load(base_url: str, jobs: list[Job], clients: int, warmup_requests: int,
                 timeout: float, startup_s: float) -> dict:
    """The harness's load against an OpenAI-compatible server: warm-up requests (at most 16
    tokens) first, then all requests released at once from `clients` processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if warmup_requests:
        warm = [(i, n_in, min(n_out, 16), p) for i, n_in, n_out, p in jobs[:warmup_requests]]
        wp = ctx.Process(target=_sse_client_proc, args=(base_url, warm, time.time(), queue))
        wp.start()
        warm_results = queue.get(timeout=timeout)
        wp.join(timeout=10)
        if any(r["error"] for r in warm_results):
            raise RuntimeError(f"warm-up failed: {warm_results[0]['error']}")
    start_at = time.time() + 3.0
    procs = [ctx.Process(target=_sse_client_proc,
                         args=(base_url, jobs[c::clients], start_at, queue))
             for c in range(clients)]
    for p in procs:
        p.start()
    results: list[dict] = []
    for _ in procs:
        results.extend(queue.get(timeout=timeout + 60))
    for p in procs:
        p.join(timeout=10)
    out = summarize_streams(results, start_at, startup_s)
    ok = [r["prompt_tokens"] for r in results if not r["error"]]
    out["mean_prompt_tokens"] = sum(ok) / max(1, len(ok))  # the prompts' length as served
    return out


def bench_vllm_served(model_dir: Path, args, log_path: Path, jobs: list[Job]) -> dict:
    """vLLM's API server, 64 warm-up requests, then the workload (`jobs`, the e2e part's) over
    SSE from --clients processes; start-up is process start to /health answering."""
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(served_command(_python(args), model_dir, port, args),
                                stdout=logf, stderr=subprocess.STDOUT, env=vllm_env(),
                                cwd=REPO_ROOT, start_new_session=True)
        try:
            wait_http_ready(base_url, proc, args.vllm_startup_timeout)
            startup_s = time.perf_counter() - t0
            return run_sse_load(base_url, jobs, args.clients, args.e2e_warmup_requests,
                                args.e2e_timeout, startup_s)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


# ---- report ---------------------------------------------------------------------------------------


def _ms(a: float | None, b: float | None, fmt: str) -> str:
    return "-" if a is None else f"{a:{fmt}} / {b:{fmt}}"


def side_by_side_section(res: dict, L: list[str]) -> None:
    """tokenwire's and vLLM's rows of the same workload in one table (the issue-44 table)."""
    vo, vs = res.get("vllm_offline"), res.get("vllm_served")
    if not (vo or vs):
        return
    rows: list[tuple[str, dict, bool]] = []
    if vo:
        rows.append(("vLLM offline `LLM.generate` (engine bound)", vo, False))
    if vs:
        rows.append(("vLLM served (`/v1/completions`, SSE)", vs, True))
    eng = (res.get("engine") or {}).get("runs", {}).get("on")
    if eng:
        rows.append(("tokenwire engine only (overlap on)", eng, False))
    for key, label in (("e2e", "tokenwire served (gRPC, overlap on)"),
                       ("e2e_no_overlap", "tokenwire served (gRPC, overlap off)")):
        if res.get(key):
            rows.append((label, res[key], True))
    n = (vs or vo)["requests"]
    L.append(f"\n## Side by side with vLLM ({n} requests at once, same checkpoint, tokenizer and "
             "lengths, greedy, same machine)\n"
             "| path | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | start-up | "
             "exact lengths |\n|---|---|---|---|---|---|---|\n")
    for label, r, served in rows:
        ttft = _ms(r.get("ttft_p50_ms"), r.get("ttft_p99_ms"), ".0f") if served else "-"
        itl = _ms(r.get("itl_p50_ms"), r.get("itl_p99_ms"), ".1f") if served else "-"
        start = r.get("startup_seconds")
        start_txt = "" if start is None else f"{start:.0f} s"
        exact = r.get("exact_lengths")
        exact_txt = "" if exact is None else f"{exact}/{r.get('requests', n)}"
        L.append(f"| {label} | {r['requests_per_s']:.1f} | {r['output_tokens_per_s']:,.0f} | "
                 f"{ttft} | {itl} | {start_txt} | "
                 f"{exact_txt} |\n")
    if vs and res.get("e2e"):
        L.append(f"\ntokenwire served / vLLM served req/s: "
                 f"{res['e2e']['requests_per_s'] / vs['requests_per_s']:.2f}x\n")
    for key in ("vllm_offline", "vllm_served"):
        r = res.get(key)
        if r and (r.get("errors") or r.get("finish_reasons")):
            L.append(f"- {key}: finish reasons {r.get('finish_reasons')}; mean prompt tokens "
                     f"{r.get('mean_prompt_tokens', float('nan')):.1f}; errors "
                     f"{r.get('errors', [])}\n")

