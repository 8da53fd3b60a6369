"""A stand-in for `python -m vllm.entrypoints.openai.api_server` in harness tests (no vLLM here):
the same command line, GET /health, and POST /v1/completions streaming SSE chunks shaped as
vLLM 0.26's (`text_completion` chunks, usage in every chunk with continuous_usage_stats, a final
usage-only chunk, `data: [DONE]`).

Run as `python tests/helpers/fake_vllm_server.py -m vllm.entrypoints.openai.api_server --model
DIR --port P ...` (a fake interpreter script passes its arguments on). Each request body is
appended as one JSON line to $FAKE_VLLM_BODIES. Prompts steer the replies:
- containing "tokens-per-chunk-2": two tokens per chunk (vLLM's --stream-interval 2);
- containing "reject": HTTP 400 with vLLM's error body;
- containing "fail-mid-stream": an error event after the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from aiohttp import web


def _chunk(text: str, finish: str | None, prompt_tokens: int, done: int) -> bytes:
    body = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "bench",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                      "total_tokens": prompt_tokens + done}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _record(body: dict) -> None:
    with open(os.environ["FAKE_VLLM_BODIES"], "a") as f:
        f.write(json.dumps(body) + "\n")


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    await asyncio.to_thread(_record, body)
    prompt, n = body["prompt"], int(body["max_tokens"])
    if "reject" in prompt:
        return web.json_response({"error": {"message": "This model's maximum context length is "
                                            "4096 tokens", "type": "BadRequestError",
                                            "param": None, "code": 400}}, status=400)
    per = 2 if "tokens-per-chunk-2" in prompt else 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    p_tokens = len(prompt.split())
    done = 0
    while done < n:
        step = min(per, n - done)
        done += step
        finish = "length" if done == n else None
        await resp.write(_chunk(" t7" * step, finish, p_tokens, done))
        if "fail-mid-stream" in prompt:
            err = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            break
        await asyncio.sleep(0)
    usage = {"prompt_tokens": p_tokens, "completion_tokens": done, "total_tokens": p_tokens + done}
    await resp.write(b"data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion",
                                             "choices": [], "usage": usage}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(_: web.Request) -> web.Response:
    return web.Response(text="")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", dest="module", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    args, extra = p.parse_known_args(argv)
    if args.module != "vllm.entrypoints.openai.api_server" or args.dtype != "bfloat16":
        sys.exit(f"unexpected command line: {argv}")
    print("extra engine args:", extra, flush=True)
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main(sys.argv[1:])
