"""The harness's vLLM row (issue 44 item 3) without vLLM: the served part against a stand-in server
speaking vLLM's SSE (tests/helpers/fake_vllm_server.py, started through a fake interpreter as the
harness starts vLLM's), the offline part's result parsing on RequestOutput-shaped objects, the
arguments, and the side-by-side table."""

from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness import bench, vllm_side
from benchmarks.harness.vllm_offline import engine_kwargs

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
HELPER = HELPERS / "fake_vllm_server.py"


def _fake_python(path: Path, script: Path) -> Path:
    """An executable standing for vLLM's interpreter: runs `script` with the arguments."""
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[dict, list[dict], list, str]:
    """One served run: 8 workload requests + 3 steering ones through the stand-in server."""
    tmp = tmp_path_factory.mktemp("vllm_side")
    fake_py = _fake_python(tmp / "python", HELPER)  # what --vllm-python names
    bodies = tmp / "bodies.jsonl"
    args = _args(vllm_python=fake_py, clients=2, e2e_warmup_requests=2, e2e_timeout=60,
                 vllm_startup_timeout=60, vllm_args="--max-num-batched-tokens 8192")
    jobs = bench.workload_jobs(8)
    jobs += [(8, 3, 9, "t1 t2 tokens-per-chunk-2"), (9, 1, 5, "reject"),
             (10, 1, 5, "fail-mid-stream")]
    log = tmp / "vllm_server.log"
    with pytest.MonkeyPatch.context() as mp:  # the stand-in appends request bodies there
        mp.setenv("FAKE_VLLM_BODIES", str(bodies))
        res = vllm_side.bench_vllm_served(tmp / "model", args, log, jobs)
    sent = [json.loads(line) for line in bodies.read_text().splitlines()]
    return res, sent, jobs, log.read_text()


def test_served_run_counts_tokens_and_lengths(served) -> None:
    res, _, jobs, log = served
    assert res["requests"] == 11
    # The rejected and the broken stream are errors; the other 9 got exactly n_out tokens, the
    # two-tokens-a-chunk stream included (usage counts tokens, not chunks).
    assert res["ok"] == 9, res["errors"]
    assert res["exact_lengths"] == 9
    assert res["finish_reasons"]["length"] == 9
    assert any("HTTP 400" in e and "maximum context length" in e for e in res["errors"])
    assert any("engine died" in e for e in res["errors"])
    ok_tokens = sum(n_out for _, _, n_out, p in jobs if "reject" not in p and "fail" not in p)
    assert res["mean_output"] * 11 == pytest.approx(ok_tokens + 1)  # + the broken stream's one
    assert res["output_tokens_per_s"] * res["wall_seconds"] == pytest.approx(ok_tokens)
    assert res["requests_per_s"] * res["wall_seconds"] == pytest.approx(9)
    assert 0 < res["ttft_p50_ms"] <= res["ttft_p99_ms"]
    assert 0 <= res["itl_p50_ms"] <= res["itl_p99_ms"]
    assert res["startup_seconds"] > 0
    ok_prompts = [n_in for _, n_in, _, p in jobs if "reject" not in p and "fail" not in p]
    assert res["mean_prompt_tokens"] == pytest.approx(sum(ok_prompts) / len(ok_prompts))
    assert "--max-num-batched-tokens', '8192'" in log  # --vllm-args reach the server


def test_served_requests_are_greedy_exact_length_streams(served) -> None:
    _, sent, jobs, _ = served
    # 2 warm-up requests (at most 16 tokens) and then every job once.
    assert len(sent) == 2 + len(jobs)
    by_prompt = {p: n_out for _, _, n_out, p in jobs}
    for body in sent[:2]:
        assert body["max_tokens"] == min(16, by_prompt[body["prompt"]])
    assert sorted(b["prompt"] for b in sent[2:]) == sorted(by_prompt)
    for body in sent:
        assert body["max_tokens"] == body["min_tokens"]
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["model"] == vllm_side.SERVED_NAME
    # The prompts are the e2e part's: same words, same lengths.
    for idx, n_in, n_out, prompt in jobs[:8]:
        assert prompt == bench.prompt_text(idx, n_in) and len(prompt.split()) == n_in
        assert next(b for b in sent[2:] if b["prompt"] == prompt)["max_tokens"] == n_out


def test_stream_state_without_usage_and_sse_lines() -> None:
    st = vllm_side.StreamState(times=[])
    for t, text in enumerate([" a", "", " b"]):
        st.apply({"choices": [{"text": text, "finish_reason": None}]}, float(t))
    st.apply({"choices": [{"text": " c", "finish_reason": "length"}]}, 3.0)
    assert (st.count, st.times, st.reason) == (3, [0.0, 2.0, 3.0], "length")
    assert vllm_side.parse_sse_line(b": keep-alive\n") is None
    assert vllm_side.parse_sse_line(b"\n") is None
    assert vllm_side.parse_sse_line(b"data: [DONE]\n") == vllm_side.DONE
    assert vllm_side.parse_sse_line(b'data: {"choices": []}\n') == {"choices": []}


