// Unit tests of @tokenwire/client against an in-process fake TextGeneration server (Connect-ES's
// node adapter speaking gRPC over HTTP/2 cleartext). They cover what a healthy real server does not
// show: API keys, in-band stream errors, overload, and that leaving a stream early reaches the
// server. No TOKENWIRE_URL needed.
import assert from "node:assert/strict";
import http2 from "node:http2";
import { once } from "node:events";
import { after, before, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import { Code, ConnectError } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import {
  createClient,
  GenerationError,
  OverloadedError,
  TextGeneration,
  UnauthenticatedError,
} from "@tokenwire/client";

const API_KEY = "s3cret";
const state = { auth: [], cancelled: 0, healthy: true };

function check(request, context) {
  const auth = context.requestHeader.get("authorization");
  state.auth.push(auth);
  if (auth !== `Bearer ${API_KEY}`) throw new ConnectError("missing or wrong API key", Code.Unauthenticated);
  if (request.inputs === "busy") throw new ConnectError("too many requests in flight", Code.ResourceExhausted);
  return request.parameters?.maxNewTokens ?? 5;
}

const impl = {
  async generate(request, context) {
    const n = check(request, context);
    return { generatedText: " tok".repeat(n) };
  },
  async *generateStream(request, context) {
    const n = check(request, context);
    for (let i = 0; i < n; i++) {
      await sleep(10);
      if (context.signal.aborted) {
        state.cancelled += 1;
        return;
      }
      if (request.inputs === "fail" && i === 1) {
        yield { index: i, error: "shard 0 died", errorType: "generation" };
        return;
      }
      yield { index: i, token: { id: i, text: " tok" }, generatedText: i === n - 1 ? " tok".repeat(n) : undefined };
    }
  },
  async info() {
    return { modelId: "fake", version: "0.1.0" };
  },
  async health() {
    if (!state.healthy) throw new ConnectError("warming up", Code.Unavailable);
    return {};
  },
};

let server;
let url;
before(async () => {
  server = http2.createServer(connectNodeAdapter({ routes: (router) => router.service(TextGeneration, impl) }));
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  url = `http://127.0.0.1:${server.address().port}`;
});
after(() => server.close());

test("sends the API key; without it the call is UnauthenticatedError", async () => {
  const client = createClient(url, { apiKey: API_KEY, timeoutMs: 10_000 });
  try {
    assert.equal((await client.generate("hi", { maxNewTokens: 2 })).generatedText, " tok tok");
    assert.equal(state.auth.at(-1), `Bearer ${API_KEY}`);
  } finally {
    client.close();
  }
  const anonymous = createClient(url);
  try {
    await assert.rejects(anonymous.generate("hi"), UnauthenticatedError);
  } finally {
    anonymous.close();
  }
});

test("typed errors: overload, in-band stream failure, unhealthy", async () => {
  const client = createClient(url, { apiKey: API_KEY });
  try {
    await assert.rejects(client.generate("busy"), (error) => error instanceof OverloadedError && /in flight/.test(error.message));
    const events = [];
    await assert.rejects(
      (async () => {
        for await (const event of client.generateStream("fail", { max_new_tokens: 5 })) events.push(event);
      })(),
      (error) => error instanceof GenerationError && error.rawMessage === "shard 0 died",
    );
    assert.equal(events.length, 1);
    state.healthy = false;
    assert.equal(await client.health(), false);
    state.healthy = true;
    assert.equal((await client.info()).modelId, "fake");
    await assert.rejects(client.generate("hi", { maxTokens: 3 }), TypeError);
  } finally {
    client.close();
  }
});

test("leaving a stream early cancels it on the server", async () => {
  const client = createClient(url, { apiKey: API_KEY, timeoutMs: 10_000 });
  try {
    const before = state.cancelled;
    for await (const event of client.generateStream("hi", { maxNewTokens: 500 })) {
      assert.equal(event.index, 0);
      break;
    }
    for (let i = 0; i < 100 && state.cancelled === before; i++) await sleep(20);
    assert.equal(state.cancelled, before + 1, "the server never saw the cancellation");
  } finally {
    client.close();
  }
});
