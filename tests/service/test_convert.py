"""Public proto ↔ domain conversion."""

from __future__ import annotations

import math
import time

import grpc
from google.protobuf import struct_pb2
from tokenwire.v1 import generate_pb2 as pb

from service.api import convert
from service.api.status import ErrorKind
from service.engine.contracts import Finished, FinishReason, TokenInfo
from service.generation.service import GeneratedSequence, StreamItem
from service.generation.validation import ResponseOptions


def test_unset_optionals_become_none_and_set_ones_keep_zero() -> None:
    empty = convert.generate_input(pb.GenerateRequest(inputs="x"))
    assert (empty.temperature, empty.top_p, empty.seed, empty.max_new_tokens) == (None,) * 4
    assert empty.grammar is None and empty.stop == ()
    zeroes = convert.generate_input(
        pb.GenerateRequest(
            inputs="x",
            parameters=pb.GenerateParameters(temperature=0.0, top_k=0, seed=0, stop=["a"]),
        )
    )
    assert (zeroes.temperature, zeroes.top_k, zeroes.seed, zeroes.stop) == (0.0, 0, 0, ("a",))


def test_grammar_value_becomes_plain_json() -> None:
    value = struct_pb2.Value()
    value.struct_value.update({"type": "object", "required": ["a"]})
    g = convert.generate_input(
        pb.GenerateRequest(
            inputs="x",
            parameters=pb.GenerateParameters(grammar=pb.Grammar(type="json", value=value)),
        )
    ).grammar
    assert g is not None and g.type == "json" and g.value == {"type": "object", "required": ["a"]}


def test_deadline_is_monotonic_instant() -> None:
    assert convert.deadline(None) is None
    d = convert.deadline(5.0)
    assert d is not None and abs(d - (time.monotonic() + 5.0)) < 0.5


OPTIONS = ResponseOptions(
    "p", 3, details=True, decoder_input_details=True, return_full_text=False, best_of=1
)


def test_prefill_nan_logprob_is_absent() -> None:
    assert not convert.prefill_token(TokenInfo(1, "<s>", math.nan)).HasField("logprob")
    assert convert.prefill_token(TokenInfo(5, "a", -1.5)).logprob == -1.5


def test_generate_response_details() -> None:
    from service.generation.service import GenerateOutcome

    seq = GeneratedSequence(
        generated_text="ab",
        finish_reason=FinishReason.EOS_TOKEN,
        generated_tokens=2,
        seed=None,
        prefill=(TokenInfo(1, "<s>", math.nan),),
        tokens=(TokenInfo(3, "a", -0.1), TokenInfo(2, "</s>", -0.2, special=True)),
        top_tokens=(),
    )
    r = convert.generate_response(GenerateOutcome(best=seq, others=(), options=OPTIONS))
    assert r.details.finish_reason == "eos_token" and r.details.tokens[1].special
    assert not r.details.HasField("seed") and len(r.details.prefill) == 1


def test_stream_events() -> None:
    finished = Finished("ab", 2, FinishReason.STOP_SEQUENCE, seed=9)
    last = convert.stream_response(
        StreamItem(1, TokenInfo(4, "b", -0.3), (), OPTIONS, generated_text="ab", finished=finished)
    )
    assert last.generated_text == "ab" and last.details.seed == 9 and last.details.input_length == 3
    assert last.details.finish_reason == "stop_sequence"
    error = convert.stream_error(2, ErrorKind(grpc.StatusCode.UNAVAILABLE, "unavailable"), "gone")
    assert (error.index, error.error, error.error_type) == (2, "gone", "unavailable")
    assert not error.HasField("token")