def test_offline_rows_and_summary() -> None:
    def out(p: int, n: int, reason: str | None) -> SimpleNamespace:  # vLLM's RequestOutput shape
        return SimpleNamespace(prompt_token_ids=list(range(p)),
                               outputs=[SimpleNamespace(token_ids=list(range(n)),
                                                        finish_reason=reason)])

    rows = vllm_side.offline_rows([out(5, 10, "length"), out(7, 3, "length"), out(2, 4, None)])
    assert rows == [(5, 10, "length"), (7, 3, "length"), (2, 4, "none")]
    s = vllm_side.summarize_offline(rows, [(5, 10), (7, 4), (2, 4)], wall_s=2.0, startup_s=30.0)
    assert s["requests_per_s"] == 1.5 and s["output_tokens_per_s"] == 8.5
    assert s["exact_lengths"] == 2  # the second got 3 of 4
    assert s["finish_reasons"] == {"length": 2, "none": 1} and s["startup_seconds"] == 30.0


def test_arguments_and_commands() -> None:
    a = _args(parts="e2e,vllm_offline,vllm_served", vllm_python="/v/bin/python",
              vllm_args="--max-num-batched-tokens 8192 --enforce-eager")
    assert set(a.parts.split(",")) == {"e2e", "vllm_offline", "vllm_served"}
    cmd = vllm_side.served_command(a.vllm_python, Path("/m"), 8000, a)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--max-model-len") + 1] == "4096" and cmd[-1] == "--enforce-eager"
    assert engine_kwargs(a.vllm_args) == {"max_num_batched_tokens": 8192, "enforce_eager": True}
    assert engine_kwargs("--compilation-config '{\"level\": 0}'") == {
        "compilation_config": {"level": 0}}
    with pytest.raises(RuntimeError, match="--vllm-python"):
        vllm_side.bench_vllm_served(Path("/m"), _args(vllm_python=""), Path("/dev/null"), [])


def test_offline_part_command_line_and_result(tmp_path) -> None:
    """bench_vllm_offline's command line parses with vllm_offline's own parser (the extra engine
    arguments, which start with --, included) and its result file is what the part returns."""
    fake_py = _fake_python(tmp_path / "python", HELPERS / "fake_vllm_offline.py")
    args = _args(vllm_python=fake_py, requests=12, e2e_warmup_requests=3,
                 vllm_args="--max-num-batched-tokens 8192 --enforce-eager")
    log = tmp_path / "vllm_offline.log"
    res = vllm_side.bench_vllm_offline(tmp_path / "model", args, log)
    echoed = json.loads(log.read_text().split("args: ", 1)[1].splitlines()[0])
    assert echoed == {"model": str(tmp_path / "model"), "requests": 12, "warmup": 3,
                      "max_model_len": 4096,
                      "engine": {"max_num_batched_tokens": 8192, "enforce_eager": True}}
    lengths = bench.sharegpt_like(12)
    assert res["requests"] == 12 and res["exact_lengths"] == 12
    assert res["output_tokens_per_s"] == sum(o for _, o in lengths) / 2.0
    # A one-flag value (no space) still reaches vLLM as a value, not as an option of its own.
    vllm_side.bench_vllm_offline(tmp_path / "model", _args(
        vllm_python=fake_py, requests=2, vllm_args="--enforce-eager"), log)
    assert '"engine": {"enforce_eager": true}' in log.read_text()
    bad = _fake_python(tmp_path / "broken", tmp_path / "missing.py")
    with pytest.raises(RuntimeError, match="vLLM offline exited"):
        vllm_side.bench_vllm_offline(tmp_path / "model", _args(vllm_python=bad), log)


def test_waits_for_the_previous_parts_memory() -> None:
    seen = iter([(10, 80), (40, 80), (76, 80), (80, 80)])
    assert vllm_side.wait_for_free_gpu(lambda: next(seen), poll_s=0) == 76 / 80
    stuck = vllm_side.wait_for_free_gpu(lambda: (8, 80), timeout=0.05, poll_s=0.01)
    assert stuck == 0.1  # gives up and lets vLLM say why


def test_side_by_side_table(served, tmp_path) -> None:
    vs = served[0]
    e2e = dict(vs, requests_per_s=vs["requests_per_s"] * 0.5, ttft_p99_ms=123456.0)
    vo = vllm_side.summarize_offline([(5, 10, "length")] * 4, [(5, 10)] * 4, 0.5, 70.0)
    res = {"device": "H100", "date": "d", "commit": "c", "torch": "2.11", "triton": "3.6",
           "num_layers": 32, "model_type": "llama", "e2e": e2e, "vllm_served": vs,
           "vllm_offline": vo}
    bench.write_report(res, tmp_path / "RESULTS.md")
    text = (tmp_path / "RESULTS.md").read_text()
    table = text[text.index("## Side by side with vLLM"):]
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert lines[0].startswith("| path | req/s | output tok/s | TTFT p50 / p99 ms")
    offline, served_row, tw = lines[1], lines[2], lines[3]
    assert offline.startswith("| vLLM offline") and "| 8.0 | 80 | - | - | 70 s | 4/4 |" in offline
    assert served_row.startswith("| vLLM served") and f"| {vs['requests_per_s']:.1f} |" in served_row
    assert tw.startswith("| tokenwire served") and "/ 123456 |" in tw
    assert "tokenwire served / vLLM served req/s: 0.50x" in table
