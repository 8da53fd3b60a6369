"""Images end to end: the official `openai` client (unchanged) against the real Envoy in front of
a real `tokenwire launch` serving a tiny random LLaVA, with transformers as the reference. Images
come as data URLs (PNG, JPEG, WebP), as http URLs served by a local test server on 127.0.0.2
(reached through a redirect; the deployment allows exactly that address with
--allow-image-networks 127.0.0.2/32), as TGI markdown on /generate, as typed gRPC parts, and through the installed Python SDK (its
image parts in generate and its OpenAI-shaped content lists in chat, over the typed gRPC chat).
Every refused image is a 400 (413 for size) naming its content part, and the server serves
normally after each. Loopback URLs outside the allowed network are refused as by default: an
IP literal, a host name (`localhost`, checked at resolution) and a redirect to one."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anthropic
import grpc
import openai
import pytest
from tokenwire.v1 import generate_pb2 as gpb
from tokenwire.v1 import generate_pb2_grpc as gpb_grpc

from tests.helpers.http_api import http_json
from tests.helpers.processes import Deployment, launch, run_checked
from tests.helpers.python_sdk import sdk_venv, shared_wheel
from tests.helpers.typescript_sdk import install, shared_tarball
from tests.helpers.vision import HfReference, encoded, tiny_llava

pytestmark = pytest.mark.slow

N = 6  # max_tokens of every request
PNG0 = encoded(0)
IMAGES = {"/a.png": (PNG0, "image/png"), "/note.txt": (b"hello", "text/plain")}
REDIRECTS = {"/moved": "/a.png", "/to-loopback": "http://localhost:{port}/a.png",
             "/loop": "/loop"}
ALLOWED = "127.0.0.2"  # the image server's address, the one private address allowed


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def chat(url: str, text: str = "what is in ") -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " tell me"},
    ]}]


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path in REDIRECTS:  # redirects the router follows
            self.send_response(302)
            self.send_header("Location", REDIRECTS[self.path].format(port=self.server.server_port))
            self.end_headers()
            return
        if self.path not in IMAGES:
            self.send_error(404)
            return
        body, media = IMAGES[self.path]
        self.send_response(200)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer((ALLOWED, 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{ALLOWED}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llava(tmp_path_factory)


def _launch(tmp: Path, model_dir: Path, *extra: str) -> Deployment:
    return launch(tmp, "--model-id", str(model_dir), "--dtype", "float32",
                  "--kv-cache-memory-mb", "16", "--max-total-tokens", "256", *extra,
                  timeout=300.0)


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Deployment]:
    dep = _launch(tmp_path_factory.mktemp("vision"), model_dir,
                  "--allow-image-networks", f"{ALLOWED}/32",
                  "--max-images-per-request", "2", "--max-image-pixels", "10000",
                  "--max-image-bytes", "60000", "--max-image-redirects", "2")
    yield dep
    assert dep.stop() == 0, dep.log()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{deployment.envoy_target}/v1", api_key="none",
                         max_retries=0)


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> HfReference:
    return HfReference(model_dir)


def _want(ref: HfReference, messages: list[dict], seeds: list[int]) -> str:
    """transformers' greedy text for the chat, rendered as the router renders it (ChatML, no
    BOS: the template's text is tokenized without special tokens)."""
    text = "".join(p.get("text", "<image>") for p in messages[0]["content"])
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    ids = ref.greedy(prompt, seeds, N, add_special_tokens=False)
    return ref.processor.tokenizer.decode(ids, skip_special_tokens=True)


def _content(client: openai.OpenAI, messages: list[dict]) -> str:
    out = client.chat.completions.create(model="tgi", messages=messages, max_tokens=N,
                                         temperature=0)
    return out.choices[0].message.content or ""


def test_data_url_and_http_url_match_transformers(client, ref, image_server):
    messages = chat(data_url(PNG0))
    want = _want(ref, messages, [0])
    assert _content(client, messages) == want
    # The same image fetched over http (through a redirect): the same answer.
    assert _content(client, chat(f"{image_server}/moved")) == want
    # JPEG and WebP data URLs, two images in one message.
    two = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(encoded(1, "JPEG"), "image/jpeg")}},
        {"type": "text", "text": " or "},
        {"type": "image_url", "image_url": {"url": data_url(encoded(2, "WEBP"), "image/webp")}},
    ]}]
    assert _content(client, two) != ""


