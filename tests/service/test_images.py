"""The router's image inputs without a model: which addresses an image URL may reach, data URLs,
TGI's markdown images, and OpenAI image_url parts decoded into messages."""

from __future__ import annotations

import base64
import json

import pytest
from tokenwire.v1 import openai_pb2 as opb

from service.api import anthropic_json, openai_convert, openai_json, responses_json
from service.generation.errors import ValidationError
from service.generation.images.fetch import address_allowed, image_bytes
from service.generation.images.markdown import markdown_images
from service.generation.images.refs import ImageError, ImageLimits, ImageRef, ImageTooLargeError

DEFAULT = ImageLimits()


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "10.0.0.1", "172.16.3.4", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1%eth0", "fd00::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1",
])
def test_private_loopback_and_reserved_addresses_are_refused_by_default(address):
    assert not address_allowed(address, DEFAULT)
    assert address_allowed(address, ImageLimits(allow_private=True))


def test_public_addresses_pass_and_allowed_networks_open_exactly_themselves():
    assert address_allowed("8.8.8.8", DEFAULT) and address_allowed("2606:4700::1111", DEFAULT)
    limits = ImageLimits(allowed_networks=("10.1.2.0/24",))
    assert address_allowed("10.1.2.200", limits)
    assert not address_allowed("10.1.3.1", limits) and not address_allowed("127.0.0.1", limits)


async def test_literal_loopback_urls_are_refused_before_any_connection():
    for url in ("http://127.0.0.1:1/a.png", "http://[::1]:1/a.png", "https://10.0.0.1/a.png"):
        with pytest.raises(ImageError, match=r"^m\.image_url: .* a private, loopback"):
            await image_bytes(ImageRef("m.image_url", url=url), DEFAULT)


async def test_data_urls():
    png = b"\x89PNG\r\n\x1a\nrest"
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert await image_bytes(ImageRef("f", url=url), DEFAULT) == png
    with pytest.raises(ImageTooLargeError, match="--max-image-bytes"):
        await image_bytes(ImageRef("f", url=url), ImageLimits(max_bytes=4))
    for bad, says in [("data:image/png;base64,@@@", "base64 payload is invalid"),
                      ("data:image/png,raw", "must be data:image"),
                      ("data:image/gif;base64,AAAA", "unsupported image type 'image/gif'"),
                      ("file:///etc/passwd", "scheme 'file'")]:
        with pytest.raises(ImageError, match=says):
            await image_bytes(ImageRef("f", url=bad), DEFAULT)


def test_markdown_images_become_image_tokens_in_order():
    text, refs = markdown_images("a ![x](http://h/1.png) b ![](data:image/png;base64,AA==)c",
                                 "<image>")
    assert text == "a <image> b <image>c"
    assert [(r.field, r.url) for r in refs] == [
        ("inputs.images[0]", "http://h/1.png"), ("inputs.images[1]", "data:image/png;base64,AA==")]
    assert markdown_images("no images [here](x)", "<image>") == ("no images [here](x)", ())


def test_openai_image_parts_decode_with_their_place_in_the_text():
    body = (b'{"model": "m", "messages": [{"role": "user", "content": ['
            b'{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "u1"}},'
            b'{"type": "text", "text": "cd"}, {"type": "image_url", "image_url": "u2"}]}]}')
    message = openai_json.chat_request(body).messages[0]
    assert message.content == "abcd"
    assert [(at, r.field, r.url) for at, r in message.images] == [
        (2, "messages[0].content[1].image_url", "u1"),
        (4, "messages[0].content[3].image_url", "u2")]
    with pytest.raises(ValidationError, match=r"content\[0\]: only text and image_url parts"):
        openai_json.chat_request(b'{"model": "m", "messages": [{"role": "user", "content": '
                                 b'[{"type": "input_audio"}]}]}')


