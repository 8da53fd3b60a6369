"""TGI's JSON codec (service/api/tgi_json.py) and the closing of JSON-schema objects: pure unit
tests, no processes."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api import tgi_json
from service.generation.errors import ValidationError
from service.generation.grammar import closed_objects, json_schema_spec


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"inputs":', "body"),
        (b"[1]", "body"),
        (b'{"inputs": 3}', "inputs"),
        (b'{"inputs": "x", "parameters": []}', "parameters"),
        (b'{"inputs": "x", "parameters": {"top_k": "3"}}', "parameters.top_k"),
        (b'{"inputs": "x", "parameters": {"temperature": true}}', "parameters.temperature"),
        (b'{"inputs": "x", "parameters": {"seed": 18446744073709551616}}', "parameters.seed"),
        (b'{"inputs": "x", "parameters": {"details": 1}}', "parameters.details"),
        (b'{"inputs": "x", "parameters": {"grammar": "json"}}', "parameters.grammar"),
        (b'{"inputs": "x", "stream": "yes"}', "stream"),
    ],
)
def test_wrong_types_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        tgi_json.generate_request(body)
    assert err.value.field == field and field in str(err.value)
    status, data = tgi_json.error_body(err.value)
    assert status == 422 and json.loads(data) == {"error": str(err.value),
                                                   "error_type": "validation"}  # fmt: skip


def test_nulls_unknown_fields_and_json_schema_grammar() -> None:
    parsed = tgi_json.generate_request(json.dumps({
        "inputs": "x", "unknown": 1, "stream": True,
        "parameters": {"seed": 2**64 - 1, "top_p": None, "stop": ["a"], "grammar": {
            "type": "json_schema", "value": {"name": "n", "schema": {"type": "object"}}}},
    }).encode())  # fmt: skip
    assert parsed.stream and parsed.input.seed == 2**64 - 1 and parsed.input.top_p is None
    assert parsed.input.grammar is not None and parsed.input.grammar.type == "json"
    assert tgi_json.dumps({"a": float("nan"), "b": 2**63}) == b'{"a":null,"b":9223372036854775808}'


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["inputs", "parameters", "stream", "seed", "top_k", "stop", "grammar",
                         "temperature", "details", "max_new_tokens", "type", "value"]),
        inner, max_size=4),
    max_leaves=12,
))  # fmt: skip
def test_fuzzed_bodies_decode_or_fail_as_validation(value: object) -> None:
    """Any JSON body either decodes or is a ValidationError (422), never another exception."""
    try:
        data = json.dumps(value).encode()
    except ValueError:
        return
    try:
        tgi_json.generate_request(data)
    except ValidationError as error:
        assert tgi_json.error_status(error) == (422, "validation")


SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "object", "properties": {"name": {"type": "string"}}},
        "meta": {"type": "object"},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    },
    "$defs": {"Item": {"properties": {"id": {"type": "integer"}}}},
}


def test_objects_without_additional_properties_are_closed() -> None:
    closed = closed_objects(SCHEMA)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["team"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["meta"]  # no properties: open
    assert closed["properties"]["open"]["additionalProperties"] is True  # explicit: kept
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    extra = {"team": {"name": "x", "team_team_name": "y"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(extra, closed)
    jsonschema.validate(extra, SCHEMA)  # the schema as written allows the invented key
    spec = json.loads(json_schema_spec(SCHEMA).source)
    assert spec["properties"]["team"]["additionalProperties"] is False
    all_of = closed_objects({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in all_of["allOf"])
