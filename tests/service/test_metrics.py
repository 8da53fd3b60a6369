"""Prometheus exposition (scraped over HTTP) and the per-request log line."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenwire.v1 import generate_pb2 as pb

from service.observability.logs import JsonFormatter, TextFormatter
from service.observability.metrics import MetricsServer
from tests.helpers.engine_double import ScriptedEngine
from tests.helpers.router_harness import rpc_error, running_router


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def test_metrics_endpoint_exposes_request_and_engine_metrics(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        server = MetricsServer(router.metrics.registry, 0, "127.0.0.1")
        try:
            await router.stub.Generate(
                pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=4))
            )
            _ = [
                e
                async for e in router.stub.GenerateStream(
                    pb.GenerateRequest(
                        inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=3)
                    )
                )
            ]
            err = await rpc_error(router.stub.Generate(pb.GenerateRequest(inputs="")))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            m = scrape(server.port)
        finally:
            server.close()
    g, s = (("method", "generate"),), (("method", "generate_stream"),)
    assert m[("tokenwire_request_count_total", g)] == 2
    assert m[("tokenwire_request_success_total", g)] == 1
    assert m[("tokenwire_request_success_total", s)] == 1
    assert (
        m[("tokenwire_request_failure_total", (("method", "generate"), ("reason", "validation")))]
        == 1
    )
    assert m[("tokenwire_request_generated_tokens_count", ())] == 2
    assert m[("tokenwire_request_generated_tokens_sum", ())] == 7
    assert m[("tokenwire_time_to_first_token_seconds_count", ())] == 2
    assert m[("tokenwire_inter_token_latency_seconds_count", ())] == 3 + 2
    for name in ("duration", "validation_duration", "queue_duration", "inference_duration"):
        assert m[(f"tokenwire_request_{name}_seconds_count", ())] == 2
    assert m[("tokenwire_request_queue_duration_seconds_sum", ())] == pytest.approx(0.002)
    assert m[("tokenwire_request_input_length_count", ())] == 2
    # Engine statistics, read at scrape time.
    assert m[("tokenwire_kv_blocks_total", ())] == 64
    assert m[("tokenwire_kv_blocks_free", ())] == 64
    assert m[("tokenwire_kv_blocks_used", ())] == 0
    assert m[("tokenwire_prefix_cache_hit_tokens_total", ())] == 3
    assert m[("tokenwire_preemptions_total", ())] == 1
    assert m[("tokenwire_engine_step_ms", ())] == 1.5
    assert m[("tokenwire_serving", ())] == 1
    assert m[("tokenwire_requests_in_flight", ())] == 0


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
