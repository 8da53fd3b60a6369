"""Tokens coalesced for a client that falls behind: `tokenwire router` (one process, and
`--frontends 2`) over the fake shard, read over real gRPC on loopback by a deliberately slow
client whose HTTP/2 window is small (so the server's writes wait for it and tokens queue up).

- GenerateStream with `parameters.coalesce_tokens`: fewer events than tokens; the tokens listed
  in the events (`coalesced`), their ids and concatenated text, equal a fast reader's one-token
  events exactly; `index` is the last token's position.
- GenerateStream without it: one event per token, however slow the reader.
- ChatStream / CompletionStream (coalescing by default): fewer chunks than tokens; the
  concatenated content (and, for chat, the logprobs entries) equal a fast reader's.

The slow reader takes its first message, then waits until the fake shard has generated the
stream's last token before reading on: every token past the client's HTTP/2 window is then queued
in the router, however slow a loaded machine makes the router (no race between the reader's
pace and the router's). `--frontend-backlog-steps` is raised so that a front end holds a whole
stream without pausing the engine (at the default 8 steps the engine would stop, by design,
until the reader caught up, and the shard would never reach the last token).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc, openai_pb2, openai_pb2_grpc

from service.testing import FakeShard, FakeShardConfig, start_fake_shard
from tests.helpers.ports import free_port
from tests.helpers.processes import terminate_popen

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
N = 150  # tokens per stream
# The slow client's HTTP/2 stream window: a few dozen small messages, no BDP growth.
SLOW_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.http2.lookahead_bytes", 1024),
    ("grpc.http2.bdp_probe", 0),
]
SLOW_READ_S = 0.01  # the slow client's pause after each message


@dataclass
class Server:
    port: int
    fast: grpc.aio.Channel
    slow: grpc.aio.Channel
    shard: FakeShard


@contextlib.asynccontextmanager
async def _deploy(tokenizer_dir: Path, template: Path, frontends: int) -> AsyncIterator[Server]:
    shard_server, shard, shard_url = await start_fake_shard(
        FakeShardConfig(num_blocks=512, block_size=16, step_delay_s=0.001)
    )
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - fixture setup
        [sys.executable, "-m", "service.app.cli", "router", "--frontends", str(frontends),
         "--shard-address", shard_url, "--tokenizer", str(tokenizer_dir),
         "--chat-template", str(template), "--port", str(port),
         "--max-input-tokens", "64", "--max-total-tokens", "256", "--log-level", "WARNING",
         "--frontend-backlog-steps", str(4 * N)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'gen' / 'python'}"},
    )  # fmt: skip
    fast = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    slow = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=SLOW_OPTIONS)
    try:
        for chan in (fast, slow):  # the front end of each connection is up
            health = health_pb2_grpc.HealthStub(chan)
            for _ in range(300):
                assert proc.poll() is None, "the router exited"
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                await asyncio.sleep(0.1)
        yield Server(port, fast, slow, shard)
    finally:
        await fast.close()
        await slow.close()
        terminate_popen(proc)
        await shard_server.stop(None)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    return path


@pytest.fixture(params=[1, 2], ids=["one-process", "frontends-2"])
def frontends(request: pytest.FixtureRequest) -> Iterator[int]:
    yield request.param


def _generate(coalesce: bool, seed: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        inputs=f"a prompt for the coalescing test {seed}",
        parameters=pb.GenerateParameters(
            max_new_tokens=N, seed=seed, details=True, top_n_tokens=2, coalesce_tokens=coalesce
        ),
    )


async def _read(call: object, slow: bool) -> list[object]:
    out = []
    async for message in call:  # type: ignore[attr-defined]
        out.append(message)
        if slow:
            await asyncio.sleep(SLOW_READ_S)
    return out


async def _read_behind(server: Server, call: object) -> list[object]:
    """The slow reader: one message, then nothing until the shard has generated all N tokens
    of this stream (so the rest waits in the router), then slow reads to the end."""
    target = server.shard.generated_tokens + N  # one stream at a time on this fake shard
    messages = aiter(call)  # type: ignore[call-overload]
    out = [await anext(messages)]
    for _ in range(6000):  # <= 60 s; the shard makes a token per ~1 ms step
        if server.shard.generated_tokens >= target:
            break
        await asyncio.sleep(0.01)
    assert server.shard.generated_tokens >= target, "the shard stopped before the stream's end"
    out.extend(await _read(messages, slow=True))
    return out


async def _check_generate_stream(server: Server) -> None:
    fast = generate_pb2_grpc.TextGenerationStub(server.fast)
    slow = generate_pb2_grpc.TextGenerationStub(server.slow)
    reference = await _read(fast.GenerateStream(_generate(False, 7)), slow=False)
    assert len(reference) == N and all(not e.HasField("coalesced") for e in reference)
    want_ids = [e.token.id for e in reference]
    want_text = "".join(e.token.text for e in reference)

    # Opted in, slow reader: several tokens per event, the same tokens and text.
    events = await _read_behind(server, slow.GenerateStream(_generate(True, 7)))
    assert len(events) < N * 0.75, f"{len(events)} events for {N} tokens: nothing coalesced"
    assert [t.id for e in events for t in e.coalesced.tokens] == want_ids
    assert "".join(t.text for e in events for t in e.coalesced.tokens) == want_text
    assert [len(e.coalesced.top_tokens) for e in events] == [
        len(e.coalesced.tokens) for e in events
    ]
    assert [x.tokens[0].id for e in events for x in e.coalesced.top_tokens] == [
        e.top_tokens[0].id for e in reference
    ]
    position = -1
    for e in events:  # index: the position of the event's last token (= `token`)
        position += len(e.coalesced.tokens)
        assert e.index == position and e.token == e.coalesced.tokens[-1]
    assert position == N - 1
    assert events[-1].generated_text == reference[-1].generated_text
    assert events[-1].details.generated_tokens == N

    # Not opted in, the same slow reader: one token per event (TGI's clients expect it).
    events = await _read_behind(server, slow.GenerateStream(_generate(False, 7)))
    assert len(events) == N and all(not e.HasField("coalesced") for e in events)
    assert [e.token.id for e in events] == want_ids
    assert [e.index for e in events] == list(range(N))


async def _check_openai_streams(server: Server) -> None:
    fast = openai_pb2_grpc.OpenAIServiceStub(server.fast)
    slow = openai_pb2_grpc.OpenAIServiceStub(server.slow)
    chat = openai_pb2.ChatRequest(
        model="tgi",
        messages=[openai_pb2.ChatMessage(role="user", content="tell me about coalescing")],
        max_tokens=N, seed=3, logprobs=True, top_logprobs=1,
    )  # fmt: skip
    reference = await _read(fast.ChatStream(chat), slow=False)
    chunks = await _read_behind(server, slow.ChatStream(chat))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    want = [c for c in reference if c.choices and c.choices[0].delta.content]
    assert want  # the tokens have texts (an empty reference would compare nothing)
    assert len(content) < N * 0.75, f"{len(content)} chunks for {N} tokens: nothing coalesced"
    assert "".join(c.choices[0].delta.content for c in content) == "".join(
        c.choices[0].delta.content for c in want
    )
    logprobs = [(e.token, e.logprob) for c in chunks if c.choices
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert logprobs == [(e.token, e.logprob) for c in want for e in c.choices[0].logprobs.content]
    assert len(logprobs) == N
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    completion = openai_pb2.CompletionRequest(
        model="tgi", prompt="complete this coalescing prompt", max_tokens=N, seed=5
    )
    reference = await _read(fast.CompletionStream(completion), slow=False)
    chunks = await _read_behind(server, slow.CompletionStream(completion))
    text = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(text) < N * 0.75, f"{len(text)} chunks for {N} tokens: nothing coalesced"
    assert "".join(text) == "".join(c.choices[0].text for c in reference if c.choices)


async def test_slow_reader_gets_coalesced_messages(
    wide_tokenizer_dir: Path, template: Path, frontends: int
) -> None:
    # Every fake token has a text with this tokenizer, whoever detokenizes (router or shard).
    async with _deploy(wide_tokenizer_dir, template, frontends) as server:
        await _check_generate_stream(server)
        await _check_openai_streams(server)
