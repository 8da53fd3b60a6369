"""Idefics3 end to end: the official `openai` client (unchanged) against the real Envoy in front
of a real `tokenwire launch` serving a tiny random Idefics3 (tiles: Idefics3Processor's
expansion of each image), two data-URL images of different tile grids in one message; the text
equals transformers' greedy output on the same prompt, and so do typed gRPC image parts. Too
many images and too many pixels are the same 400 as for the other families, naming the content
part, and the server serves on."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from tokenwire.v1 import generate_pb2 as gpb
from tokenwire.v1 import generate_pb2_grpc as gpb_grpc

from tests.helpers.http_api import http_json
from tests.helpers.processes import Deployment, launch
from tests.helpers.vision import Idefics3Reference, encoded, tiny_idefics3

pytestmark = pytest.mark.slow

N = 6  # max_tokens of every request
SPECS = [(1, 80, 30), (2, 40, 30)]  # (seed, width, height): 3 and 5 tiles


def data_url(seed: int, width: int, height: int) -> str:
    png = encoded(seed, width=width, height=height)
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def image_part(seed: int, width: int = 40, height: int = 30) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed, width, height)}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_idefics3(tmp_path_factory)


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Deployment]:
    dep = launch(tmp_path_factory.mktemp("idefics3"), "--model-id", str(model_dir),
                 "--dtype", "float32", "--kv-cache-memory-mb", "16", "--max-total-tokens", "256",
                 "--max-images-per-request", "2", "--max-image-pixels", "2400", timeout=300.0)
    yield dep
    assert dep.stop() == 0, dep.log()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{deployment.envoy_target}/v1", api_key="none",
                         max_retries=0)


def _content(client: openai.OpenAI, parts: list[dict]) -> str:
    out = client.chat.completions.create(model="tgi", max_tokens=N, temperature=0,
                                         messages=[{"role": "user", "content": parts}])
    return out.choices[0].message.content or ""


def test_openai_client_with_two_images_matches_transformers(client, model_dir):
    ref = Idefics3Reference(model_dir)
    # ChatML (the tiny model's template renders no image parts): the router writes each image
    # as <image> at its place, the processor expands it; no BOS
    prompt = ("<|im_start|>user\nfirst <image> then <image> which<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = ref.greedy(prompt, SPECS, N, add_special_tokens=False)
    # (the last tokens end inside a UTF-8 character: the router, like decode, writes U+FFFD)
    want = ref.processor.tokenizer.decode(ids, skip_special_tokens=True)
    got = _content(client, [{"type": "text", "text": "first "}, image_part(*SPECS[0]),
                            {"type": "text", "text": " then "}, image_part(*SPECS[1]),
                            {"type": "text", "text": " which"}])
    assert got == want


def test_grpc_image_parts_match_transformers(deployment, model_dir):
    """Typed gRPC parts: the router writes <image> at the part's place, with BOS."""
    ref = Idefics3Reference(model_dir)
    want = ref.greedy("look <image> here", [SPECS[0]], N)
    with grpc.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        stub = gpb_grpc.TextGenerationStub(channel)
        reply = stub.Generate(gpb.GenerateRequest(
            input_chunks=[gpb.InputChunk(text="look "),
                          gpb.InputChunk(image=gpb.ImagePart(data=encoded(1, width=80,
                                                                          height=30))),
                          gpb.InputChunk(text=" here")],
            parameters=gpb.GenerateParameters(max_new_tokens=N, details=True)), timeout=60)
    assert [t.id for t in reply.details.tokens] == want


@pytest.mark.parametrize(("parts", "says"), [
    ([image_part(0), image_part(1), image_part(2)],
     "messages: 3 images; at most 2 per request (--max-images-per-request)"),
    ([{"type": "text", "text": "big "}, image_part(3, 81, 30)],
     "messages[0].content[1].image_url: the image has 81x30 = 2430 pixels; at most 2400"),
])
def test_over_limit_images_are_400_naming_the_part(client, deployment, parts, says):
    with pytest.raises(openai.BadRequestError) as err:
        _content(client, parts)
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    assert says in message, message
    assert _content(client, [image_part(0)]) != ""  # still serving
    assert http_json(deployment.http_port, "GET", "/health")[0] == 200
