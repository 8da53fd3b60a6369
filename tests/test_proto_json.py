"""Public messages round-trip through JSON with the snake_case names TGI clients parse."""

from __future__ import annotations

import json

from google.protobuf import json_format
from tokenwire.v1 import generate_pb2 as pb

from tests.helpers.proto_json import to_json


def round_trip(message):
    again = type(message)()
    json_format.Parse(json.dumps(to_json(message)), again)
    assert again == message
    return to_json(message)


def test_tgi_request_body_parses() -> None:
    body = {
        "inputs": "Testing API",
        "parameters": {
            "max_new_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "do_sample": True,
            "stop": ["\n"],
            "seed": 42,
            "decoder_input_details": True,
            "top_n_tokens": 2,
            "grammar": {"type": "json", "value": {"type": "object"}},
        },
    }
    request = json_format.Parse(json.dumps(body), pb.GenerateRequest())
    assert request.parameters.max_new_tokens == 9
    assert request.parameters.HasField("temperature")
    assert not request.parameters.HasField("top_k")
    assert request.parameters.grammar.value.struct_value["type"] == "object"
    round_trip(request)


def test_response_json_uses_tgi_names() -> None:
    response = pb.GenerateResponse(
        generated_text=" world",
        details=pb.Details(
            finish_reason="eos_token",
            generated_tokens=1,
            seed=7,
            prefill=[
                pb.PrefillToken(id=1, text="<s>"),
                pb.PrefillToken(id=5, text="Hi", logprob=-1.5),
            ],
            tokens=[pb.Token(id=9, text=" world", logprob=-0.25, special=False)],
            top_tokens=[pb.TopTokens(tokens=[pb.Token(id=9, text=" world", logprob=-0.25)])],
        ),
    )
    data = round_trip(response)
    details = data["details"]
    assert details["finish_reason"] == "eos_token"
    assert details["tokens"][0] == {"id": 9, "text": " world", "logprob": -0.25, "special": False}
    assert "logprob" not in details["prefill"][0]  # TGI: null for the first prompt token
    assert details["prefill"][1]["logprob"] == -1.5
    assert set(details) >= {"generated_tokens", "seed", "prefill", "tokens", "best_of_sequences"}


def test_stream_events_carry_details_only_at_the_end() -> None:
    middle = pb.GenerateStreamResponse(index=0, token=pb.Token(id=3, text="a", logprob=-0.5))
    last = pb.GenerateStreamResponse(
        index=1,
        token=pb.Token(id=2, text="</s>", logprob=-0.1, special=True),
        generated_text="a",
        details=pb.StreamDetails(finish_reason="eos_token", generated_tokens=2, input_length=4),
    )
    first_json, last_json = round_trip(middle), round_trip(last)
    assert "generated_text" not in first_json and "details" not in first_json
    assert first_json["token"] == {"id": 3, "text": "a", "logprob": -0.5, "special": False}
    assert last_json["generated_text"] == "a"
    assert last_json["details"]["finish_reason"] == "eos_token"
    assert last_json["details"]["input_length"] == 4


def test_in_band_error_event() -> None:
    event = pb.GenerateStreamResponse(index=3, error="shard failed", error_type="generation")
    data = round_trip(event)
    assert data["error"] == "shard failed" and data["error_type"] == "generation"
    assert "token" not in data


def test_info_json_fields_match_tgi() -> None:
    info = pb.InfoResponse(
        model_id="tiny",
        model_dtype="float32",
        model_device_type="cpu",
        max_input_tokens=512,
        max_total_tokens=1024,
        version="0.1.0",
        router="tokenwire-router",
    )
    data = round_trip(info)
    for name in (
        "model_id",
        "model_dtype",
        "model_device_type",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_input_tokens",
        "max_total_tokens",
        "max_client_batch_size",
        "version",
    ):
        assert name in data, name
