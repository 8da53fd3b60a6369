"""Warming the next launch's weights into L2 from a latency-bound kernel (sm_90, Triton).

Why: at batch 1 a decode step alternates weight streams (the GEMVs, near copy bandwidth) with
launches that read almost nothing and are bound by their chain of dependent round trips: the
decode attention over a 512-token context reads 1 MB of K/V in ~9 us a layer (H100,
benchmarks/MOE_B1.md). Meanwhile HBM idles. The weights of the launch after it (o_proj: 16.8 MB
bf16 for Qwen3-30B-A3B, 8.4 MB fp8) are known before the step runs, so the latency-bound kernel
asks the memory system to bring them into L2 while it works, and the GEMV then streams them from
L2 (H100 / H200: 50 MB) instead of HBM.

How: `cp.async.bulk.prefetch.L2.global [addr], size` (sm_90): the SM's TMA unit fetches the
range into L2; the issuing thread neither waits nor holds registers for it, so the kernel's own
chain is not delayed. Each of the launch's `parts` programs issues its share of the range in
CHUNK-byte pieces, one per lane of its first warp. Bytes past a share's last 16-byte boundary
(the instruction's granule) are left to the GEMV.

Protocol (a kernel with a `WARM` constexpr takes `warm_ptr, warm_bytes`): call `warm_share`
once the kernel's own HBM loads are done. Prefetch requests queue in the memory system like any
load: issued right after the decode attention's PDL wait, 16.8 MB of them delayed its K/V loads
and made the step 7 us a layer slower (H200, benchmarks/MOE_B1.md round 16), so the attention
issues them after its K/V loop, into the window of its partial store, ticket and merge. A launch
with WARM off passes any pointer and 0 bytes and compiles no code for it.

Measured, not assumed (off by default: shard.layers.attention.WARM_O_PROJ; benchmarks/
l2_warm_probe.py and moe_b1_bench's `old:warm-o`): in that window an 8 MiB fp8 o_proj moved
the step by -2.2 to +0.5 us a layer (noise), a 16 MiB bf16 one by -0.8 to +4.7. The probe: a 21 MB stream read 10.0 us cold,
8.3-8.8 warmed (by 1 to 132 programs alike), 6.9 hot; warmed lines outlived a 75 MB evict-first
stream (8.6 us); an evict-last prefetch made the read 25.9 us. (A pass that had every GEMV
bulk-prefetch its own weight rows before its wait also made the step slower, shard/kernels/pdl.py:
there the prefetch raced the stream it fed.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def launch_args(target: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(warm_ptr, warm_bytes) for a launch: the target's storage, or `fallback` and 0 bytes."""
    if target is None:
        return fallback, 0
    return target, target.numel() * target.element_size()


# cp.async.bulk.prefetch.L2 of one chunk per lane, from the first warp only: a [LANES] tensor
# in a kernel of several warps is held by every warp (lane l of each holds element l), and one
# request per chunk is enough. Chunks with a size <= 0 issue nothing. The output register only
# satisfies inline_asm_elementwise (is_pure=False keeps the statement). The evict-last form
# marks the lines to outlive evict-first streams (the expert weights) until they are read.
_PREFETCH_ASM = tl.constexpr("""{
    .reg .pred p, first;
    .reg .u32 t;
    mov.u32 t, %tid.x;
    setp.lt.u32 first, t, 32;
    setp.gt.and.s32 p, $2, 0, first;
    @p cp.async.bulk.prefetch.L2.global [$1], $2;
    mov.u32 $0, 0;
}""")
_PREFETCH_LAST_ASM = tl.constexpr("""{
    .reg .pred p, first;
    .reg .u32 t;
    .reg .b64 policy;
    mov.u32 t, %tid.x;
    setp.lt.u32 first, t, 32;
    setp.gt.and.s32 p, $2, 0, first;
    createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
    @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
    mov.u32 $0, 0;
}""")


@triton.jit
def warm_share(warm_ptr, warm_bytes, part, parts, WARM: tl.constexpr,
               EVICT_LAST: tl.constexpr = False, CHUNK: tl.constexpr = 16384,
               LANES: tl.constexpr = 32):
    """Program `part` of `parts` prefetches its share of [warm_ptr, warm_ptr + warm_bytes) into
    L2 (whole CHUNKs, LANES at a time; nothing when WARM is off)."""
    if WARM:
        base = warm_ptr.to(tl.pointer_type(tl.int8))
        total = warm_bytes.to(tl.int64)
        share = tl.cdiv(tl.cdiv(total, parts), CHUNK) * CHUNK  # bytes a program, whole chunks
        lo = part.to(tl.int64) * share
        hi = tl.minimum(lo + share, total)
        lanes = tl.arange(0, LANES).to(tl.int64)  # [LANES]
        for c0 in range(lo, hi, CHUNK * LANES):
            start = c0 + lanes * CHUNK  # [LANES] chunk starts (16-byte aligned: CHUNK is)
            size = tl.minimum(hi - start, CHUNK) // 16 * 16  # [LANES] bytes, <= 0: none
            tl.inline_asm_elementwise(_PREFETCH_LAST_ASM if EVICT_LAST else _PREFETCH_ASM,
                                      "=r,l,r", [base + start, size.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
