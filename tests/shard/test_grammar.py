"""Constrained decoding in the shard engine on a tiny random model: a grammar's output matches
it and ends with EOS, unconstrained rows of a mixed batch are untouched, recompute after
preemption replays the matcher, stop sequences and ignore_eos still apply, a bad grammar is an
InvalidRequestError, and the bitmask is filled while the forward pass runs."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from reference import prompts
from shard_driver import RouterSim, engine_call
from tokenwire.shard.v1 import shard_pb2 as pb

from shard.distributed.groups import Dist
from shard.engine.grammar import GrammarEngine
from shard.errors import InvalidRequestError
from shard.runner.warmup import WarmupSpec
from shard.server.loader import Shard, ShardConfig

REGEX = r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


def regex_grammar(pattern: str = REGEX) -> pb.OutputGrammar:
    return pb.OutputGrammar(kind="regex", source=pattern)


def json_grammar(schema: dict = SCHEMA) -> pb.OutputGrammar:
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return pb.OutputGrammar(kind="json_schema", source=json.dumps({**schema,
                                                                   "x-guidance": options}))


@pytest.fixture(scope="module")
def llama(tiny_models):
    model_dir = tiny_models["llama"]
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=4), Dist())
    shard.warmup(WarmupSpec(64, 256, 256, 8))
    return model_dir, shard


def fresh(shard) -> RouterSim:
    shard.engine.clear_cache(None)
    return RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)


def run_alone(shard, prompt, max_new_tokens=40, **kw):
    sim = fresh(shard)
    sim.add(1, prompt, max_new_tokens, ignore_eos=False, **kw)
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    return sim.done[1]


def test_regex_and_json_outputs_match_and_end_with_eos(llama):
    model_dir, shard = llama
    prompt = prompts(model_dir, [12])[0]
    out = run_alone(shard, prompt, 60, grammar=regex_grammar())
    assert re.fullmatch(REGEX, out.finished.text), out.finished.text
    assert out.finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    out = run_alone(shard, prompt, 80, grammar=json_grammar())
    assert out.finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN, out.finished.text
    jsonschema.validate(json.loads(out.finished.text), SCHEMA)


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llama):
    model_dir, shard = llama
    p1, p2, p3 = prompts(model_dir, [10, 14, 9])
    alone = run_alone(shard, p2, 24).generated
    sim = fresh(shard)
    sim.add(1, p1, 40, ignore_eos=False, grammar=regex_grammar())
    sim.add(2, p2, 24, ignore_eos=False)
    sim.add(3, p3, 60, ignore_eos=False, grammar=json_grammar())
    sim.prefill([(1, 0), (2, 0), (3, 0)])
    sim.run_to_completion()
    assert sim.done[2].generated == alone
    assert re.fullmatch(REGEX, sim.done[1].finished.text)
    jsonschema.validate(json.loads(sim.done[3].finished.text), SCHEMA)


def test_recompute_after_preemption_replays_the_matcher(llama):
    model_dir, shard = llama
    prompt = prompts(model_dir, [11])[0]
    full = run_alone(shard, prompt, 60, grammar=json_grammar())
    sim = fresh(shard)
    sim.add(1, prompt, 60, ignore_eos=False, grammar=json_grammar())
    sim.prefill([(1, 0)])
    for _ in range(5):
        sim.decode()
    before = list(sim.requests[1].generated)
    sim.filter([])  # preempted
    sim.add(2, prompt + before, 60, ignore_eos=False, generated_len=len(before),
            grammar=json_grammar())
    sim.prefill([(2, 8)])  # chunked: the grammar rides along with every chunk
    sim.prefill([(2, 0)])
    sim.run_to_completion()
    again = sim.done[2]
    assert before + again.generated == full.generated
    assert again.finished.text == full.finished.text


def test_ignore_eos_still_ends_a_complete_grammar_and_length_cuts_it(llama):
    model_dir, shard = llama
    prompt = prompts(model_dir, [12])[0]
    sim = fresh(shard)
    sim.add(1, prompt, 60, ignore_eos=True, grammar=regex_grammar())
    sim.add(2, prompt, 3, ignore_eos=False, grammar=json_grammar())
    sim.prefill([(1, 0), (2, 0)])
    sim.run_to_completion()
    assert sim.done[1].finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert re.fullmatch(REGEX, sim.done[1].finished.text)
    assert sim.done[2].finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert sim.done[2].finished.text.startswith("{")


def test_stop_sequences_apply_to_constrained_output(llama):
    model_dir, shard = llama
    prompt = prompts(model_dir, [12])[0]
    out = run_alone(shard, prompt, 60, grammar=json_grammar(), stop_sequences=('"n"',))
    assert out.finished.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert out.finished.text.endswith('"n"')


def test_a_bad_grammar_is_refused_before_any_state_changes(llama):
    _, shard = llama
    sim = fresh(shard)
    sim.add(1, [5, 6, 7], 8, grammar=pb.OutputGrammar(kind="regex", source="(["))
    with pytest.raises(InvalidRequestError, match="grammar"):
        sim.prefill([(1, 0)])
    assert shard.engine.requests == {}


def test_the_mask_is_filled_while_the_forward_pass_runs(llama, monkeypatch):
    model_dir, shard = llama
    engine = shard.engine
    seen: dict[str, bool] = {}
    fill = GrammarEngine._fill
    execute = engine.runner.execute
    started, forward_running = threading.Event(), threading.Event()

    def slow_execute(inputs):
        forward_running.set()
        started.wait(5)  # the fill must start while the forward pass is still running
        seen["fill_during_forward"] = started.is_set()
        return execute(inputs)

    def watched_fill(self, rows, bitmask):
        forward_running.wait(5)
        started.set()
        return fill(self, rows, bitmask)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    monkeypatch.setattr(GrammarEngine, "_fill", watched_fill)
    run_alone(shard, prompts(model_dir, [8])[0], 4, grammar=regex_grammar())
    assert seen["fill_during_forward"]
