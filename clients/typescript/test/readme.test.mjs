// Runs every ```js block of the package's README against the live server at $TOKENWIRE_URL
// ("http://localhost:50051" in the examples is replaced by it), each as its own ES module.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { format, promisify } from "node:util";

const url = process.env.TOKENWIRE_URL;
const run = promisify(execFile);
// What raw gRPC calls answered for the examples' requests (tests/sdk/test_typescript_sdk.py).
const expected = process.env.TOKENWIRE_EXPECTED ? JSON.parse(process.env.TOKENWIRE_EXPECTED).readme : undefined;

// Each example's printed output, from the raw answers (console.log(a, b) prints format(a, b)).
const checks = [
  (stdout) => {
    const { text, finish_reason: reason, ids } = expected.france;
    assert.equal(stdout, `${text}\n${format(reason, ids)}\n`);
  },
  (stdout) => {
    // Four tokens, then a prefix of the "Hello" stream (aborted after 50 ms), then "stopped".
    const first = expected.once_texts.slice(0, 4).join("");
    assert.ok(stdout.startsWith(first), JSON.stringify(stdout));
    assert.ok(stdout.endsWith("\nstopped\n"), JSON.stringify(stdout));
    const hello = stdout.slice(first.length, -"\nstopped\n".length);
    assert.ok(expected.hello_texts.join("").startsWith(hello), JSON.stringify(hello));
  },
  (stdout) => {
    // The chat reply and its token count, the same reply streamed (greedy: equal), a completion.
    const chat = /^([\s\S]*) (\d+)\n\1([\s\S]*)\n$/.exec(stdout);
    assert.ok(chat !== null && Number(chat[2]) > 0, JSON.stringify(stdout));
  },
  (stdout) => {
    const healthy = format(expected.model_id, expected.max_total_tokens, "healthy:", true);
    assert.equal(stdout, `rejected: ${expected.top_p_message}\ntoo slow\n${healthy}\n`);
  },
];

// The README that ships in the package (resolved through the package's own entry point).
const entry = fileURLToPath(import.meta.resolve("@tokenwire/client"));
const readmePath = join(dirname(entry), "..", "README.md");
const readme = await readFile(readmePath, "utf8");
const blocks = [...readme.matchAll(/```js\n([\s\S]*?)```/g)].map((m) => m[1]);

test("README has examples", () => assert.equal(blocks.length, checks.length, `${blocks.length} js blocks`));

blocks.forEach((block, i) => {
  test(`README example ${i}`, { skip: url === undefined && "TOKENWIRE_URL not set" }, async () => {
    // Written next to this test so that `@tokenwire/client` resolves the same way.
    const dir = await mkdtemp(join(dirname(fileURLToPath(import.meta.url)), ".readme-"));
    try {
      const file = join(dir, `example${i}.mjs`);
      await writeFile(file, block.replaceAll("http://localhost:50051", url));
      const { stdout } = await run(process.execPath, [file], { timeout: 60_000 });
      if (expected !== undefined) checks[i](stdout);
      else assert.ok(stdout.length > 0, "the example printed something");
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
