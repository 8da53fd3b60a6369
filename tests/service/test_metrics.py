"""Prometheus exposition (scraped over HTTP) and the per-request log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer
from tokenwire.v1 import generate_pb2 as pb

from service.engine.adapters import AdapterInfo
from service.observability.logs import JsonFormatter, TextFormatter
from service.observability.metrics import MetricsServer
from service.picker.replicas import MetricNames, fetch_text, parse_load
from service.testing import FakeShardConfig
from tests.helpers.engine_double import ScriptedEngine
from tests.helpers.engine_harness import engine_on_fake_shard
from tests.helpers.metrics import scrape
from tests.helpers.router_harness import rpc_error, running_router
from tests.helpers.waiting import until


async def test_metrics_endpoint_exposes_request_and_engine_metrics(tokenizer_dir: Path) -> None:
    """Request metrics count what the calls did; engine metrics are the real engine's statistics
    (LocalEngine on the fake shard), read at scrape time."""
    prompt = "the router batches requests " * 3  # several KV blocks of 4 tokens
    n_prompt = len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(prompt).ids)
    shard_cfg = FakeShardConfig(num_blocks=256, block_size=4, step_delay_s=0.002)
    async for h in engine_on_fake_shard(shard_cfg):
        async with running_router(h.engine, tokenizer_dir) as router:
            server = MetricsServer(router.metrics.registry, 0, "127.0.0.1")
            try:
                before = scrape(server.port)
                await router.stub.Generate(
                    pb.GenerateRequest(
                        inputs=prompt, parameters=pb.GenerateParameters(max_new_tokens=4)
                    )
                )
                _ = [
                    e
                    async for e in router.stub.GenerateStream(
                        pb.GenerateRequest(
                            inputs=prompt, parameters=pb.GenerateParameters(max_new_tokens=3)
                        )
                    )
                ]
                err = await rpc_error(router.stub.Generate(pb.GenerateRequest(inputs="")))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                # A cancelled stream: the engine removes it and counts it.
                call = router.stub.GenerateStream(
                    pb.GenerateRequest(
                        inputs="cancel me", parameters=pb.GenerateParameters(max_new_tokens=60)
                    )
                )
                await call.read()
                call.cancel()
                await until(
                    lambda engine=h.engine: (
                        engine.stats().aborted == 1 and engine.stats().running == 0
                    ),
                    timeout=5,
                    what="the cancelled stream aborted",
                )
                m = scrape(server.port)
                text = fetch_text(f"http://127.0.0.1:{server.port}/metrics", 5)
            finally:
                server.close()
            stats = h.engine.stats()
    g, s = {"method": "generate"}, {"method": "generate_stream"}
    assert m.value("tokenwire_request_count_total", **g) == 2
    assert m.value("tokenwire_request_count_total", **s) == 2
    assert m.value("tokenwire_request_success_total", **g) == 1
    assert m.value("tokenwire_request_success_total", **s) == 1
    assert m.value("tokenwire_request_failure_total", **g, reason="validation") == 1
    assert m.value("tokenwire_request_failure_total", **s, reason="cancelled") == 1
    assert m["tokenwire_request_generated_tokens_count"] == 2
    assert m["tokenwire_request_generated_tokens_sum"] == 7
    assert m["tokenwire_time_to_first_token_seconds_count"] == 3  # the cancelled one's too
    assert m["tokenwire_inter_token_latency_seconds_count"] == 3 + 2
    for name in ("duration", "validation_duration", "queue_duration", "inference_duration"):
        assert m[f"tokenwire_request_{name}_seconds_count"] == 2
    assert m["tokenwire_request_input_length_count"] == 2
    assert m["tokenwire_request_input_length_sum"] == 2 * n_prompt
    # Engine statistics: the fake shard's KV cache, all free again; the second request found the
    # first one's full blocks in the prefix cache; every step the engine ran is counted.
    assert m["tokenwire_kv_blocks_total"] == 256 == stats.kv_blocks_total
    assert m["tokenwire_kv_blocks_free"] == 256 and m["tokenwire_kv_blocks_used"] == 0
    assert m["tokenwire_running_requests"] == 0 and m["tokenwire_queue_size"] == 0
    hits = m["tokenwire_prefix_cache_hit_tokens_total"]
    computed = m["tokenwire_prefill_tokens_computed_total"]
    assert hits >= 4 * ((n_prompt - 1) // 4) - 4 > 0, (hits, n_prompt)
    assert computed + hits == 2 * n_prompt + len(router_ids_of_cancelled(tokenizer_dir))
    assert m["tokenwire_engine_steps_total"] == stats.steps >= 4 + 3
    assert before["tokenwire_engine_steps_total"] == 0
    assert m["tokenwire_preemptions_total"] == 0
    assert m["tokenwire_requests_aborted_total"] == 1
    assert m["tokenwire_engine_healthy"] == 1
    assert m["tokenwire_serving"] == 1
    assert m["tokenwire_requests_in_flight"] == 0
    # GIE's model-server protocol, read the way the endpoint picker reads it (its default names
    # are tokenwire's): waiting, running, KV usage as a fraction, block size and count, serving.
    gie = parse_load(text, MetricNames())
    assert (gie.waiting, gie.running, gie.kv_usage, gie.serving) == (0, 0, 0.0, True)
    assert (gie.block_size, gie.num_blocks) == (4, 256)
    assert m.value("tokenwire_cache_config_info", block_size="4", num_gpu_blocks="256") == 1


def router_ids_of_cancelled(tokenizer_dir: Path) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode("cancel me").ids


async def test_one_log_line_per_request_with_its_id(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenwire.request")
    async with running_router(ScriptedEngine(), tokenizer_dir) as router:
        await router.stub.Generate(
            pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=2)),
            metadata=(("x-request-id", "log-me-1"),),
        )
        await rpc_error(
            router.stub.Generate(
                pb.GenerateRequest(inputs=""), metadata=(("x-request-id", "log-me-2"),)
            )
        )
    records = [r for r in caplog.records if r.name == "tokenwire.request"]
    assert [r.fields["request_id"] for r in records] == ["log-me-1", "log-me-2"]  # type: ignore[attr-defined]
    ok, failed = records
    assert ok.fields["status"] == "ok" and ok.fields["generated_tokens"] == 2  # type: ignore[attr-defined]
    assert failed.fields["status"] == "validation"  # type: ignore[attr-defined]
    as_json = json.loads(JsonFormatter().format(ok))
    assert as_json["request_id"] == "log-me-1" and as_json["message"] == "request finished"
    assert "request_id=log-me-1" in TextFormatter().format(ok)


async def test_lora_requests_info_says_which_adapters_run_and_wait(tokenizer_dir: Path) -> None:
    """GIE's lora_requests_info (vLLM's format): adapters of requests past their first token
    are running, those before it waiting, with the shards' adapter slots; base-model requests
    are not listed, and finished requests leave."""
    engine = ScriptedEngine(token_delay=0.05)
    engine.adapters += [AdapterInfo(n, f"/adapters/{n}", 4, 8.0, ("q_proj",)) for n in "ab"]

    def info(port: int) -> tuple[str, str, str]:
        samples = [
            labels
            for (name, labels), _ in scrape(port).samples.items()
            if name == "tokenwire_lora_requests_info"
        ]
        assert len(samples) == 1, samples
        d = dict(samples[0])
        return d["running_lora_adapters"], d["waiting_lora_adapters"], d["max_lora"]

    def request(adapter: str | None, tokens: int) -> pb.GenerateRequest:
        params = pb.GenerateParameters(max_new_tokens=tokens, adapter_id=adapter)
        return pb.GenerateRequest(inputs="hello", parameters=params)

    async with running_router(engine, tokenizer_dir) as router:
        server = MetricsServer(router.metrics.registry, 0, "127.0.0.1")
        try:
            assert not [n for n, _ in scrape(server.port).samples if "lora" in n]  # LoRA off
            router.metrics.adapter_load.max_lora = 4
            assert info(server.port) == ("", "", "4")
            running = router.stub.GenerateStream(request("a", 40))
            await running.read()  # past its first token
            base = router.stub.GenerateStream(request(None, 40))
            await base.read()
            engine.gate.clear()  # later requests wait before their first token
            waiting = router.stub.GenerateStream(request("b", 2))
            await until(lambda: len(engine.submitted) == 3, timeout=5, what="b admitted")
            assert info(server.port) == ("a", "b", "4")
            engine.gate.set()
            _ = [e async for e in waiting]
            running.cancel()
            base.cancel()
            await until(lambda: info(server.port) == ("", "", "4"), timeout=5, what="all left")
        finally:
            server.close()
