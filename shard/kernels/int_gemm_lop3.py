"""The "lop3z" W4A16 GEMM tile for the 32- and 64-row buckets (CUDA, Triton; int_gemm's path
"lop3z"): int4 weights unpacked by PRMT / LOP3 with the zero point subtracted in the same inline
PTX, so the K loop needs no row sums of x.

y[M, N] = x[M, K] @ W[N, K].T (+ bias[N]), M <= ROWS (32 or 64; x padded with masked loads),
x bf16/fp16, W in PackedInt's layout with integer zero points and tiles inside one group.

Why: the "lop3" tile (int_gemv._lop3_k_loop with x padded to the bucket) computes per K step
s * ((OFF + q) @ x.T - (OFF + z) * sum_k x): the row sums of the [ROWS, BLOCK_K] x tile are a
shared-memory read and a shuffle reduction every step, ~130 of the ~510 SASS instructions a warp
issues per step at 64 rows x 64 weight rows (sm_90, Triton 3.6; benchmarks/INT_KERNELS.md, "M =
64"), on a step that is one dependent chain. Here each packed pair OFF + q (one 32-bit register,
two adjacent features of one weight row) gets one more instruction, `fma.rn.bf16x2 r, r, 1.0,
-(OFF + z)` (f16x2 for fp16 x): q - z, an integer in [-15, 15], exact in either dtype; then
acc += s * ((q - z) @ x.T): one fp32 FMA per accumulator element and no reduction.

Exact like the lop3 tile: the MMA multiplies exact integers by x and sums in fp32, the scale
applies to the group's partial sum. Integer zero points only (int_gemm runs the "lop3" tile for
fractional GGUF zeros). Split-K with int_tiles.finish (partials, an arrival counter per weight row
block, the last split adds them and resets the counter). Under TRITON_INTERPRET (CPU tensors) the
same values come from Triton operations (ASM False): tests/shard/test_triton_int_gemm_interpreter.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.int_dequant import group_params, kernel_group, x_kind
from shard.kernels.int_tiles import finish, k_splits, offset_bytes, split_workspace

__all__ = ["lop3z_gemm", "unpack_sub_asm"]


def unpack_sub_asm(magic: int, one: int, fma: str) -> str:
    """int_tiles.unpack_asm's PRMT + LOP3 (OFF + nibble j of elements a, b as a packed pair),
    then one packed FMA per pair: (OFF + q) * 1 + nz = q - z, where nz is the pair
    (element a's -(OFF + z), element b's) built once from the low halves of $6 and $7."""
    lines = ["{", ".reg .b32 t, nz, one;", "prmt.b32 nz, $6, $7, 0x5410;",
             f"mov.b32 one, {one:#010x};"]
    for j in range(4):
        lines += [f"prmt.b32 t, $4, $5, 0x7{4 + j}7{j};",
                  f"lop3.b32 t, t, 0x000F000F, {magic:#010x}, 0xEA;",
                  f"{fma} ${j}, t, one, nz;"]
    return "\n".join([*lines, "}"])


_ASM_SUB_FP16: tl.constexpr = tl.constexpr(unpack_sub_asm(0x64006400, 0x3C003C00,
                                                          "fma.rn.f16x2"))
_ASM_SUB_BF16: tl.constexpr = tl.constexpr(unpack_sub_asm(0x43004300, 0x3F803F80,
                                                          "fma.rn.bf16x2"))


@triton.jit
def _sub_asm(e, nz, ASM_TEXT: tl.constexpr, DT: tl.constexpr):
    """_sub_bytes' inline PTX in dtype DT: each row's -(OFF + z) as DT's bits, one per element."""
    nzd = nz.to(DT)
    nz2 = tl.broadcast_to(nzd.to(tl.int16, bitcast=True).to(tl.int32)[:, None], e.shape)
    return tl.inline_asm_elementwise(ASM_TEXT, "=r,=r,=r,=r,r,r,r,r", [e, nz2],
                                     dtype=(nzd.dtype,) * 4, is_pure=True, pack=2)


