"""Acceptance cases for the installed Python SDK, run by tests/sdk/test_python_sdk.py inside a
fresh virtualenv that holds only the `tokenwire-client` wheel and its dependencies (so: stdlib and
the SDK only here, no pytest).

    python python_cases.py TARGET README.md OUT.json
    ->  OUT.json: {"outcomes": {case: null | "failure text"}, "observed": {name: value}}

Also runs every ```python block of the SDK's README, with "localhost:50051" replaced by TARGET,
and records what each printed. "observed" holds what the SDK returned for greedy requests and
the README's printed output; the pytest side compares them with raw gRPC calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import sys
import time
import traceback
from collections.abc import Awaitable, Callable

import tokenwire_client as tw

PROMPT = "The quick brown fox"
# What the SDK returned, for tests/sdk/test_python_sdk.py to compare with raw gRPC calls.
OBSERVED: dict[str, object] = {}


def greedy_result(response: tw.GenerateResponse) -> dict[str, object]:
    assert response.details is not None
    return {
        "text": response.generated_text,
        "ids": [t.id for t in response.details.tokens],
        "finish_reason": response.details.finish_reason,
    }


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


# ---- sync client ---------------------------------------------------------------------------


def sync_generate(target: str) -> None:
    with tw.Client(target, timeout=60) as client:
        response = client.generate(PROMPT, max_new_tokens=5, details=True, temperature=0)
    check(isinstance(response, tw.GenerateResponse), f"type {type(response)}")
    OBSERVED["sync_generate"] = greedy_result(response)
    check(isinstance(response.generated_text, str), "generated_text is a str")
    check(response.details is not None, "details present")
    check(response.details.generated_tokens == len(response.details.tokens), "token count")
    check(1 <= response.details.generated_tokens <= 5, f"{response.details.generated_tokens}")
    check(response.details.finish_reason in {"length", "eos_token", "stop_sequence"}, "reason")


def sync_stream_cancel(target: str) -> None:
    with tw.Client(target, timeout=60) as client:
        events = []
        with client.generate_stream(PROMPT, max_new_tokens=40, temperature=0) as stream:
            for event in stream:
                check(isinstance(event, tw.GenerateStreamResponse), f"type {type(event)}")
                check(event.token is not None, "token present")
                events.append(event)
                if len(events) == 2:
                    stream.cancel()
        check(len(events) == 2, f"stream stopped after cancel: {len(events)} events")
        check([e.index for e in events] == [0, 1], "indices")
        # A full stream on the same client still works after the cancel.
        full = list(client.generate_stream(PROMPT, max_new_tokens=3, temperature=0))
        check(full[-1].generated_text is not None, "last event carries generated_text")
        OBSERVED["sync_stream"] = {
            "text": full[-1].generated_text,
            "ids": [e.token.id for e in full],
            "finish_reason": full[-1].details.finish_reason if full[-1].details else None,
        }


def sync_validation_error(target: str) -> None:
    with tw.Client(target, timeout=60) as client:
        try:
            client.generate(PROMPT, max_new_tokens=5, top_p=1.5)
        except tw.ValidationError as error:
            check(error.code == "INVALID_ARGUMENT", error.code)
            check("top_p" in error.message, f"message names the field: {error.message}")
        else:
            raise AssertionError("top_p=1.5 was accepted")
        try:
            for _ in client.generate_stream("", max_new_tokens=5):
                pass
        except tw.ValidationError as error:
            check("inputs" in error.message, f"message names the field: {error.message}")
        else:
            raise AssertionError("empty inputs were accepted on the stream")


def sync_deadline(target: str) -> None:
    with tw.Client(target) as client:
        started = time.monotonic()
        try:
            client.generate(PROMPT, max_new_tokens=50, timeout=0.001)
        except tw.DeadlineExceededError as error:
            check(isinstance(error, TimeoutError), "also a TimeoutError")
        else:
            raise AssertionError("a 1 ms deadline was met")
        check(time.monotonic() - started < 10, "deadline returned promptly")
        try:
            for _ in client.generate_stream(PROMPT, max_new_tokens=50, timeout=0.001):
                pass
        except tw.DeadlineExceededError:
            pass
        else:
            raise AssertionError("a 1 ms stream deadline was met")


def sync_info(target: str) -> None:
    with tw.Client(target, timeout=30) as client:
        info = client.info()
    check(isinstance(info, tw.InfoResponse), f"type {type(info)}")
    check(info.version == tw.__version__, f"server {info.version} vs sdk {tw.__version__}")
    check(info.router == "tokenwire-router", info.router)
    check(info.max_total_tokens > 0, "max_total_tokens")


def sync_health(target: str) -> None:
    with tw.Client(target, timeout=30) as client:
        check(client.health() is True, "healthy")
    # Nothing listens on port 1: not an exception, just not healthy.
    with tw.Client("127.0.0.1:1", timeout=5) as client:
        check(client.health() is False, "unreachable server is not healthy")


# ---- async client --------------------------------------------------------------------------


async def async_generate(target: str) -> None:
    async with tw.AsyncClient(target, timeout=60) as client:
        response = await client.generate(PROMPT, max_new_tokens=5, details=True, temperature=0)
        # Two concurrent calls share the connection.
        both = await asyncio.gather(
            client.generate(PROMPT, max_new_tokens=2), client.generate(PROMPT, max_new_tokens=3)
        )
    check(isinstance(response, tw.GenerateResponse), f"type {type(response)}")
    OBSERVED["async_generate"] = greedy_result(response)
    OBSERVED["async_concurrent_texts"] = [r.generated_text for r in both]
    check(response.details is not None, "details present")
    check(1 <= response.details.generated_tokens <= 5, f"{response.details.generated_tokens}")
    check(all(isinstance(r.generated_text, str) for r in both), "concurrent calls answered")


async def async_stream_cancel(target: str) -> None:
    async with tw.AsyncClient(target, timeout=60) as client:
        events = []
        async with client.generate_stream(PROMPT, max_new_tokens=40, temperature=0) as stream:
            async for event in stream:
                events.append(event)
                if len(events) == 2:
                    await stream.cancel()
        check(len(events) == 2, f"stream stopped after cancel: {len(events)} events")
        full = [e async for e in client.generate_stream(PROMPT, max_new_tokens=3)]
        check(full[-1].generated_text is not None, "last event carries generated_text")


async def async_validation_error(target: str) -> None:
    async with tw.AsyncClient(target, timeout=60) as client:
        try:
            await client.generate(PROMPT, max_new_tokens=5, top_p=1.5)
        except tw.ValidationError as error:
            check("top_p" in error.message, f"message names the field: {error.message}")
        else:
            raise AssertionError("top_p=1.5 was accepted")
        try:
            async for _ in client.generate_stream("", max_new_tokens=5):
                pass
        except tw.ValidationError as error:
            check("inputs" in error.message, f"message names the field: {error.message}")
        else:
            raise AssertionError("empty inputs were accepted on the stream")


async def async_deadline(target: str) -> None:
    async with tw.AsyncClient(target) as client:
        try:
            await client.generate(PROMPT, max_new_tokens=50, timeout=0.001)
        except tw.DeadlineExceededError:
            pass
        else:
            raise AssertionError("a 1 ms deadline was met")
        try:
            async for _ in client.generate_stream(PROMPT, max_new_tokens=50, timeout=0.001):
                pass
        except tw.DeadlineExceededError:
            pass
        else:
            raise AssertionError("a 1 ms stream deadline was met")
        # The client is still usable after a deadline.
        check(await client.health(), "healthy after a deadline")


async def async_info(target: str) -> None:
    async with tw.AsyncClient(target, timeout=30) as client:
        info = await client.info()
    check(info.version == tw.__version__, f"server {info.version} vs sdk {tw.__version__}")
    check(info.max_total_tokens > 0, "max_total_tokens")


async def async_health(target: str) -> None:
    async with tw.AsyncClient(target, timeout=30) as client:
        check(await client.health() is True, "healthy")
    async with tw.AsyncClient("127.0.0.1:1", timeout=5) as client:
        check(await client.health() is False, "unreachable server is not healthy")


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def sync_chat(target: str) -> None:
    with tw.Client(target, timeout=60) as client:
        reply = client.chat(CHAT, max_tokens=5, temperature=0)
        check(isinstance(reply, tw.ChatResponse), f"type {type(reply)}")
        check(reply.object == "chat.completion", reply.object)
        choice = reply.choices[0]
        check(choice.message.role == "assistant", choice.message.role)
        check(choice.finish_reason in {"stop", "length"}, choice.finish_reason)
        check(reply.usage.completion_tokens <= 5, f"{reply.usage}")
        chunks = list(client.chat_stream(CHAT, max_tokens=5, temperature=0, include_usage=True))
        check(all(isinstance(c, tw.ChatStreamResponse) for c in chunks), "chunk types")
        check(chunks[0].choices[0].delta.role == "assistant", "first chunk carries the role")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        check(text == choice.message.content, f"stream {text!r} != unary {choice.message.content!r}")
        check(chunks[-1].usage is not None and not chunks[-1].choices, "usage chunk last")
        done = client.completion(PROMPT, max_tokens=3, temperature=0)
        check(isinstance(done, tw.CompletionResponse), f"type {type(done)}")
        streamed = client.completion_stream(PROMPT, max_tokens=3, temperature=0)
        check("".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text,
              "completion stream equals completion")  # fmt: skip
        try:
            client.chat(CHAT, model="gpt-4o", max_tokens=2)
        except tw.TokenwireError as error:
            check(error.code == "NOT_FOUND", error.code)
        else:
            raise AssertionError("an unknown model was accepted")


async def async_chat(target: str) -> None:
    async with tw.AsyncClient(target, timeout=60) as client:
        reply = await client.chat(CHAT, max_tokens=5, temperature=0)
        check(isinstance(reply, tw.ChatResponse), f"type {type(reply)}")
        text = ""
        async for chunk in client.chat_stream(CHAT, max_tokens=5, temperature=0):
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        check(text == reply.choices[0].message.content, f"{text!r}")
        done = await client.completion(PROMPT, max_tokens=3, temperature=0)
        check(done.usage.completion_tokens <= 3, f"{done.usage}")


RESPONSE = {"model": "tgi", "input": PROMPT, "max_output_tokens": 4, "temperature": 0}
MESSAGE = {"model": "tgi", "max_tokens": 4, "temperature": 0,
           "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip


def _output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])  # fmt: skip


def sync_agents(target: str) -> None:
    with tw.Client(target, timeout=60) as client:
        response = client.responses_create(RESPONSE)
        check(response["object"] == "response" and response["id"].startswith("resp_"), "object")
        events = list(client.responses_stream(RESPONSE))
        check(events[0]["type"] == "response.created", events[0]["type"])
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        check(deltas == _output_text(response), f"stream {deltas!r} != unary")
        check(client.responses_retrieve(response["id"])["id"] == response["id"], "retrieve")
        check(client.responses_delete(response["id"])["deleted"] is True, "delete")
        try:
            client.responses_retrieve(response["id"])
        except tw.NotFoundError:
            pass
        else:
            raise AssertionError("a deleted response was found")
        message = client.messages_create(MESSAGE)
        check(message["type"] == "message", message["type"])
        streamed = list(client.messages_stream(MESSAGE))
        check([streamed[0]["type"], streamed[-1]["type"]] == ["message_start", "message_stop"],
              "message events")  # fmt: skip
        text = "".join(e["delta"]["text"] for e in streamed if e["type"] == "content_block_delta")
        check(text == message["content"][0]["text"], f"{text!r}")
        counted = client.messages_count_tokens({k: MESSAGE[k] for k in ("model", "messages")})
        check(counted["input_tokens"] == message["usage"]["input_tokens"], f"{counted}")
        try:
            client.messages_create({**MESSAGE, "max_tokens": 0})
        except tw.ValidationError as error:
            check("max_tokens" in str(error), str(error))
        else:
            raise AssertionError("max_tokens 0 was accepted")


async def async_agents(target: str) -> None:
    async with tw.AsyncClient(target, timeout=60) as client:
        response = await client.responses_create(RESPONSE)
        deltas = "".join([e["delta"] async for e in client.responses_stream(RESPONSE)
                          if e["type"] == "response.output_text.delta"])  # fmt: skip
        check(deltas == _output_text(response), f"{deltas!r}")
        check((await client.responses_retrieve(response["id"]))["id"] == response["id"], "get")
        message = await client.messages_create(MESSAGE)
        kinds = [e["type"] async for e in client.messages_stream(MESSAGE)]
        check(kinds[-1] == "message_stop", f"{kinds}")
        counted = await client.messages_count_tokens({"model": "tgi", "messages": MESSAGE["messages"]})
        check(counted["input_tokens"] == message["usage"]["input_tokens"], f"{counted}")


def packaging(target: str) -> None:
    import importlib.util

    # Nothing but tokenwire_client at top level: the generated google/ must not shadow google.*.
    spec = importlib.util.find_spec("tokenwire_client._generated.google.protobuf")
    check(spec is not None, "generated google package lives inside tokenwire_client")
    check(importlib.util.find_spec("google") is None, "no top-level google package installed")
    check(importlib.util.find_spec("tokenwire") is None, "no top-level tokenwire package")


# ---- runner --------------------------------------------------------------------------------

SYNC_CASES: dict[str, Callable[[str], None]] = {
    f.__name__: f
    for f in (
        sync_generate,
        sync_stream_cancel,
        sync_validation_error,
        sync_deadline,
        sync_info,
        sync_health,
        sync_chat,
        sync_agents,
        packaging,
    )
}
ASYNC_CASES: dict[str, Callable[[str], Awaitable[None]]] = {
    f.__name__: f
    for f in (
        async_generate,
        async_stream_cancel,
        async_validation_error,
        async_deadline,
        async_info,
        async_health,
        async_chat,
        async_agents,
    )
}


def readme_blocks(readme: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)


def _outcome(run: Callable[[], object]) -> str | None:
    try:
        run()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        return traceback.format_exc()
    return None


def main() -> None:
    target, readme_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    results: dict[str, str | None] = {}
    for name, case in SYNC_CASES.items():
        results[name] = _outcome(lambda case=case: case(target))
    for name, acase in ASYNC_CASES.items():
        results[name] = _outcome(lambda acase=acase: asyncio.run(acase(target)))
    with open(readme_path, encoding="utf-8") as readme:
        blocks = readme_blocks(readme.read())
    for i, block in enumerate(blocks):
        code = block.replace("localhost:50051", target)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            results[f"readme_example_{i}"] = _outcome(
                lambda code=code, i=i: exec(compile(code, f"README[{i}]", "exec"), {})  # noqa: S102
            )
        OBSERVED[f"readme_example_{i}"] = printed.getvalue()
    with open(out_path, "w", encoding="utf-8") as out:
        json.dump({"outcomes": results, "observed": OBSERVED}, out)


if __name__ == "__main__":
    main()