def test_typed_grpc_content_parts_decode_as_the_rest_parts():
    # The same conversation as REST's content list and as the typed ChatMessage.content_parts:
    # the same text and image offsets; errors name content_parts.
    text, image = opb.ChatContentPart, opb.ChatImageUrl

    def typed(role: str, *parts: opb.ChatContentPart, content: str = "") -> list[object]:
        request = opb.ChatRequest(model="m", messages=[
            opb.ChatMessage(role=role, content=content, content_parts=list(parts))])
        message = openai_convert.chat_request(request, stream=False).messages[0]
        return [message.content, [(at, r.field, r.url) for at, r in message.images]]

    assert typed("user", text(text="ab"), text(image_url=image(url="u1")), text(text="cd"),
                 text(image_url=image(url="u2"))) == ["abcd", [
        (2, "messages[0].content_parts[1].image_url", "u1"),
        (4, "messages[0].content_parts[3].image_url", "u2")]]
    assert typed("user", text(text="plain")) == ["plain", []]
    with pytest.raises(ValidationError, match=r"content_parts\[0\]\.image_url: an image_url "
                                              r"part needs"):
        typed("user", text(image_url=image(url="")))
    with pytest.raises(ValidationError, match=r"content_parts: image parts are accepted in user"):
        typed("assistant", text(image_url=image(url="u")))
    with pytest.raises(ValidationError, match=r"content_parts\[0\]: a content part needs"):
        typed("user", text())
    with pytest.raises(ValidationError, match=r"messages\[0\]: set content or content_parts"):
        typed("user", text(text="x"), content="y")


def _one(messages: object) -> tuple[str, list[tuple[int, str, str]]]:
    (message,) = messages  # type: ignore[misc]
    return message.content, [(at, r.field, r.url) for at, r in message.images]


def test_responses_input_image_parts_decode_as_chat_image_parts():
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "ab"}, {"type": "input_image", "image_url": "u1",
                                               "detail": "auto"},
        {"type": "input_text", "text": "cd"}]}]}
    decoded = responses_json.create_request(json.dumps(body).encode())
    assert _one(decoded.request.chat.messages) == (
        "abcd", [(2, "input[0].content[1].image_url", "u1")])
    bad = {**body, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}
    with pytest.raises(ValidationError, match=r"input\[0\]\.content\[0\]\.image_url: an image_url"):
        responses_json.create_request(json.dumps(bad).encode())
    bad["input"][0]["content"][0]["file_id"] = "file-1"  # type: ignore[index]
    with pytest.raises(ValidationError, match=r"content\[0\]: file_id images are not supported"):
        responses_json.create_request(json.dumps(bad).encode())
    bad = {**body, "input": [{"role": "assistant", "content": [
        {"type": "input_image", "image_url": "u"}]}]}
    with pytest.raises(ValidationError, match=r"input\[0\]\.content: image parts are accepted"):
        responses_json.create_request(json.dumps(bad).encode())


def test_anthropic_image_blocks_decode_as_chat_image_parts():
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ab"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}},
        {"type": "image", "source": {"type": "url", "url": "https://h/x.png"}}]}]}
    decoded = anthropic_json.messages_request(json.dumps(body).encode())
    assert _one(decoded.chat.messages) == ("ab", [
        (2, "messages[0].content[1].source", "data:image/png;base64,AA=="),
        (2, "messages[0].content[2].source", "https://h/x.png")])
    for source, says in [({"type": "file", "file_id": "f"}, r"content\[0\]\.source\.type must"),
                         ({"type": "base64", "data": "AA=="}, r"needs string media_type"),
                         ({"type": "url"}, r"content\[0\]\.source: an image_url part needs")]:
        bad = {**body, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}]}]}
        with pytest.raises(ValidationError, match=says):
            anthropic_json.messages_request(json.dumps(bad).encode())
    bad = {**body, "messages": [{"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "u"}}]}]}
    with pytest.raises(ValidationError, match=r"must be one of text, tool_use, thinking"):
        anthropic_json.messages_request(json.dumps(bad).encode())
