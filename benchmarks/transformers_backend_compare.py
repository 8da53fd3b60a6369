"""Compares two harness runs (`python -m benchmarks.harness --model-impl native|transformers`):
the transformers backend against the native path on the same GPU and checkpoint.

    python benchmarks/transformers_backend_compare.py NATIVE/results.json BACKEND/results.json \
        [--out report.md]

Bars (issue 37): decode with CUDA graphs at batch 1 and 64 within 1.25x of native step time
(graph replay ms), end-to-end req/s on the harness workload at least 80 % of native's. Prints a
table and PASS/FAIL; exit status 1 on FAIL or missing figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STEP_BAR, RPS_BAR = 1.25, 0.80


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("native", type=Path)
    p.add_argument("backend", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    nat, tf = (json.loads(f.read_text()) for f in (args.native, args.backend))
    impls = (f"model_impl: {nat.get('model', {}).get('model_impl')} vs "
             f"{tf.get('model', {}).get('model_impl')}")
    lines = [f"# transformers backend vs native ({tf.get('device')}, commit {tf.get('commit')})",
             "", impls, "",
             "| figure | native | transformers backend | ratio | bar | ok |",
             "| --- | --- | --- | --- | --- | --- |"]
    ok = True
    steps = {d["batch"]: d for d in nat.get("model", {}).get("decode", [])}
    for d in tf.get("model", {}).get("decode", []):
        n = steps.get(d["batch"])
        if n is None:
            continue
        ratio = d["graph_replay_ms"] / n["graph_replay_ms"]
        good = ratio <= STEP_BAR
        ok &= good
        lines.append(f"| decode step b={d['batch']} (graph replay ms) | {n['graph_replay_ms']:.2f}"
                     f" | {d['graph_replay_ms']:.2f} | {ratio:.2f}x | <= {STEP_BAR}x | "
                     f"{'yes' if good else 'NO'} |")
    if not steps or not tf.get("model", {}).get("decode"):
        ok = False
        lines.append("| decode | missing | missing | | | NO |")
    ne, te = nat.get("e2e", {}), tf.get("e2e", {})
    if "requests_per_s" in ne and "requests_per_s" in te:
        share = te["requests_per_s"] / ne["requests_per_s"]
        good = share >= RPS_BAR and te["ok"] == te["requests"]
        ok &= good
        lines.append(f"| e2e req/s ({te['ok']}/{te['requests']} ok) | {ne['requests_per_s']:.1f} | "
                     f"{te['requests_per_s']:.1f} | {share:.0%} | >= {RPS_BAR:.0%} | "
                     f"{'yes' if good else 'NO'} |")
    else:
        ok = False
        lines.append("| e2e req/s | missing | missing | | | NO |")
    errors = {"native": nat.get("errors"), "transformers": tf.get("errors")}
    lines += ["", f"errors: {json.dumps(errors)}", "", "PASS" if ok else "FAIL"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
