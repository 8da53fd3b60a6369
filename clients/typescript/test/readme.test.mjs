// Runs every ```js block of the package's README against the live server at $TOKENWIRE_URL
// ("http://localhost:50051" in the examples is replaced by it), each as its own ES module.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const url = process.env.TOKENWIRE_URL;
const run = promisify(execFile);

// The README that ships in the package (resolved through the package's own entry point).
const entry = fileURLToPath(import.meta.resolve("@tokenwire/client"));
const readmePath = join(dirname(entry), "..", "README.md");
const readme = await readFile(readmePath, "utf8");
const blocks = [...readme.matchAll(/```js\n([\s\S]*?)```/g)].map((m) => m[1]);

test("README has examples", () => assert.ok(blocks.length >= 3, `${blocks.length} js blocks`));

blocks.forEach((block, i) => {
  test(`README example ${i}`, { skip: url === undefined && "TOKENWIRE_URL not set" }, async () => {
    // Written next to this test so that `@tokenwire/client` resolves the same way.
    const dir = await mkdtemp(join(dirname(fileURLToPath(import.meta.url)), ".readme-"));
    try {
      const file = join(dir, `example${i}.mjs`);
      await writeFile(file, block.replaceAll("http://localhost:50051", url));
      const { stdout } = await run(process.execPath, [file], { timeout: 60_000 });
      assert.ok(stdout.length > 0, "the example printed something");
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
