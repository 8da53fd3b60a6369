// Image inputs through the installed TypeScript SDK against a live tokenwire server serving a tiny
// vision-language model. tests/e2e/test_vision_e2e.py copies this file into a temporary project
// that installed the `npm pack` tarball and runs `node --test` there with:
//   TOKENWIRE_URL, TOKENWIRE_ENVOY_URL   the router's gRPC port, Envoy's port (gRPC passed through)
//   TOKENWIRE_PNG                        a PNG file
//   TOKENWIRE_IMAGE_SERVER               http://host:port serving the same PNG at /a.png
//   TOKENWIRE_EXPECTED                   {ids, chat}: the token ids of the same prompt sent as TGI
//                                        markdown, and the openai client's reply to the same chat
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, describe, test } from "node:test";

import { createClient, imageFromFile, ValidationError } from "@tokenwire/client";

const N = 6; // test_vision_e2e.N
const png = process.env.TOKENWIRE_PNG;
const server = process.env.TOKENWIRE_IMAGE_SERVER;
const expected = JSON.parse(process.env.TOKENWIRE_EXPECTED ?? "{}");
const dataUrl = () => `data:image/png;base64,${readFileSync(png).toString("base64")}`;
const chatParts = (image) => [
  { type: "text", text: "what is in " },
  image,
  { type: "text", text: " tell me" },
];

describe("@tokenwire/client image inputs", () => {
  const client = createClient(process.env.TOKENWIRE_URL, { timeoutMs: 60_000 });
  const viaEnvoy = createClient(process.env.TOKENWIRE_ENVOY_URL, { timeoutMs: 60_000 });
  after(() => {
    client.close();
    viaEnvoy.close();
  });
  const ids = async (c, inputs) =>
    (await c.generate(inputs, { maxNewTokens: N, details: true })).details.tokens.map((t) => t.id);

  test("generate: a file, bytes, a data URL and an http URL give the markdown prompt's tokens", async () => {
    const bytes = new Uint8Array(readFileSync(png));
    for (const image of [await imageFromFile(png), bytes, { data: bytes }, { url: dataUrl() }, { url: `${server}/a.png` }]) {
      assert.deepEqual(await ids(client, ["look ", image, " here"]), expected.ids);
    }
    assert.deepEqual(await ids(viaEnvoy, ["look ", await imageFromFile(png), " here"]), expected.ids);
  });

  test("generateStream with an image", async () => {
    const events = [];
    for await (const event of client.generateStream(["look ", await imageFromFile(png), " here"], { maxNewTokens: N })) {
      events.push(event.token.id);
    }
    assert.deepEqual(events, expected.ids);
  });

  test("chat and chatStream with OpenAI-shaped content lists equal the openai client", async () => {
    const messages = [{ role: "user", content: chatParts({ type: "image_url", image_url: { url: dataUrl() } }) }];
    const reply = await client.chat(messages, { maxTokens: N, temperature: 0 });
    assert.equal(reply.choices[0].message.content, expected.chat);
    // An image object in the list is sent as a data URL: the same reply.
    let streamed = "";
    const withImage = [{ role: "user", content: chatParts(await imageFromFile(png)) }];
    for await (const chunk of client.chatStream(withImage, { maxTokens: N, temperature: 0 })) {
      streamed += chunk.choices[0]?.delta?.content ?? "";
    }
    assert.equal(streamed, expected.chat);
  });

  test("bad images: the server names the part; bad parts: TypeError naming the part", async () => {
    await assert.rejects(
      client.generate(["look ", new TextEncoder().encode("not an image"), " here"], { maxNewTokens: 2 }),
      (error) => error instanceof ValidationError && /input_chunks\[1\]\.image.*could not be decoded/.test(error.message),
    );
    await assert.rejects(
      client.chat([{ role: "user", content: chatParts({ type: "image_url", image_url: { url: `${server}/missing.png` } }) }], { maxTokens: 2 }),
      (error) => error instanceof ValidationError && /messages\[0\]\.content_parts\[1\]\.image_url.*HTTP 404/.test(error.message),
    );
    await assert.rejects(client.generate(["a", { image: "x" }]), (error) => error instanceof TypeError && /^inputs\[1\] must be/.test(error.message));
    await assert.rejects(client.generate(3), (error) => error instanceof TypeError && /^inputs must be/.test(error.message));
    await assert.rejects(
      client.chat([{ role: "user", content: [{ type: "audio" }] }]),
      (error) => error instanceof TypeError && /^messages\[0\]\.content\[0\] must be/.test(error.message),
    );
    // Still serving.
    assert.deepEqual(await ids(client, ["look ", await imageFromFile(png), " here"]), expected.ids);
  });
});
