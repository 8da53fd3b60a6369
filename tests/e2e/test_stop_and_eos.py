"""Stop sequences and EOS through the public API: a real router in front of a real shard serving
the tiny llama trained on the progression task (shard/tiny_training.py), whose greedy
continuations are known in advance (confident predictions, not near-ties).

The task never leads the model to the tokenizer's `</s>`, so the model directory used here
declares one of the task's tokens, `}` (the band's last id), as an EOS token the way real
checkpoints do: `eos_token_id` in generation_config.json and a special added token in
tokenizer.json. A prompt that counts up to it makes the model emit it for real.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from shard.tools.tiny_training import TASK, task_continuation, task_prompt
from tests.helpers.models import trained_tiny_model
from tests.helpers.processes import Deployment, start_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EOS_OFFSET = TASK.modulus - 1  # `}`: the last token of the band
EOS_ID = TASK.base + EOS_OFFSET


def with_task_token_as_eos(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose EOS ids are `</s>` and EOS_ID (a special added token)."""
    shutil.copytree(model_dir, out_dir)
    gen_path = out_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], EOS_ID]
    gen_path.write_text(json.dumps(gen))
    tok_path = out_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    content = Tokenizer.from_file(str(tok_path)).id_to_token(EOS_ID)
    tok["added_tokens"].append(
        {
            "id": EOS_ID,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    tok_path.write_text(json.dumps(tok))
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trained = trained_tiny_model(tmp_path_factory, "llama")
    return with_task_token_as_eos(trained, tmp_path_factory.mktemp("eos-model") / "model")


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start_deployment(model_dir, tmp_path_factory.mktemp("stop-eos"))
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def prompt_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text whose encoding is exactly `ids` (BOS, then task tokens)."""
    text = tokenizer.decode(ids[1:])
    assert tokenizer.encode(text).ids == ids, (ids, text)
    return text


def generate(deployment: Deployment, inputs: str, **params: object) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        inputs=inputs, parameters=pb.GenerateParameters(details=True, **params)
    )
    with grpc.insecure_channel(deployment.target) as channel:
        return generate_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=60)


def stream(
    deployment: Deployment, inputs: str, **params: object
) -> list[pb.GenerateStreamResponse]:
    request = pb.GenerateRequest(
        inputs=inputs, parameters=pb.GenerateParameters(details=True, **params)
    )
    with grpc.insecure_channel(deployment.target) as channel:
        return list(
            generate_pb2_grpc.TextGenerationStub(channel).GenerateStream(request, timeout=60)
        )


def test_generation_ends_at_the_first_occurrence_of_a_stop_sequence(
    deployment: Deployment, tokenizer: Tokenizer
) -> None:
    # Stride 2 from an even offset: even offsets only, so EOS (odd offset) never comes; the
    # 16-term cycle repeats within 24 tokens, so every stop sequence occurs twice.
    ids = task_prompt(8, stride=2, start=0)
    inputs = prompt_text(tokenizer, ids)
    full = generate(deployment, inputs, max_new_tokens=24)
    expected_ids = task_continuation(ids, 24)
    assert [t.id for t in full.details.tokens] == expected_ids  # the trained greedy path
    texts = [t.text for t in full.details.tokens]
    # Two tokens' text (the match spans a token boundary), its first occurrence ends at token 5.
    stop = texts[4] + texts[5]
    assert full.generated_text.count(stop) == 2, (full.generated_text, stop)
    assert full.generated_text.find(stop) == len("".join(texts[:4]))
    want = "".join(texts[:6])

    reply = generate(deployment, inputs, max_new_tokens=24, stop=[stop, "never-there"])
    assert reply.details.finish_reason == "stop_sequence"
    assert reply.generated_text == want and reply.generated_text.endswith(stop)
    assert reply.details.generated_tokens == 6
    assert [t.id for t in reply.details.tokens] == expected_ids[:6]

    events = stream(deployment, inputs, max_new_tokens=24, stop=[stop])
    assert len(events) == 6 and events[-1].details.finish_reason == "stop_sequence"
    assert "".join(e.token.text for e in events) == events[-1].generated_text == want


def test_eos_token_ends_generation_and_is_not_in_the_text(
    deployment: Deployment, tokenizer: Tokenizer
) -> None:
    # Stride 3 from offset 1 ("_behknq", a prompt that tokenizes back to these ids): the 4th
    # generated token is EOS (offsets 22, 25, 28, 31).
    ids = task_prompt(8, stride=3, start=1)
    assert EOS_ID not in ids
    inputs = prompt_text(tokenizer, ids)
    expected_ids = task_continuation(ids, 4)
    assert expected_ids[-1] == EOS_ID

    reply = generate(deployment, inputs, max_new_tokens=20)
    assert reply.details.finish_reason == "eos_token"
    assert [t.id for t in reply.details.tokens] == expected_ids
    assert reply.details.generated_tokens == 4
    eos = reply.details.tokens[-1]
    assert eos.special and not any(t.special for t in reply.details.tokens[:-1])
    assert reply.generated_text == tokenizer.decode(expected_ids[:-1])
    assert tokenizer.id_to_token(EOS_ID) not in reply.generated_text

    events = stream(deployment, inputs, max_new_tokens=20)
    assert [e.token.id for e in events] == expected_ids
    assert events[-1].token.special and events[-1].details.finish_reason == "eos_token"
    assert "".join(e.token.text for e in events if not e.token.special) == reply.generated_text

    # A length limit at the EOS position still reports eos_token: the model's own end wins
    # (shard/stopping.py).
    at_limit = generate(deployment, inputs, max_new_tokens=4)
    assert at_limit.details.finish_reason == "eos_token"
