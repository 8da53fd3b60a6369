"""The prompt text of a request, as the endpoint picker receives it from Envoy's ext_proc filter.

Behind tokenwire's own gateway the picker runs after the JSON transcoder, so every request is
gRPC: a length-prefixed protobuf message on a `tokenwire.v1` method path. Behind another gateway
(an inference gateway in Kubernetes) it sees the client's JSON on REST paths. Both are read here;
what has no prompt (Info, Health, model lists) answers None and is placed by load alone.

The text only needs to be stable across requests that share a prefix (the prefix index hashes
it), not to equal the model's rendered prompt: chat messages are joined as "role: content" lines.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from google.api.httpbody_pb2 import HttpBody
from google.protobuf.message import DecodeError
from tokenwire.v1 import generate_pb2, openai_pb2

_TEXT_GENERATION = "/tokenwire.v1.TextGeneration/"
_OPENAI = "/tokenwire.v1.OpenAIService/"
_GRPC_HEADER = struct.Struct(">BI")  # compressed flag, message length


def grpc_message(body: bytes) -> bytes | None:
    """The first message of a gRPC-framed body (None when the body is not one, or compressed)."""
    if len(body) < _GRPC_HEADER.size:
        return None
    compressed, length = _GRPC_HEADER.unpack_from(body)
    if compressed or len(body) < _GRPC_HEADER.size + length:
        return None
    return body[_GRPC_HEADER.size : _GRPC_HEADER.size + length]


def prompt_text(path: str, body: bytes) -> str | None:
    """The prompt of the request at `path` (query string ignored) with body `body`, or None."""
    path = path.split("?", 1)[0]
    try:
        if path.startswith(_TEXT_GENERATION):
            return _grpc_prompt(path.removeprefix(_TEXT_GENERATION), body)
        if path.startswith(_OPENAI):
            return _grpc_openai_prompt(path.removeprefix(_OPENAI), body)
        if path in ("/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions"):
            return _json_prompt(json.loads(body or b"{}"))
    except (DecodeError, ValueError, UnicodeDecodeError):
        return None
    return None


def _grpc_prompt(method: str, body: bytes) -> str | None:
    if method not in ("Generate", "GenerateStream"):
        return None
    message = grpc_message(body)
    if message is None:
        return None
    return generate_pb2.GenerateRequest.FromString(message).inputs or None


def _grpc_openai_prompt(method: str, body: bytes) -> str | None:
    message = grpc_message(body)
    if message is None:
        return None
    if method in ("Chat", "ChatStream"):
        chat = openai_pb2.ChatRequest.FromString(message)
        return _chat_text((m.role, m.content) for m in chat.messages)
    if method in ("Completion", "CompletionStream"):
        return openai_pb2.CompletionRequest.FromString(message).prompt or None
    if method in ("ChatCompletions", "Completions"):
        return _json_prompt(json.loads(HttpBody.FromString(message).data or b"{}"))
    return None


def _json_prompt(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    for key in ("inputs", "prompt"):
        value = data.get(key)
        if isinstance(value, str):
            return value or None
    messages = data.get("messages")
    if isinstance(messages, list):
        pairs = []
        for m in messages:
            if isinstance(m, dict):
                pairs.append((str(m.get("role", "")), _content_text(m.get("content"))))
        return _chat_text(pairs)
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


def _chat_text(pairs: Any) -> str | None:
    text = "".join(f"{role}: {content}\n" for role, content in pairs)
    return text or None