@triton.jit
def _sub_bytes(e, nz, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """q - z for byte j = 0..3's low nibble q of the int32 elements e [BN, E], in x's dtype; nz
    [BN] fp32 = -(OFF + z) of each row (exact in x's dtype: OFF + z <= 143 in bf16, 1039 fp16)."""
    if ASM:
        if X_KIND == 1:
            o0, o1, o2, o3 = _sub_asm(e, nz, _ASM_SUB_FP16, tl.float16)
        else:
            o0, o1, o2, o3 = _sub_asm(e, nz, _ASM_SUB_BF16, tl.bfloat16)
    else:
        o0, o1, o2, o3 = offset_bytes(e, X_KIND, False)
        dt = o0.dtype
        o0 = (o0.to(tl.float32) + nz[:, None]).to(dt)
        o1 = (o1.to(tl.float32) + nz[:, None]).to(dt)
        o2 = (o2.to(tl.float32) + nz[:, None]).to(dt)
        o3 = (o3.to(tl.float32) + nz[:, None]).to(dt)
    return o0, o1, o2, o3


@triton.jit
def _sub_tile(words, nz, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, BLOCK_K] q - z in feature order and x's dtype from int32 words [BLOCK_N,
    BLOCK_K / 8] (nibble i of word c = feature 8c + i): int_tiles.lop3_tile's element order and
    register renaming, with _sub_bytes in place of offset_bytes."""
    BN: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    e = tl.reshape(tl.join(words, words >> 4), [BN, 2 * C])
    o0, o1, o2, o3 = _sub_bytes(e, nz, X_KIND, ASM)
    t = tl.join(tl.join(tl.reshape(o0, [BN, C, 2]), tl.reshape(o2, [BN, C, 2])),
                tl.join(tl.reshape(o1, [BN, C, 2]), tl.reshape(o3, [BN, C, 2])))
    return tl.reshape(tl.permute(t, (0, 1, 3, 4, 2)), [BN, 8 * C])


@triton.jit(do_not_specialize=["M"])
def _lop3z_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, M, N] fp32 workspace
    count_ptr,  # SPLIT_K > 1: [>= cdiv(N, BLOCK_N)] int32, zero between launches
    M, N, K,
    K_SPLIT,  # input features per split: a multiple of BLOCK_K
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # x's rows padded to this (the bucket: 32 / 64)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # inside one group
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,  # cp.async stages (>= 2)
    HAS_BIAS: tl.constexpr,
    X_KIND: tl.constexpr,  # int_dequant.x_kind: fp16 1, bf16 2
    ASM: tl.constexpr,  # the unpack as inline PTX (CUDA); False: Triton operations (interpreter)
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unpredicated weight loads
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
    row_mask = rows < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_rows = (q_ptr + rows.to(tl.int64) * stride_qn).to(tl.pointer_type(tl.int32))
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [ROWS, 1]
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)  # y's tile transposed
    s, z = group_params(s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_sn, GROUP, 1)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        # the next tile's scales now (2-byte loads are not pipelined: int_dequant.group_params;
        # two steps ahead through the loop's registers, Triton stops pipelining the loop)
        s_next, z_next = group_params(s_ptr, z_ptr, rows, row_mask, k0 + BLOCK_K, k_hi,
                                      stride_sn, GROUP, 1)
        # the tile's packed rows as int32 words in 16-byte vectors, x's [ROWS, BLOCK_K] tile
        offs_w = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                                   BLOCK_K // 8)
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            words = tl.load(w_rows[:, None] + offs_w[None, :], eviction_policy="evict_first")
            xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            words = tl.load(w_rows[:, None] + offs_w[None, :],
                            mask=row_mask[:, None] & (offs_w * 8 < k_hi)[None, :], other=0,
                            eviction_policy="evict_first")
            xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < k_hi)[None, :],
                         other=0.0)
        if X_KIND == 1:
            nz = -(tl.reshape(z, [BLOCK_N]) + 1024.0)  # -(OFF + z), OFF as offset_bytes adds it
        else:
            nz = -(tl.reshape(z, [BLOCK_N]) + 128.0)
        v = _sub_tile(words, nz, X_KIND, ASM)  # [BLOCK_N, BLOCK_K] q - z, exact
        # the weight tile as the MMA's first operand (registers on Hopper), x's from shared memory
        acc += tl.dot(v, tl.trans(xt)) * tl.reshape(s, [BLOCK_N])[:, None]  # [BLOCK_N, ROWS]
        s, z = s_next, z_next
    finish(tl.trans(acc), offs_m, m_mask, rows, row_mask, pid_n, pid_k, b_ptr, y_ptr, part_ptr,
           count_ptr, M, N, stride_ym, ROWS, BLOCK_N, SPLIT_K, HAS_BIAS)


def lop3z_gemm(
    x: torch.Tensor,  # [M, K] bf16/fp16, M <= rows
    qweight: torch.Tensor,  # [N, K/2] uint8, rows 16-byte aligned, K % 32 == 0
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G], integer values
    group_size: int,
    bias: torch.Tensor | None,  # [N]
    rows: int,  # x padded to this many rows (32 or 64)
    block_n: int,
    block_k: int,  # inside one group, >= 32
    warps: int,
    stages: int,
    split_k: int = 1,
    counters: torch.Tensor | None = None,  # split-K: int32, zero, >= cdiv(N, block_n)
) -> torch.Tensor:
    """y [M, N] = x @ dequant(qweight).T (+ bias) in x's dtype (int_gemm checks the weight's
    layout and the tile's fit before calling)."""
    m, k = x.shape
    n = qweight.shape[0]
    if not 1 <= m <= rows or rows not in (16, 32, 64):
        raise ValueError(f"lop3z_gemm: {m} rows for a {rows}-row tile (16, 32 or 64)")
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) != k) or x.data_ptr() % 16:
        x = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    tiles_n = triton.cdiv(n, block_n)
    split, k_split = k_splits(k, block_k, split_k)
    part, counters = split_workspace(split, m, n, tiles_n, counters, scales, "lop3z_gemm",
                                     grow=True)
    _lop3z_kernel[(tiles_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, part, counters,
        m, n, k, k_split,
        k, qweight.stride(0), scales.stride(0), n,
        GROUP=kernel_group(group_size, k),
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        STAGES=stages,
        HAS_BIAS=bias is not None,
        X_KIND=x_kind(x.dtype),
        ASM=x.is_cuda,
        EVEN=n % block_n == 0 and k % block_k == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return y
