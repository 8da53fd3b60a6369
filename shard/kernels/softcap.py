"""Attention-logit soft-capping (Gemma 2): scores become cap * tanh(scores / cap) before the
softmax, in the attention kernels' log2 domain. Shared by the decode and prefill kernels so that
both cap with the same instructions."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_log2(s, SOFTCAP: tl.constexpr):
    """s: scores already multiplied by log2(e) (the kernels' exp2 domain), any shape. With
    SOFTCAP > 0 returns SOFTCAP * tanh(natural / SOFTCAP) * log2(e), natural = s / log2(e);
    SOFTCAP == 0 (compiled out): s unchanged. Apply before masking: tanh(-inf) is finite.

    tanh from exp2 (no libdevice call, so the CPU interpreter runs it too): tanh|x| =
    (1 - e^-2|x|) / (1 + e^-2|x|), accurate to fp32 rounding and never overflowing."""
    if SOFTCAP > 0:
        x = s * (1.0 / (SOFTCAP * 1.4426950408889634))  # natural scores / cap
        t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # e^(-2|x|), 2 * log2(e)
        th = (1.0 - t) / (1.0 + t)
        s = tl.where(x < 0, -th, th) * (SOFTCAP * 1.4426950408889634)
    return s
