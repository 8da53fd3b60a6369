"""Probe for shard/kernels/l2_warm.py on one GPU: does a bulk L2 prefetch issued by a few
programs during an idle window make a later weight stream faster, and do the lines outlive an
evict-first stream in between (the MoE experts between a warm in the routing window and the
next layer's q/k/v GEMV)?

`python -m benchmarks.l2_warm_probe --out DIR` writes DIR/l2_warm_probe.json. Each case, per
repetition: 256 MB written (the L2 flushed), the warm launch (P programs, warm_share over A),
an idle window (torch.cuda._sleep), optionally a 75 MB evict-first stream (B), then A (21 MB,
Qwen3-30B-A3B's q/k/v weight) read by a streaming kernel, timed alone by CUDA events: the
median over repetitions. `hot` reads A twice (the second read from L2: the best case), `cold`
warms nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from shard.kernels.l2_warm import warm_share

A_BYTES = 21 * 2**20
B_BYTES = 75 * 2**20
FLUSH_BYTES = 256 * 2**20
BLOCK = 8192


@triton.jit
def _warm_kernel(ptr, nbytes, EVICT_LAST: tl.constexpr):
    warm_share(ptr, nbytes, tl.program_id(0), tl.num_programs(0), True, EVICT_LAST)


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n, EVICT_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVICT_FIRST:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), 0))


def _stream(x: torch.Tensor, out: torch.Tensor, evict_first: bool) -> None:
    _stream_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), evict_first, BLOCK,
                                                     num_warps=8)


def run(reps: int = 30) -> dict:
    dev = torch.device("cuda")
    a = torch.randn(A_BYTES // 2, device=dev, dtype=torch.bfloat16)
    b = torch.randn(B_BYTES // 2, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(FLUSH_BYTES // 4, device=dev, dtype=torch.float32)
    out = torch.empty(triton.cdiv(B_BYTES // 2, BLOCK), device=dev, dtype=torch.float32)
    clock_hz = torch.cuda.get_device_properties(dev).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e9

    def case(programs: int, window_us: float, between: bool, evict_last: bool = False,
             hot: bool = False) -> float:
        times = []
        for _ in range(reps + 3):
            flush.fill_(1.0)
            if hot:
                _stream(a, out, False)
            if programs:
                _warm_kernel[(programs,)](a, A_BYTES, evict_last, num_warps=4)
            if window_us:
                torch.cuda._sleep(int(window_us * 1e-6 * clock_hz))
            if between:
                _stream(b, out, True)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            _stream(a, out, False)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        return statistics.median(times[3:])

    res: dict = {"device": torch.cuda.get_device_name(), "a_mb": A_BYTES / 2**20,
                 "b_mb": B_BYTES / 2**20, "clock_hz": clock_hz, "us": {}}
    cases = {
        "cold": (0, 10.0, False),
        "hot": (0, 10.0, False, False, True),
        "warm P=1 window 10us": (1, 10.0, False),
        "warm P=8 window 10us": (8, 10.0, False),
        "warm P=64 window 10us": (64, 10.0, False),
        "warm P=132 window 10us": (132, 10.0, False),
        "warm P=64 window 0": (64, 0.0, False),
        "warm P=64 window 5us": (64, 5.0, False),
        "cold, B between": (0, 10.0, True),
        "warm P=64 10us, B evict-first between": (64, 10.0, True),
        "warm P=64 10us evict-last, B evict-first between": (64, 10.0, True, True),
    }
    for name, args in cases.items():
        res["us"][name] = case(*args)
        print(f"{name}: {res['us'][name]:.2f} us for A", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.l2_warm_probe")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res = run()
    (args.out / "l2_warm_probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
