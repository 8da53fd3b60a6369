"""Validation: every invalid input is INVALID_ARGUMENT naming the field, the value and the limit
(table-driven, through the real servicer over gRPC loopback), and the normalisation rules."""

from __future__ import annotations

import json

import math
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from tokenwire.v1 import generate_pb2 as pb

from service.generation.errors import ValidationError
from service.generation.validation import (
    GenerateInput,
    GrammarInput,
    check_length,
    check_parameters,
)
from tests.helpers.engine_double import ScriptedEngine
from tests.helpers.router_harness import DEFAULT_LIMITS, rpc_error, running_router

LONG_TEXT = "xq zv " * 80  # far more than 64 tokens with the tiny tokenizer


def _grammar(kind: str, value: object) -> pb.Grammar:
    v = struct_pb2.Value()
    if isinstance(value, dict):
        v.struct_value.update(value)
    elif isinstance(value, str):
        v.string_value = value
    elif isinstance(value, (int, float)):
        v.number_value = value
    return pb.Grammar(type=kind, value=v)


# (id, inputs, parameters, stream, field, substrings the message must contain)
INVALID = [
    ("empty-inputs", "", {}, False, "inputs", ["must not be empty"]),
    (
        "temperature-negative",
        "hi",
        {"temperature": -0.5},
        False,
        "parameters.temperature",
        [">= 0", "-0.5"],
    ),
    (
        "temperature-nan",
        "hi",
        {"temperature": math.nan},
        False,
        "parameters.temperature",
        ["finite", "nan"],
    ),
    (
        "repetition-penalty-zero",
        "hi",
        {"repetition_penalty": 0.0},
        False,
        "parameters.repetition_penalty",
        ["> 0", "0.0"],
    ),
    (
        "frequency-penalty-high",
        "hi",
        {"frequency_penalty": 2.5},
        False,
        "parameters.frequency_penalty",
        ["[-2.0, 2.0]", "2.5"],
    ),
    (
        "frequency-penalty-low",
        "hi",
        {"frequency_penalty": -3.0},
        False,
        "parameters.frequency_penalty",
        ["[-2.0, 2.0]", "-3.0"],
    ),
    ("top-k-zero", "hi", {"top_k": 0}, False, "parameters.top_k", ["> 0", "got 0"]),
    ("top-k-negative", "hi", {"top_k": -3}, False, "parameters.top_k", ["> 0", "-3"]),
    ("top-p-zero", "hi", {"top_p": 0.0}, False, "parameters.top_p", ["(0, 1]", "0.0"]),
    ("top-p-high", "hi", {"top_p": 1.5}, False, "parameters.top_p", ["(0, 1]", "1.5"]),
    (
        "typical-p-high",
        "hi",
        {"typical_p": 1.25},
        False,
        "parameters.typical_p",
        ["(0, 1]", "1.25"],
    ),
    (
        "best-of-over-limit",
        "hi",
        {"best_of": 3, "do_sample": True},
        False,
        "parameters.best_of",
        ["<= 2", "--max-best-of", "got 3"],
    ),
    ("best-of-zero", "hi", {"best_of": 0}, False, "parameters.best_of", ["> 0", "got 0"]),
    (
        "best-of-greedy",
        "hi",
        {"best_of": 2},
        False,
        "parameters.best_of",
        ["needs sampling", "best_of=2"],
    ),
    (
        "best-of-temperature-0",
        "hi",
        {"best_of": 2, "do_sample": True, "temperature": 0.0},
        False,
        "parameters.best_of",
        ["temperature 0", "best_of=2"],
    ),
    (
        "best-of-stream",
        "hi",
        {"best_of": 2, "do_sample": True},
        True,
        "parameters.best_of",
        ["GenerateStream", "got 2"],
    ),
    (
        "too-many-stops",
        "hi",
        {"stop": ["a", "b", "c", "d", "e"]},
        False,
        "parameters.stop",
        ["at most 4", "--max-stop-sequences", "got 5"],
    ),
    ("empty-stop", "hi", {"stop": ["a", ""]}, False, "parameters.stop[1]", ["must not be empty"]),
    ("truncate-zero", "hi", {"truncate": 0}, False, "parameters.truncate", ["[1, 64]", "got 0"]),
    (
        "truncate-over-limit",
        "hi",
        {"truncate": 65},
        False,
        "parameters.truncate",
        ["[1, 64]", "--max-input-tokens", "got 65"],
    ),
    (
        "max-new-tokens-zero",
        "hi",
        {"max_new_tokens": 0},
        False,
        "parameters.max_new_tokens",
        ["> 0", "got 0"],
    ),
    (
        "max-new-tokens-over-total",
        "hi",
        {"max_new_tokens": 95},
        False,
        "parameters.max_new_tokens",
        ["96", "--max-total-tokens", "got 95"],
    ),
    (
        "inputs-too-long",
        LONG_TEXT,
        {},
        False,
        "inputs",
        ["at most 64 tokens", "--max-input-tokens", "truncate"],
    ),
    (
        "top-n-tokens-over-limit",
        "hi",
        {"top_n_tokens": 6},
        False,
        "parameters.top_n_tokens",
        ["<= 5", "--max-top-n-tokens", "got 6"],
    ),
    (
        "grammar-bad-type",
        "hi",
        {"grammar": _grammar("xml", "a")},
        False,
        "parameters.grammar.type",
        ["json, json_object, regex", "'xml'"],
    ),
    (
        "grammar-bad-json",
        "hi",
        {"grammar": _grammar("json", "{nope")},
        False,
        "parameters.grammar.value",
        ["invalid JSON"],
    ),
    (
        "grammar-json-not-object",
        "hi",
        {"grammar": _grammar("json", 3)},
        False,
        "parameters.grammar.value",
        ["object", "float"],
    ),
    (
        "grammar-bad-regex",
        "hi",
        {"grammar": _grammar("regex", "(ab")},
        False,
        "parameters.grammar.value",
        ["regular expression", "'(ab'"],
    ),
    (
        "decoder-input-details-stream",
        "hi",
        {"decoder_input_details": True},
        True,
        "parameters.decoder_input_details",
        ["GenerateStream"],
    ),
]


