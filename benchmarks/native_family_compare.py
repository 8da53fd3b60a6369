"""Compares two harness runs (`python -m benchmarks.harness --model-type qwen3|llama`): a native
family's 8B shape against Llama-3-8B on the same GPU (issue 38).

    python benchmarks/native_family_compare.py FAMILY/results.json LLAMA/results.json \
        [--out report.md]

Bars: decode with CUDA graphs at batch 1 at >= 85 % of the memory roofline (graph replay vs the
bytes a step must read: weights + KV), end-to-end req/s on the harness workload within 10 % of
Llama-8B's. Prints the per-batch decode table of both (the benchmarks/RESULTS.md rows) and
PASS/FAIL; exit status 1 on FAIL or missing figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOFLINE_BAR, RPS_BAR = 85.0, 0.90


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("family", type=Path)
    p.add_argument("llama", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    fam, ll = (json.loads(f.read_text()) for f in (args.family, args.llama))
    name = fam.get("model_type", "?")
    title = (f"# {name} vs llama, 8B shapes ({fam.get('device')}, {fam.get('date')}, commit "
             f"{fam.get('commit')})")
    impls = (f"model_impl: {fam.get('model', {}).get('model_impl')} vs "
             f"{ll.get('model', {}).get('model_impl')}; layers {fam.get('num_layers')} vs "
             f"{ll.get('num_layers')}")
    lines = [title, "", impls, "",
             "| model | batch | CUDA graph ms | memory roofline ms | % of roofline | tok/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, res in ((name, fam), ("llama", ll)):
        for d in res.get("model", {}).get("decode", []):
            lines.append(f"| {label} | {d['batch']} | {d['graph_replay_ms']:.2f} | "
                         f"{d['roofline_ms']:.2f} | {d['pct_of_roofline']:.1f}% | "
                         f"{d['tokens_per_s']:.0f} |")
    lines += ["", "| bar | value | target | ok |", "| --- | --- | --- | --- |"]
    ok = True
    b1 = [d for d in fam.get("model", {}).get("decode", []) if d["batch"] == 1]
    if b1:
        good = b1[0]["pct_of_roofline"] >= ROOFLINE_BAR
        lines.append(f"| {name} decode b=1, % of memory roofline | "
                     f"{b1[0]['pct_of_roofline']:.1f}% | >= {ROOFLINE_BAR:.0f}% | "
                     f"{'yes' if good else 'NO'} |")
        ok &= good
    else:
        ok = False
        lines.append(f"| {name} decode b=1 | missing | | NO |")
    fe, le = fam.get("e2e", {}), ll.get("e2e", {})
    if "requests_per_s" in fe and "requests_per_s" in le:
        ratio = fe["requests_per_s"] / le["requests_per_s"]
        good = ratio >= RPS_BAR and fe["ok"] == fe["requests"]
        lines.append(f"| e2e req/s {name} / llama ({fe['ok']}/{fe['requests']} ok) | "
                     f"{fe['requests_per_s']:.1f} / {le['requests_per_s']:.1f} = {ratio:.0%} | "
                     f">= {RPS_BAR:.0%} | {'yes' if good else 'NO'} |")
        ok &= good
    else:
        ok = False
        lines.append("| e2e req/s | missing | | NO |")
    errors = {name: fam.get("errors"), "llama": ll.get("errors")}
    lines += ["", f"errors: {json.dumps(errors)}", "", "PASS" if ok else "FAIL"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