@pytest.mark.parametrize(
    ("url", "status", "says"),
    [
        (data_url(b"not an image at all"), 400, "could not be decoded"),
        ("data:image/gif;base64,R0lGODdhAQABAAAAACw=", 400, "unsupported image type"),
        (data_url(encoded(5, width=120, height=100)), 400, "--max-image-pixels"),
        (data_url(encoded(6, width=200, height=200)), 413, "--max-image-bytes"),
        ("{server}/missing.png", 400, "HTTP 404"),
        ("{server}/note.txt", 400, "content type 'text/plain'"),
        ("ftp://example.com/a.png", 400, "scheme 'ftp'"),
        ("{server}/loop", 400, "more than 2 redirects"),
        # Loopback outside the allowed network: refused as every private address is by default.
        ("{loopback}/a.png", 400, "resolves to 127.0.0.1, a private, loopback"),
        ("{localhost}/a.png", 400, "a private, loopback"),
        ("{server}/to-loopback", 400, "a private, loopback"),
    ],
)
def test_refused_images_name_the_part_and_the_server_stays_healthy(
        client, deployment, image_server, url, status, says):
    port = image_server.rsplit(":", 1)[1]
    url = url.format(server=image_server, loopback=f"http://127.0.0.1:{port}",
                     localhost=f"http://localhost:{port}")
    with pytest.raises(openai.APIStatusError) as err:
        _content(client, chat(url))
    assert err.value.status_code == status
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    assert "messages[0].content[1].image_url" in message and says in message, message
    assert _content(client, chat(data_url(PNG0))) != ""  # still serving
    assert http_json(deployment.http_port, "GET", "/health")[0] == 200


def test_too_many_images(client):
    parts = [{"type": "image_url", "image_url": {"url": data_url(encoded(i))}} for i in range(3)]
    with pytest.raises(openai.BadRequestError, match=r"3 images; at most 2"):
        _content(client, [{"role": "user", "content": parts}])


def test_tgi_markdown_and_grpc_image_parts(deployment, ref):
    prompt = "look ![](" + data_url(PNG0) + ") here"
    status, _, body = http_json(deployment.http_port, "POST", "/generate", {
        "inputs": prompt, "parameters": {"max_new_tokens": N, "details": True}})
    assert status == 200, body
    want = ref.greedy("look <image> here", [0], N)
    assert [t["id"] for t in body["details"]["tokens"]] == want
    with grpc.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        stub = gpb_grpc.TextGenerationStub(channel)
        reply = stub.Generate(gpb.GenerateRequest(
            input_chunks=[gpb.InputChunk(text="look "),
                          gpb.InputChunk(image=gpb.ImagePart(data=PNG0)),
                          gpb.InputChunk(text=" here")],
            parameters=gpb.GenerateParameters(max_new_tokens=N, details=True)), timeout=60)
    assert [t.id for t in reply.details.tokens] == want


