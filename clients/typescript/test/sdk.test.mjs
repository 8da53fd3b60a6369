// Cases of the TypeScript SDK against a live tokenwire server at $TOKENWIRE_URL (e.g.
// http://127.0.0.1:50051, or Envoy's port). tests/sdk/test_typescript_sdk.py runs this file from a
// temporary project that installed the `npm pack` tarball; `npm test` runs it against this folder
// (the package imports itself by name).
import assert from "node:assert/strict";
import { after, describe, test } from "node:test";

import {
  createClient,
  DeadlineExceededError,
  CancelledError,
  NotFoundError,
  TokenwireError,
  ValidationError,
  VERSION,
} from "@tokenwire/client";

const url = process.env.TOKENWIRE_URL;
const PROMPT = "The quick brown fox";
// What raw gRPC calls (no SDK) answered for the same greedy requests, set by
// tests/sdk/test_typescript_sdk.py: {generate: {text, ids, finish_reason}, stream3: {...}}.
const expected = process.env.TOKENWIRE_EXPECTED ? JSON.parse(process.env.TOKENWIRE_EXPECTED) : undefined;
const noExpected = expected === undefined && "TOKENWIRE_EXPECTED not set";

describe(`@tokenwire/client against ${url}`, { skip: url === undefined && "TOKENWIRE_URL not set" }, () => {
  const client = createClient(url ?? "http://127.0.0.1:1", { timeoutMs: 60_000 });
  after(() => client.close());

  test("generate", async () => {
    const response = await client.generate(PROMPT, { maxNewTokens: 5, details: true, temperature: 0 });
    assert.equal(typeof response.generatedText, "string");
    assert.ok(response.details, "details present");
    assert.equal(response.details.generatedTokens, response.details.tokens.length);
    assert.ok(response.details.generatedTokens >= 1 && response.details.generatedTokens <= 5);
    assert.ok(["length", "eos_token", "stop_sequence"].includes(response.details.finishReason));
  });

  test("generate equals a raw gRPC call", { skip: noExpected }, async () => {
    const response = await client.generate(PROMPT, { maxNewTokens: 5, details: true, temperature: 0 });
    assert.deepEqual(
      { text: response.generatedText, ids: response.details.tokens.map((t) => t.id), finish_reason: response.details.finishReason },
      expected.generate,
    );
  });

  test("generateStream equals a raw gRPC stream", { skip: noExpected }, async () => {
    const events = [];
    for await (const event of client.generateStream(PROMPT, { maxNewTokens: 3, temperature: 0, details: true })) events.push(event);
    assert.deepEqual(
      { text: events.at(-1).generatedText, ids: events.map((e) => e.token.id), finish_reason: events.at(-1).details.finishReason },
      expected.stream3,
    );
  });

  test("chat and chatStream (the server runs with --chat-template)", async () => {
    const messages = [
      { role: "system", content: "Be brief." },
      { role: "user", content: PROMPT },
    ];
    const reply = await client.chat(messages, { maxTokens: 5, temperature: 0 });
    assert.equal(reply.object, "chat.completion");
    assert.equal(reply.choices[0].message.role, "assistant");
    assert.ok(["stop", "length"].includes(reply.choices[0].finishReason));
    const chunks = [];
    for await (const chunk of client.chatStream(messages, { maxTokens: 5, temperature: 0, includeUsage: true })) {
      chunks.push(chunk);
    }
    assert.equal(chunks[0].choices[0].delta.role, "assistant");
    const text = chunks.map((c) => c.choices[0]?.delta?.content ?? "").join("");
    assert.equal(text, reply.choices[0].message.content);
    assert.ok(chunks.at(-1).usage, "usage chunk last");
    const done = await client.completion(PROMPT, { maxTokens: 3, temperature: 0 });
    let streamed = "";
    for await (const chunk of client.completionStream(PROMPT, { maxTokens: 3, temperature: 0 })) {
      streamed += chunk.choices[0]?.text ?? "";
    }
    assert.equal(streamed, done.choices[0].text);
    await assert.rejects(client.chat(messages, { model: "gpt-4o", maxTokens: 2 }), TokenwireError);
  });

  test("OpenAI Responses and Anthropic Messages (exact JSON over gRPC)", async () => {
    const request = { model: "tgi", input: PROMPT, max_output_tokens: 4, temperature: 0 };
    const response = await client.responsesCreate(request);
    assert.equal(response.object, "response");
    const outputText = response.output.filter((i) => i.type === "message").map((i) => i.content[0].text).join("");
    let deltas = "";
    const kinds = [];
    for await (const event of client.responsesStream(request)) {
      kinds.push(event.type);
      if (event.type === "response.output_text.delta") deltas += event.delta;
    }
    assert.equal(kinds[0], "response.created");
    assert.equal(deltas, outputText);
    assert.equal((await client.responsesRetrieve(response.id)).id, response.id);
    assert.equal((await client.responsesDelete(response.id)).deleted, true);
    await assert.rejects(client.responsesRetrieve(response.id), NotFoundError);
    const body = { model: "tgi", max_tokens: 4, temperature: 0, messages: [{ role: "user", content: PROMPT }] };
    const message = await client.messagesCreate(body);
    assert.equal(message.type, "message");
    let text = "";
    for await (const event of client.messagesStream(body)) {
      if (event.type === "content_block_delta") text += event.delta.text;
    }
    assert.equal(text, message.content[0].text);
    const counted = await client.messagesCountTokens({ model: "tgi", messages: body.messages });
    assert.equal(counted.input_tokens, message.usage.input_tokens);
    await assert.rejects(client.messagesCreate({ ...body, max_tokens: 0 }), ValidationError);
  });

  test("generateStream, stopped early by break", async () => {
    const events = [];
    for await (const event of client.generateStream(PROMPT, { maxNewTokens: 40, temperature: 0 })) {
      assert.ok(event.token, "token present");
      events.push(event);
      if (events.length === 2) break;
    }
    assert.deepEqual(events.map((e) => e.index), [0, 1]);
    // A full stream still works afterwards; its last event carries the text.
    const full = [];
    for await (const event of client.generateStream(PROMPT, { maxNewTokens: 3 })) full.push(event);
    assert.equal(typeof full.at(-1).generatedText, "string");
  });

  test("generateStream, cancelled by an AbortSignal", async () => {
    const controller = new AbortController();
    const events = [];
    await assert.rejects(
      (async () => {
        for await (const event of client.generateStream(PROMPT, { maxNewTokens: 40 }, { signal: controller.signal })) {
          events.push(event);
          if (events.length === 2) controller.abort();
        }
      })(),
      CancelledError,
    );
    assert.equal(events.length, 2);
    assert.equal(await client.health(), true);
  });

  test("validation error", async () => {
    await assert.rejects(client.generate(PROMPT, { maxNewTokens: 5, top_p: 1.5 }), (error) => {
      assert.ok(error instanceof ValidationError, String(error));
      assert.ok(error instanceof TokenwireError);
      assert.equal(error.code, "INVALID_ARGUMENT");
      assert.match(error.message, /top_p/);
      return true;
    });
    await assert.rejects(
      (async () => {
        for await (const _ of client.generateStream("", { maxNewTokens: 5 })) {
          // no event expected
        }
      })(),
      (error) => error instanceof ValidationError && /inputs/.test(error.message),
    );
    // Unknown parameter names are caught before any call is made.
    await assert.rejects(client.generate(PROMPT, { no_such_parameter: 1 }), TypeError);
  });

  test("deadline exceeded", async () => {
    await assert.rejects(client.generate(PROMPT, { maxNewTokens: 50 }, { timeoutMs: 1 }), DeadlineExceededError);
    await assert.rejects(
      (async () => {
        for await (const _ of client.generateStream(PROMPT, { maxNewTokens: 50 }, { timeoutMs: 1 })) {
          // the deadline passes first
        }
      })(),
      DeadlineExceededError,
    );
  });

  test("info", async () => {
    const info = await client.info();
    assert.equal(info.version, VERSION);
    assert.equal(info.router, "tokenwire-router");
    assert.ok(info.maxTotalTokens > 0);
  });

  test("health", async () => {
    assert.equal(await client.health(), true);
    const nobody = createClient("http://127.0.0.1:1", { timeoutMs: 5_000 });
    try {
      assert.equal(await nobody.health(), false);
    } finally {
      nobody.close();
    }
  });
});
