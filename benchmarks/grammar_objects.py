"""Share of valid JSON outputs over a set of schemas whose objects do not say
`additionalProperties`, before and after tokenwire closes them (service/generation/grammar.py
`closed_objects`), on a real chat model through the real REST route (TGI's /generate with
`parameters.grammar`), greedy, 160 new tokens.

"Before" is llguidance's default: the same schemas sent with `additionalProperties: true` on
every object that declares `properties` (what the server compiled before the change); "after" is
the schemas as written. An output is valid when it parses as JSON and validates against the
schema as written (jsonschema); one the model kept extending until max_new_tokens is not.

    .venv/bin/python -m benchmarks.grammar_objects [--model-id DIR] [--out FILE]

Without --model-id the embedded default (SmolLM2-135M-Instruct, converted into the cache) is
served on CPU. Writes a Markdown table to stdout (and --out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema

from tests.helpers.http_api import http_json
from tests.helpers.processes import launch

MAX_NEW_TOKENS = 160

# (what to ask for, schema): none of them in tests/helpers/schemas.py.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a football team", {"type": "object", "properties": {
        "team_name": {"type": "string"}, "city": {"type": "string"},
        "founded": {"type": "integer"}}, "required": ["team_name", "city", "founded"]}),
    ("a recipe", {"type": "object", "properties": {
        "title": {"type": "string"}, "servings": {"type": "integer"},
        "ingredients": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["title", "servings", "ingredients"]}),
    ("today's weather in Paris", {"type": "object", "properties": {
        "city": {"type": "string"}, "temperature_c": {"type": "number"},
        "sky": {"enum": ["sunny", "cloudy", "rainy"]}}, "required": ["city", "temperature_c"]}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string"}, "author": {"type": "object", "properties": {
            "name": {"type": "string"}, "born": {"type": "integer"}}, "required": ["name"]},
        "pages": {"type": "integer"}}, "required": ["title", "author"]}),
    ("a user profile", {"type": "object", "properties": {
        "username": {"type": "string"}, "email": {"type": "string"},
        "age": {"type": "integer"}}, "required": ["username", "email"]}),
    ("an online order", {"type": "object", "properties": {
        "order_id": {"type": "string"}, "total": {"type": "number"},
        "paid": {"type": "boolean"}}, "required": ["order_id", "total", "paid"]}),
    ("a concert", {"type": "object", "properties": {
        "artist": {"type": "string"}, "venue": {"type": "object", "properties": {
            "name": {"type": "string"}, "capacity": {"type": "integer"}}},
        "date": {"type": "string"}}, "required": ["artist", "venue", "date"]}),
    ("a movie", {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["title", "year"]}),
    ("a car", {"type": "object", "properties": {
        "make": {"type": "string"}, "model": {"type": "string"},
        "year": {"type": "integer"}}, "required": ["make", "model"]}),
    ("a city", {"type": "object", "properties": {
        "name": {"type": "string"}, "country": {"type": "string"},
        "population": {"type": "integer"}}, "required": ["name", "country", "population"]}),
]


def opened(schema: Any) -> Any:
    """`schema` with `additionalProperties: true` on every object that declares properties:
    what llguidance compiled before tokenwire closed objects."""
    if isinstance(schema, list):
        return [opened(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: opened(s) for n, s in v.items()} if k == "properties" else opened(v))
           for k, v in schema.items()}  # fmt: skip
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = True
    return out


def _prompt(what: str) -> str:
    # SmolLM2's ChatML template, written out (TGI's /generate takes the raw prompt).
    return (
        "<|im_start|>system\nYou answer with JSON only.<|im_end|>\n"
        f"<|im_start|>user\nGive me {what} as JSON.<|im_end|>\n<|im_start|>assistant\n"
    )


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def measure(http_port: int) -> list[tuple[str, bool, int, bool, int]]:
    """(what, valid before, tokens before, valid after, tokens after) per schema."""

    def one(job: tuple[str, dict[str, Any], bool]) -> tuple[bool, int]:
        what, schema, before = job
        grammar = {"type": "json", "value": opened(schema) if before else schema}
        body = {"inputs": _prompt(what), "parameters": {
            "max_new_tokens": MAX_NEW_TOKENS, "details": True, "grammar": grammar}}  # fmt: skip
        status, _, reply = http_json(http_port, "POST", "/generate", body, timeout=900)
        assert status == 200, reply
        assert isinstance(reply, dict)
        return _valid(reply["generated_text"], schema), reply["details"]["generated_tokens"]

    jobs = [(w, s, before) for before in (True, False) for w, s in SCHEMAS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    n = len(SCHEMAS)
    return [
        (SCHEMAS[i][0], *results[i], *results[n + i])  # type: ignore[misc]
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--dtype", "float32", "--max-total-tokens", "1024", "--max-input-tokens", "800",
                 "--max-concurrent-requests", "64"]  # fmt: skip
        if args.model_id:
            extra += ["--model-id", args.model_id]
        dep = launch(Path(tmp), *extra, default_model=not args.model_id, timeout=600.0)
        try:
            assert dep.http_port is not None
            rows = measure(dep.http_port)
        finally:
            dep.stop()
    lines = [
        "| schema | valid before | tokens before | valid after | tokens after |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {w} | {vb} | {tb} | {va} | {ta} |" for w, vb, tb, va, ta in rows),
    ]
    before = sum(r[1] for r in rows)
    after = sum(r[3] for r in rows)
    lines.append(f"\nvalid outputs: before {before}/{len(rows)}, after {after}/{len(rows)} "
                 f"(greedy, max_new_tokens {MAX_NEW_TOKENS})")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
