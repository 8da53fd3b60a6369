"""Where the batch-1 decode attention's ~9 us a layer go (issue 39, benchmarks/MOE_B1.md).

The fused rotary + store + split-KV launch reads 1 MB of K/V at Qwen3-30B-A3B's shape and
context 512 (0.25 us at copy rate) but adds ~9 us to the step, alone as in the step, whatever
its tiling; no rotary prologue is no faster. A profiler sees only the span. This runs the
48-layer attention chain of moe_b1_bench (each layer's launch a programmatic dependent of the
last, from one CUDA graph) with the kernel's `%globaltimer` stamps (shard/kernels/stamps.py,
attention_decode.STAMP_POINTS) and splits a layer's time into:
- `early`: how long before the previous launch's end its programs had started (PDL placement);
- `hop`: from the previous launch's last stamp to the first program's return from the PDL wait
  (its completion and memory flush, and the wait's own cost);
- per program, from its return from the wait: `q` (the rotary prologue: q/k/v loads, q/k norms,
  the new k/v store, a CTA barrier), `attend` (the tiles; the first was loaded before the wait),
  `store` (the partial output and its log-sum-exp, a CTA barrier), `ticket` (the acq_rel
  atomic), `merge` (the last split of each KV head: the partials read back, the output stored);
- `lag`: a program's return from the wait after the first program's.
Means over the middle layers of the last replay, us; `critical` is the program that ended last.

`python -m benchmarks.attention_stamps --out DIR [--contexts 512,4096] [--names ...]` writes
DIR/attention_stamps.json (one result per context) and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

# ((splits, K/V tile, warps, stages) or None for the launch's defaults (s16-n64-w4-st3 at 4 KV
# heads), the merge one split at a time (attention_decode.merge_by_split; the default since
# round 18, False: the block form before it). (Round 18's finer split shares and new k, v
# loaded with q, and round 19's half-width tiles for short shares, were removed after their
# A/B: benchmarks/MOE_B1.md, round 19.)
CONFIGS: tuple[tuple[tuple[int, int, int, int] | None, bool], ...] = (
    (None, False), (None, True), ((16, 64, 4, 1), False), ((16, 64, 4, 1), True),
    ((8, 64, 4, 3), True), ((16, 32, 4, 3), True), ((16, 64, 4, 3), False))
PHASES = ("lag", "q", "attend", "store", "ticket", "merge")


def layer_phases(stamps: np.ndarray) -> dict[str, Any]:
    """stamps: int64 ns [layers, programs, 8] (attention_decode.STAMP_POINTS; 0 where a
    program did not pass a point). Means over layers 1 .. layers - 2 of: early, hop, period and
    each phase (all programs' mean, and the critical program's), in us."""
    s = stamps.astype(np.float64) / 1e3
    layers = s.shape[0]
    one_split = bool((s[:, :, 7] > 0).any())
    # a program's last point: the output stored (one split), merged (the merging split) or
    # its ticket taken
    # (a merge stamp older than the program's ticket is an earlier replay's: not this one's)
    merged = s[:, :, 6] >= s[:, :, 5]
    done = s[:, :, 7] if one_split else np.where(merged, s[:, :, 6], s[:, :, 5])
    release = s[:, :, 1].min(axis=1)  # [layers] the first return from the PDL wait
    end = done.max(axis=1)
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("early", "hop", "period", "span", *PHASES,
                                     *(f"critical {p}" for p in PHASES))}
    for i in range(1, layers - 1):
        rows["early"].append(end[i - 1] - s[i, :, 0].min())
        rows["hop"].append(release[i] - end[i - 1])
        rows["period"].append(release[i + 1] - release[i])
        rows["span"].append(end[i] - release[i])
        lag = s[i, :, 1] - release[i]
        steps = {"lag": lag, "q": s[i, :, 2] - s[i, :, 1], "attend": s[i, :, 3] - s[i, :, 2]}
        if one_split:
            steps["store"] = s[i, :, 7] - s[i, :, 3]
        else:
            steps["store"] = s[i, :, 4] - s[i, :, 3]
            steps["ticket"] = s[i, :, 5] - s[i, :, 4]
            steps["merge"] = np.where(merged[i], s[i, :, 6] - s[i, :, 5], np.nan)
        critical = int(np.argmax(done[i]))
        for name, values in steps.items():
            rows[name].append(float(np.nanmean(values)))
            rows[f"critical {name}"].append(float(values[critical]))
    return {k: float(np.mean(v)) for k, v in rows.items() if v}


def run(layers: int = 48, replays: int = 10, context: int = 512,
        names: set[str] | None = None) -> dict[str, Any]:
    import torch

    from benchmarks.moe_b1_bench import attention_chain
    from benchmarks.moe_bench import QWEN3_30B_A3B, _graph_ms
    from shard.attention.cuda_backend import DecodeTiling
    from shard.kernels import attention_decode as ad
    from shard.kernels.stamps import STAMP_SLOTS

    shape = QWEN3_30B_A3B
    kvh = shape["num_key_value_heads"]
    chain = attention_chain(shape, layers, context)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for cfg, by_split in CONFIGS:
        tiling = None if cfg is None else DecodeTiling(kvh, *cfg)
        splits = ad.default_num_splits(1, kvh, sms) if cfg is None else cfg[0]
        name = ((f"default(s{splits})" if tiling is None else tiling.name())
                + ("+by-split" if by_split else ""))
        if names is not None and name not in names:
            continue
        stamps = torch.zeros(layers, kvh * splits, STAMP_SLOTS, dtype=torch.int64, device="cuda")
        row: dict[str, Any] = {"tiling": name, "programs": kvh * splits, "context": context}
        try:
            with ad.merge_by_split(by_split):
                row["us_per_layer"] = _graph_ms(lambda t=tiling: chain(t)) * 1e3 / layers
                row["stamped_us_per_layer"] = _graph_ms(
                    lambda t=tiling, st=stamps: chain(t, stamps=st), iters=replays) * 1e3 / layers
            row.update(layer_phases(stamps.cpu().numpy()))
        except Exception as exc:  # noqa: BLE001 - recorded; the next tiling still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(_line(row), flush=True)
    return {"device": torch.cuda.get_device_name(), "layers": layers, "context": context,
            "rows": rows}


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['tiling']:>27s}  {row['error']}"
    cells = " ".join(f"{k} {row[k]:.2f}" for k in
                     ("us_per_layer", "stamped_us_per_layer", "period", "early", "hop", "span",
                      *PHASES, *(f"critical {p}" for p in PHASES)) if k in row)
    return f"ctx {row['context']:6d} {row['tiling']:>27s}  {cells}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_stamps")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--contexts", default="512", help="comma-separated context lengths")
    p.add_argument("--names", default=None,
                   help="comma-separated row names of CONFIGS to run (default: all)")
    args = p.parse_args(argv)
    names = set(args.names.split(",")) if args.names else None
    results = [run(context=int(c), names=names) for c in args.contexts.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_stamps.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