@pytest.fixture(scope="module")
def sdk_run(deployment: Deployment, image_server: str,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """vision_sdk_cases.py's report, run with the `tokenwire-client` wheel in a fresh venv (from
    an empty folder: nothing of this repository is importable there)."""
    work = tmp_path_factory.mktemp("vision-sdk")
    python = sdk_venv(shared_wheel(tmp_path_factory), work)
    png = work / "a.png"
    png.write_bytes(PNG0)
    out = work / "results.json"
    run_checked([python, Path(__file__).with_name("vision_sdk_cases.py"), deployment.target,
                 deployment.envoy_target, png, image_server, out],
                cwd=work, env={"PATH": "/usr/bin:/bin"}, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["sync_generate", "sync_chat", "sync_errors", "async_generate"])
def test_python_sdk_case(sdk_run, case):
    assert sdk_run["outcomes"][case] is None, sdk_run["outcomes"][case]


@pytest.fixture(scope="module")
def markdown_ids(deployment: Deployment) -> list[int]:
    """The token ids of "look <image> here" sent as TGI markdown on /generate (which
    test_tgi_markdown_and_grpc_image_parts checks against transformers)."""
    status, _, body = http_json(deployment.http_port, "POST", "/generate", {
        "inputs": "look ![](" + data_url(PNG0) + ") here",
        "parameters": {"max_new_tokens": N, "details": True}})
    assert status == 200, body
    return [t["id"] for t in body["details"]["tokens"]]


def test_python_sdk_image_prompts_equal_tgi_markdown(sdk_run, markdown_ids):
    """Every way the SDK takes an image (path, Image, bytes, ImagePart, http URL; sync, async,
    streamed, through Envoy) gives the token ids of the same prompt as TGI markdown."""
    want = markdown_ids
    seen = sdk_run["observed"]
    names = ["sync_generate_path", "sync_generate_from_file", "sync_generate_bytes",
             "sync_generate_image_part_url", "sync_generate_http_url", "sync_stream",
             "envoy_generate", "async_generate", "async_stream"]
    assert {name: seen[name] for name in names} == dict.fromkeys(names, want)
    # Parts of another type: a TypeError naming the part, before anything is sent.
    assert [e.split(" must")[0] for e in seen["type_errors"]] == [
        "inputs[1]", "inputs", "inputs", "messages[0].content[0].type",
        "messages[0].content[1].image_url.url"]


def test_python_sdk_chat_content_lists_equal_the_openai_client(sdk_run, client):
    """The SDK's chat (typed gRPC, content_parts) answers what the official openai client gets
    for the same OpenAI-shaped content list over REST."""
    want = _content(client, chat(data_url(PNG0)))
    assert want != ""
    seen = sdk_run["observed"]
    assert [seen["sync_chat"], seen["sync_chat_stream"], seen["async_chat"]] == [want] * 3


def test_typescript_sdk_images(deployment, image_server, markdown_ids, client,
                               tmp_path_factory: pytest.TempPathFactory):
    """vision_ts_cases.mjs with the `npm pack` tarball installed in a throwaway project: image
    prompts equal the TGI markdown tokens, OpenAI-shaped chat content lists equal the openai
    client's reply, bad images and bad parts are refused naming the part."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed for the TypeScript SDK")
    work = tmp_path_factory.mktemp("vision-ts")
    project = install(shared_tarball(tmp_path_factory), work / "project")
    shutil.copy(Path(__file__).with_name("vision_ts_cases.mjs"), project / "vision.test.mjs")
    png = work / "a.png"
    png.write_bytes(PNG0)
    env = {**os.environ, "TOKENWIRE_URL": f"http://{deployment.target}",
           "TOKENWIRE_ENVOY_URL": f"http://{deployment.envoy_target}", "TOKENWIRE_PNG": str(png),
           "TOKENWIRE_IMAGE_SERVER": image_server, "TOKENWIRE_EXPECTED": json.dumps(
               {"ids": markdown_ids, "chat": _content(client, chat(data_url(PNG0)))})}
    done = subprocess.run(["node", "--test", "--test-reporter=tap", "vision.test.mjs"],
                          cwd=project, env=env, capture_output=True, text=True, check=False,
                          timeout=240)
    summary = dict(re.findall(r"^# (pass|fail|skipped) (\d+)$", done.stdout, flags=re.MULTILINE))
    assert done.returncode == 0 and summary == {"pass": "4", "fail": "0", "skipped": "0"}, (
        done.stdout + done.stderr)


@pytest.fixture(scope="module")
def claude(deployment: Deployment) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://{deployment.envoy_target}", api_key="none",
                               max_retries=0)


def test_responses_and_messages_images_answer_as_chat_does(client, claude, image_server):
    """The official `openai` client's Responses `input_image` parts and the `anthropic` client's
    image blocks (base64 and url sources) give chat's greedy reply to the same conversation."""
    want = _content(client, chat(data_url(PNG0)))
    b64 = base64.b64encode(PNG0).decode()
    for url in (data_url(PNG0), f"{image_server}/a.png"):
        out = client.responses.create(model="tgi", max_output_tokens=N, temperature=0, input=[
            {"role": "user", "content": [
                {"type": "input_text", "text": "what is in "},
                {"type": "input_image", "image_url": url, "detail": "auto"},
                {"type": "input_text", "text": " tell me"}]}])
        assert out.output_text == want
    for source in ({"type": "base64", "media_type": "image/png", "data": b64},
                   {"type": "url", "url": f"{image_server}/a.png"}):
        # temperature through extra_body: this anthropic release's create() has no such argument
        reply = claude.messages.create(model="tgi", max_tokens=N, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": [
                                           {"type": "text", "text": "what is in "},
                                           {"type": "image", "source": source},
                                           {"type": "text", "text": " tell me"}]}])
        assert "".join(b.text for b in reply.content if b.type == "text") == want


def test_responses_and_messages_refused_images_name_the_part(client, claude, image_server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="tgi", max_output_tokens=2, input=[{"role": "user",
            "content": [{"type": "input_image", "image_url": data_url(b"not an image")}]}])
    assert bad.value.param == "input[0].content[0].image_url"
    assert "could not be decoded" in bad.value.message
    with pytest.raises(anthropic.BadRequestError) as bad_claude:
        claude.messages.create(model="tgi", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "x"},
            {"type": "image", "source": {"type": "url", "url": f"{image_server}/missing.png"}}]}])
    assert bad_claude.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1].source" in bad_claude.value.message
    assert "HTTP 404" in bad_claude.value.message
    with pytest.raises(anthropic.BadRequestError, match=r"unsupported image type .image/gif."):
        claude.messages.create(model="tgi", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/gif",
                                         "data": "R0lGODdhAQABAAAAACw="}}]}])