@pytest.mark.parametrize(
    ("inputs", "params", "stream", "field", "needles"),
    [case[1:] for case in INVALID],
    ids=[case[0] for case in INVALID],
)
async def test_invalid_input_is_invalid_argument_naming_field_value_and_limit(
    tokenizer_dir: Path, inputs: str, params: dict, stream: bool, field: str, needles: list[str]
) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        request = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))
        call = router.stub.GenerateStream(request) if stream else router.stub.Generate(request)
        err = await rpc_error(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    message = err.details()
    assert message.startswith(field + " "), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert engine.submitted == []  # nothing reached the engine


async def test_well_formed_grammar_is_unimplemented(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir) as router:
        request = pb.GenerateRequest(
            inputs="hi",
            parameters=pb.GenerateParameters(grammar=_grammar("json", {"type": "object"})),
        )
        err = await rpc_error(router.stub.Generate(request))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "parameters.grammar" in err.details()


def _params(**kwargs: object):
    return check_parameters(GenerateInput(inputs="hi", **kwargs), DEFAULT_LIMITS, stream=False)  # type: ignore[arg-type]


def test_defaults_are_greedy_with_off_values() -> None:
    s = _params().sampling
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.typical_p) == (False, 1.0, 0, 1.0, 1.0)
    assert (s.repetition_penalty, s.frequency_penalty) == (1.0, 0.0)


def test_top_p_one_means_off() -> None:
    assert _params(top_p=1.0).sampling.do_sample is False
    assert _params(typical_p=1.0).sampling.do_sample is False
    assert _params(top_p=0.9).sampling.do_sample is True


def test_temperature_zero_means_greedy_even_with_do_sample() -> None:
    s = _params(temperature=0.0, do_sample=True, top_k=5).sampling
    assert s.do_sample is False and s.temperature == 1.0 and s.top_k == 0


def test_sampling_implied_by_warpers_as_in_tgi() -> None:
    assert _params(temperature=0.7).sampling.do_sample
    assert _params(top_k=3).sampling.do_sample
    assert _params(typical_p=0.5).sampling.do_sample


def test_best_of_seeds_are_distinct_and_reproducible() -> None:
    p = _params(best_of=2, do_sample=True, seed=41)
    assert p.seeds == (41, 42)
    drawn = _params(best_of=2, do_sample=True).seeds
    assert len(set(drawn)) == 2


def test_seed_wraps_at_u64() -> None:
    assert _params(best_of=2, do_sample=True, seed=2**64 - 1).seeds == (2**64 - 1, 0)


def test_truncate_keeps_the_last_tokens_and_default_max_new_tokens() -> None:
    request = GenerateInput(inputs="x", truncate=3)
    ids, max_new = check_length(request, DEFAULT_LIMITS, tuple(range(10)))
    assert ids == (7, 8, 9)
    assert max_new == min(DEFAULT_LIMITS.max_total_tokens - 3, 100)


def test_max_new_tokens_fills_the_total_budget_exactly() -> None:
    request = GenerateInput(inputs="x", max_new_tokens=DEFAULT_LIMITS.max_total_tokens - 10)
    _, max_new = check_length(request, DEFAULT_LIMITS, tuple(range(10)))
    assert max_new == 86
    with pytest.raises(ValidationError):
        check_length(GenerateInput(inputs="x", max_new_tokens=87), DEFAULT_LIMITS, tuple(range(10)))


def test_valid_grammars_become_shard_grammars() -> None:
    regex = _params(grammar=GrammarInput("regex", "[a-z]+")).grammar
    assert (regex.kind, regex.source) == ("regex", "[a-z]+")
    schema = _params(grammar=GrammarInput("json", {"type": "object"})).grammar
    assert schema.kind == "json_schema"
    doc = json.loads(schema.source)
    assert doc["type"] == "object" and doc["x-guidance"]["whitespace_flexible"] is False
    anything = _params(grammar=GrammarInput("json_object", None)).grammar
    assert json.loads(anything.source)["type"] == "object"


async def test_long_input_passes_with_truncate_and_reaches_engine(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        request = pb.GenerateRequest(
            inputs=LONG_TEXT, parameters=pb.GenerateParameters(truncate=10, max_new_tokens=3)
        )
        await router.stub.Generate(request)
    assert len(engine.submitted[0].input_ids) == 10
