"""Triton pieces shared by the W4A16 GEMV kernels (shard/kernels/int_gemv.py and
int_gemv_wide.py): the lop3 unpack of int4 words into 16-bit MMA operands (PRMT + LOP3 inline
PTX on CUDA, the same bits in Triton operations under the interpreter) and the split-K finish
(partials, an acq_rel arrival counter, the last split reduces and resets it), and the host side
of that split: the K ranges and the launch's workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["finish", "k_splits", "lop3_tile", "offset_bytes", "split_workspace", "unpack_asm"]


# The lop3 unpack (GemvConfig.lop3): an int32 element e whose bytes j = 0..3 hold a weight in their
# low nibble becomes four 16-bit values OFF + nibble, two elements per 32-bit register: one PRMT
# (byte j of both elements into the two halves) and one LOP3 ((t & 0x000F000F) | OFF's bits:
# OFF + q exactly, OFF = 128 in bf16 / 1024 in fp16, whose ulp is 1) per two weights, and each
# output register is already the packed pair (element e, element e + 1) the MMA operand wants.
# Selectors: d.b0 = element a's byte j, d.b2 = element b's byte j (bytes 1 and 3 masked off).
def unpack_asm(magic: int) -> str:
    lines = ["{", ".reg .b32 t;"]
    for j in range(4):
        lines += [f"prmt.b32 t, $4, $5, 0x7{4 + j}7{j};",
                  f"lop3.b32 ${j}, t, 0x000F000F, {magic:#010x}, 0xEA;"]  # 0xEA: (a & b) | c
    return "\n".join([*lines, "}"])


_ASM_FP16: tl.constexpr = tl.constexpr(unpack_asm(0x64006400))
_ASM_BF16: tl.constexpr = tl.constexpr(unpack_asm(0x43004300))


@triton.jit
def offset_bytes(e, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """OFF + (byte j of e & 0xF) for j = 0..3, each in x's dtype, e's shape (int32 elements).
    ASM: the PRMT + LOP3 inline PTX (CUDA only); else the same bits with Triton operations (the
    interpreter runs no inline assembly), element for element equal."""
    if ASM:
        if X_KIND == 1:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _ASM_FP16, "=r,=r,=r,=r,r,r", [e], dtype=(tl.float16,) * 4, is_pure=True,
                pack=2)
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _ASM_BF16, "=r,=r,=r,=r,r,r", [e], dtype=(tl.bfloat16,) * 4, is_pure=True,
                pack=2)
    else:
        if X_KIND == 1:
            o0 = ((e & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            o1 = (((e >> 8) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            o2 = (((e >> 16) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            o3 = (((e >> 24) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            o0 = ((e & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            o1 = (((e >> 8) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            o2 = (((e >> 16) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            o3 = (((e >> 24) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return o0, o1, o2, o3


@triton.jit
def lop3_tile(words, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, BLOCK_K] OFF + q in feature order and x's dtype from load_words' int32 words
    [BLOCK_N, BLOCK_K / 8] (nibble i of word c = feature 8c + i). Element 2c + h of `e` is word c
    shifted right by 4h, so its byte j's low nibble is feature 8c + 2j + h; offset_bytes' output
    j then holds features (8c + 2j, 8c + 2j + 1) side by side (adjacent K, one register), and the
    joins / permute below only rename registers: [BLOCK_N, c, h, a, b] with j = 2a + b ->
    [BLOCK_N, c, a, b, h] = feature 8c + 4a + 2b + h."""
    BN: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    e = tl.reshape(tl.join(words, words >> 4), [BN, 2 * C])
    o0, o1, o2, o3 = offset_bytes(e, X_KIND, ASM)
    t = tl.join(tl.join(tl.reshape(o0, [BN, C, 2]), tl.reshape(o2, [BN, C, 2])),
                tl.join(tl.reshape(o1, [BN, C, 2]), tl.reshape(o3, [BN, C, 2])))
    return tl.reshape(tl.permute(t, (0, 1, 3, 4, 2)), [BN, 8 * C])


@triton.jit
def finish(acc, offs_m, m_mask, rows, row_mask, pid_n, pid_k, b_ptr, y_ptr, part_ptr, count_ptr,
            M, N, stride_ym, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """y[offs_m, rows] = acc [ROWS, BLOCK_N] (+ bias), or with SPLIT_K > 1 this split's partial
    into the workspace, the last split to arrive adding them all (counters reset to 0)."""
    out_mask = m_mask[:, None] & row_mask[None, :]
    if SPLIT_K > 1:
        # Partials first, then the counter: the barrier makes every thread's stores precede the
        # (acq_rel, GPU-scope) increment, so the last program sees all partials (read past L1).
        part = part_ptr + offs_m[:, None] * N + rows[None, :]
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for i in range(SPLIT_K):
                acc += tl.load(part + i * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch / graph replay
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def k_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, input features per split): K in up to split_k ranges of whole block_k tiles; the
    count recomputed from the range so that no split is empty."""
    split = max(1, min(split_k, triton.cdiv(k, block_k)))
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return triton.cdiv(k, k_split), k_split


def split_workspace(
    split: int,
    m: int,
    n: int,
    tiles: int,  # output tiles: the arrival counters finish needs
    counters: torch.Tensor | None,  # the caller's int32 counters, zero between launches
    scales: torch.Tensor,  # stands in for both pointers when split == 1
    who: str,  # the entry point, for the error
    grow: bool,  # fewer than `tiles` counters: fresh zeroed ones (True) or a ValueError
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [split, m, n] fp32, counters) for finish; split 1: scales twice (valid
    pointers, never read). No counters given: fresh zeroed ones (the caching allocator's)."""
    if split == 1:
        return scales, scales
    if counters is None or (grow and counters.numel() < tiles):
        counters = torch.zeros(tiles, dtype=torch.int32, device=scales.device)
    elif counters.numel() < tiles or counters.dtype != torch.int32:
        raise ValueError(f"{who}: split-K needs >= {tiles} int32 counters")
    return torch.empty(split, m, n, device=scales.device, dtype=torch.float32), counters
