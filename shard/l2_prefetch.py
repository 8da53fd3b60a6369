"""Warms the GPU's L2 cache with the next weights while latency-bound kernels run (CUDA, sm_90+).

Why: a decode step at batch 1 alternates weight streams (the GEMVs, bandwidth-bound) with kernels
that barely touch memory but take microseconds (rotary + KV store, attention over a short
context, the all-reduce + norm waiting on NVLink). During the latter HBM idles, and every GEMV
then starts cold: its first bytes arrive a DRAM latency after launch, and a small GEMV (a TP=2
o_proj is 16 MB, ~4 us at copy bandwidth) loses ~2-3 us of its time to that ramp (measured:
benchmarks/raw/gemv_tp2_h200x2.json, 63-65% of copy bandwidth for the 16-25 MB shapes). Issuing
the next weight's bytes as L2 prefetches on a side stream, ordered after the previous GEMV, fills
those idle microseconds; the GEMV then reads L2 hits at the front of its stream.

Mechanism: Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global`), one instruction per
lane for a span of bytes, fire-and-forget: the kernel exits right away and holds no registers or
SMs while the bytes arrive. Prefetches change no values, only timing, so results are identical
with or without them. In a CUDA graph the side stream becomes a parallel branch (fork after the
previous GEMV, joined once at the end of the forward).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

# Bytes per bulk prefetch instruction and lanes per program: 8 KiB x 128 = 1 MiB per program.
SPAN_BYTES = 8192
LANES = 128
# Default cap per prefetch (see L2Prefetcher.prefetch).
DEFAULT_MAX_BYTES = 32 << 20


@triton.jit
def _l2_prefetch_kernel(base, nbytes, SPAN: tl.constexpr, LANES: tl.constexpr):
    # base: the weight's device address (int64), nbytes: its size; lane i of program p covers
    # [base + (p * LANES + i) * SPAN, + SPAN), clipped to the end (sizes in 16-byte units).
    start = (tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES).to(tl.int64)) * SPAN
    size = tl.minimum(tl.maximum(nbytes - start, 0), SPAN).to(tl.int32) // 16 * 16
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.u32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[base + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


class L2Prefetcher:
    """Queues L2 prefetches of weights on a side stream of `device`, each ordered after the
    work queued on the current stream so far. Call `join()` before the current stream's
    results are consumed by a graph capture's end (every forked branch must rejoin)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pending = False

    def prefetch(self, weight: torch.Tensor, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """Prefetches the first max_bytes of weight (a contiguous CUDA tensor that stays alive:
        model weights). The cap: an idle window of a few microseconds fills ~20-30 MB of a
        ~50 MB L2; bytes beyond it would only evict the front of the same stream."""
        nbytes = min(weight.numel() * weight.element_size(), max_bytes)
        if nbytes < 16:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            grid = (triton.cdiv(nbytes, SPAN_BYTES * LANES),)
            _l2_prefetch_kernel[grid](weight.data_ptr(), nbytes, SPAN=SPAN_BYTES, LANES=LANES,
                                      num_warps=LANES // 32)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False


def try_l2_prefetcher(device: torch.device) -> L2Prefetcher | None:
    """A prefetcher for Hopper-or-newer GPUs whose Triton compiles the bulk prefetch; None
    elsewhere (the forward then runs without prefetches, same results)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    try:
        prefetcher = L2Prefetcher(device)
        probe = torch.zeros(SPAN_BYTES * LANES + 48, dtype=torch.uint8, device=device)
        prefetcher.prefetch(probe)
        prefetcher.join()
        torch.cuda.synchronize(device)
        return prefetcher
    except Exception as exc:  # noqa: BLE001 - an optimization: run without it
        log.warning("L2 weight prefetch unavailable (%s: %s)", type(exc).__name__, exc)
        return None
