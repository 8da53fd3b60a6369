"""Image inputs through the installed Python SDK, run by tests/e2e/test_vision_e2e.py inside a
fresh virtualenv that holds only the `tokenwire-client` wheel (stdlib and the SDK only here).

    python vision_sdk_cases.py TARGET ENVOY_TARGET IMAGE.png IMAGE_SERVER_URL OUT.json
    ->  OUT.json: {"outcomes": {case: null | "failure text"}, "observed": {name: value}}

"observed" holds the token ids and texts the SDK returned; the pytest side compares them with
the same requests sent as TGI markdown and through the official `openai` client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

import tokenwire_client as tw

N = 6  # max tokens of every request (test_vision_e2e.N)
OBSERVED: dict[str, object] = {}


def ids(response: tw.GenerateResponse) -> list[int]:
    assert response.details is not None
    return [t.id for t in response.details.tokens]


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def data_url(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()


def chat_parts(url: str) -> list[dict[str, object]]:
    """test_vision_e2e.chat's content: text, the image, text."""
    return [{"type": "text", "text": "what is in "}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": " tell me"}]


def sync_generate(target: str, envoy: str, png: Path, server: str) -> None:
    greedy = {"max_new_tokens": N, "details": True}
    with tw.Client(target, timeout=60) as client:
        # The same image as a file path, the helper over a file, bytes, the generated ImagePart
        # with a data URL, and an http URL the router fetches: one answer.
        for name, image in [
            ("path", png),
            ("from_file", tw.Image.from_file(png)),
            ("bytes", png.read_bytes()),
            ("image_part_url", tw.ImagePart(url=data_url(png))),
            ("http_url", tw.Image.from_url(f"{server}/a.png")),
        ]:
            OBSERVED[f"sync_generate_{name}"] = ids(client.generate(["look ", image, " here"],
                                                                    **greedy))
        with client.generate_stream(["look ", tw.Image.from_file(png), " here"],
                                    max_new_tokens=N) as stream:
            OBSERVED["sync_stream"] = [event.token.id for event in stream]
    with tw.Client(envoy, timeout=60) as client:  # Envoy passes gRPC through
        OBSERVED["envoy_generate"] = ids(client.generate(["look ", png, " here"], **greedy))


def sync_chat(target: str, envoy: str, png: Path, server: str) -> None:
    with tw.Client(target, timeout=60) as client:
        reply = client.chat([{"role": "user", "content": chat_parts(data_url(png))}],
                            max_tokens=N, temperature=0)
        OBSERVED["sync_chat"] = reply.choices[0].message.content
        # An Image in the content list is sent as a data URL: the same answer.
        content = chat_parts("")
        content[1] = tw.Image.from_file(png)
        chunks = client.chat_stream([{"role": "user", "content": content}], max_tokens=N,
                                    temperature=0)
        OBSERVED["sync_chat_stream"] = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices)


def sync_errors(target: str, envoy: str, png: Path, server: str) -> None:
    with tw.Client(target, timeout=60) as client:
        try:
            client.generate(["look ", b"not an image", " here"], max_new_tokens=2)
        except tw.ValidationError as error:
            check("input_chunks[1].image" in str(error) and "could not be decoded" in str(error),
                  str(error))
        else:
            raise AssertionError("an undecodable image was accepted")
        try:
            client.chat([{"role": "user", "content": chat_parts(f"{server}/missing.png")}],
                        max_tokens=2)
        except tw.ValidationError as error:
            check("messages[0].content_parts[1].image_url" in str(error)
                  and "HTTP 404" in str(error), str(error))
        else:
            raise AssertionError("a missing image URL was accepted")
        for bad in ({"image": "x"}, 3.5, b"raw bytes are not a prompt"):
            try:
                client.generate(["a", bad] if isinstance(bad, dict) else bad)  # type: ignore[arg-type]
            except TypeError as error:
                OBSERVED.setdefault("type_errors", []).append(str(error))  # type: ignore[union-attr]
            else:
                raise AssertionError(f"{bad!r} was accepted as a prompt")
        for content in ([{"type": "input_audio"}], ["ok", {"type": "image_url", "image_url": {}}]):
            try:
                client.chat([{"role": "user", "content": content}], max_tokens=2)
            except TypeError as error:
                OBSERVED.setdefault("type_errors", []).append(str(error))  # type: ignore[union-attr]
            else:
                raise AssertionError(f"{content!r} was accepted as chat content")
        # The server still serves.
        check(len(ids(client.generate(["look ", png, " here"], max_new_tokens=N,
                                      details=True))) == N, "no answer after the errors")


async def async_generate(target: str, envoy: str, png: Path, server: str) -> None:
    async with tw.AsyncClient(target, timeout=60) as client:
        reply = await client.generate(["look ", tw.Image.from_file(png), " here"],
                                      max_new_tokens=N, details=True)
        OBSERVED["async_generate"] = ids(reply)
        stream = client.generate_stream(["look ", png.read_bytes(), " here"], max_new_tokens=N)
        OBSERVED["async_stream"] = [event.token.id async for event in stream]
        chat = await client.chat([{"role": "user", "content": chat_parts(data_url(png))}],
                                 max_tokens=N, temperature=0)
        OBSERVED["async_chat"] = chat.choices[0].message.content


CASES: dict[str, Callable[[str, str, Path, str], object]] = {
    "sync_generate": sync_generate,
    "sync_chat": sync_chat,
    "sync_errors": sync_errors,
    "async_generate": async_generate,
}


def main() -> None:
    target, envoy, png, server, out = sys.argv[1:6]
    outcomes: dict[str, str | None] = {}
    for name, case in CASES.items():
        try:
            result = case(target, envoy, Path(png), server)
            if isinstance(result, Awaitable):
                asyncio.run(result)  # type: ignore[arg-type]
            outcomes[name] = None
        except BaseException:  # noqa: BLE001 - every failure is reported to the pytest side
            outcomes[name] = traceback.format_exc()
    Path(out).write_text(json.dumps({"outcomes": outcomes, "observed": OBSERVED}))


if __name__ == "__main__":
    main()
