"""Qwen2-VL end to end: the official `openai` client (unchanged) against the real Envoy in front
of a real `tokenwire launch` serving a tiny random Qwen2-VL, two data-URL images of different
sizes in one message (dynamic resolution, M-RoPE), and TGI markdown images on /generate; the
text equals transformers' greedy output on the same prompt."""

from __future__ import annotations

import base64
from pathlib import Path

import openai
import pytest

from shard.tools.tiny_vlm import QWEN_IMAGE, write_tiny_qwen2_vl
from tests.helpers.http_api import http_json
from tests.helpers.processes import launch
from tests.helpers.vision import QwenReference, encoded

pytestmark = pytest.mark.slow

N = 6  # max_tokens of every request
SPECS = [(1, 84, 56), (2, 56, 56)]  # (seed, width, height): 6 and 4 placeholder tokens


def data_url(seed: int, width: int, height: int) -> str:
    png = encoded(seed, width=width, height=height)
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def test_openai_client_and_tgi_markdown_with_two_images(tmp_path: Path) -> None:
    model_dir = write_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    ref = QwenReference(model_dir)
    # ChatML (the tiny model's template renders no image parts): the router writes each image
    # as <|vision_start|><|image_pad|><|vision_end|> at its place; no BOS
    prompt = (f"<|im_start|>user\nfirst {QWEN_IMAGE} then {QWEN_IMAGE} which<|im_end|>\n"
              "<|im_start|>assistant\n")
    # (the router withholds a token's incomplete UTF-8 bytes where decode writes U+FFFD)
    want = ref.tok.decode(ref.greedy(prompt, SPECS, N, add_special_tokens=False),
                          skip_special_tokens=True).replace("\ufffd", "")
    urls = [data_url(*s) for s in SPECS]
    dep = launch(tmp_path / "run", "--model-id", str(model_dir), "--dtype", "float32",
                 "--kv-cache-memory-mb", "16", "--max-total-tokens", "256", timeout=300.0)
    try:
        client = openai.OpenAI(base_url=f"http://{dep.envoy_target}/v1", api_key="none",
                               max_retries=0)
        out = client.chat.completions.create(model="tgi", max_tokens=N, temperature=0,
                                             messages=[{"role": "user", "content": [
            {"type": "text", "text": "first "},
            {"type": "image_url", "image_url": {"url": urls[0]}},
            {"type": "text", "text": " then "},
            {"type": "image_url", "image_url": {"url": urls[1]}},
            {"type": "text", "text": " which"},
        ]}])
        assert out.choices[0].message.content == want
        # TGI's /generate with markdown images, each written as the image's token text
        status, _, body = http_json(dep.http_port, "POST", "/generate", {
            "inputs": "first ![]({}) then ![]({}) which".format(*urls),
            "parameters": {"max_new_tokens": N, "details": True}})
        assert status == 200, body
        assert [t["id"] for t in body["details"]["tokens"]] == ref.greedy(  # type: ignore[index]
            f"first {QWEN_IMAGE} then {QWEN_IMAGE} which", SPECS, N)
    finally:
        assert dep.stop() == 0, dep.log()
