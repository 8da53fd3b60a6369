// The official `openai` npm package, unchanged, against tokenwire's OpenAI routes through Envoy.
// Run by tests/e2e/test_openai.py:  node openai_npm_cases.mjs BASE_URL API_KEY
// Prints one JSON object: {case: null | "failure text"}.
import assert from "node:assert/strict";
import OpenAI from "openai";

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const FRANCE = [{ role: "user", content: "What is the capital of France?" }];

const cases = {
  async haiku_stream() {
    const stream = await client.chat.completions.create({
      model: "tgi",
      messages: [{ role: "user", content: "Stream me a haiku." }],
      stream: true,
      max_tokens: 16,
    });
    let text = "";
    for await (const chunk of stream) text += chunk.choices[0]?.delta?.content || "";
    assert.ok(text.trim().length > 0, "empty haiku");
  },
  async non_stream_with_usage() {
    const reply = await client.chat.completions.create({
      model: "tgi", messages: FRANCE, temperature: 0, max_tokens: 12,
    });
    assert.equal(reply.choices[0].message.content, "The capital of France is Paris.");
    assert.equal(reply.choices[0].finish_reason, "stop");
    assert.equal(reply.usage.total_tokens, reply.usage.prompt_tokens + reply.usage.completion_tokens);
  },
  async include_usage() {
    const stream = await client.chat.completions.create({
      model: "tgi", messages: FRANCE, temperature: 0, max_tokens: 3, stream: true,
      stream_options: { include_usage: true },
    });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    assert.deepEqual(chunks.at(-1).choices, []);
    assert.equal(chunks.at(-1).usage.completion_tokens, 3);
  },
  async bad_request_names_the_param() {
    await assert.rejects(
      client.chat.completions.create({ model: "tgi", messages: FRANCE, temperature: 9 }),
      (error) => error instanceof OpenAI.BadRequestError && error.param === "temperature",
    );
  },
  async wrong_key() {
    const wrong = new OpenAI({ baseURL, apiKey: "nope", maxRetries: 0 });
    await assert.rejects(
      wrong.chat.completions.create({ model: "tgi", messages: FRANCE, max_tokens: 2 }),
      OpenAI.AuthenticationError,
    );
  },
  async unknown_model() {
    await assert.rejects(
      client.chat.completions.create({ model: "gpt-4o", messages: FRANCE, max_tokens: 2 }),
      (error) => error instanceof OpenAI.NotFoundError && error.code === "model_not_found",
    );
  },
  async completions_and_models() {
    const reply = await client.completions.create({
      model: "tgi", prompt: "The capital of France is", max_tokens: 3, temperature: 0,
    });
    assert.ok(reply.choices[0].text.startsWith(" Paris"), reply.choices[0].text);
    const models = await client.models.list();
    assert.equal(models.data.length, 1);
  },
};

const results = {};
for (const [name, run] of Object.entries(cases)) {
  try {
    await run();
    results[name] = null;
  } catch (error) {
    results[name] = String(error?.stack ?? error);
  }
}
console.log(JSON.stringify(results));
