"""shard/kernels/int_gemm.py's dequant-fused W4A16 / W8A16 GEMM under Triton's interpreter on CPU
tensors (no GPU): int4 and int8; group sizes 32, 64, 128 and per-channel (tiles inside one group
and tiles holding several); integer and fractional (GGUF Q4_1 / Q4_K) zero points; bias; M, N and
K tails; and IntLinear dispatching above 16 rows to it.

Reference: x @ W.T in float32 with W = PackedInt.dequantize(float32) (exact weights). A tile inside
one group is computed as x @ (OFF + q).T - sum(x) * (OFF + z) with exact products in fp32, then
scaled: ~2^-20 relative error. Tiles of several groups (and int8 with bf16 x) round each weight to
x's dtype first, as the dequantize-then-matmul path does (< 2^-8 / 2^-11 relative, random signs).
The "dq" path and dequantize-then-F.linear ("cublas") round every weight to x's dtype the same
way. The output is rounded once. The interpreter truncates fp32 -> bf16 / fp16 casts instead of
rounding: an output moves by less than 2^-7 (bf16) / 2^-10 (fp16) of itself, a weight too, and
the weights' truncations all shrink magnitudes, so the bounds are twice that: 2^-6 and 2^-9 of
the largest output (benchmarks/int4_kernels.py runs these checks through the compiled kernels on
a GPU). A wrong group, nibble, zero or bias is off by far more
(checked by breaking each once).
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import BF16_DOT_PRELUDE, INTERPRETER_MARKS, run_interpreted

pytestmark = INTERPRETER_MARKS

_CHECK = textwrap.dedent(
    """
    from shard.kernels.int_gemm import GemmConfig, int_gemm
    from shard.quantization.int_weights import IntLinear, PackedInt, UnpackedInt

    BOUND = {torch.float16: 2**-9, torch.bfloat16: 2**-6}
    torch.manual_seed(0)

    def packed_weight(n, k, group, bits, fractional=False):
        groups = max(k // group, 1)
        q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, groups) * 0.1 + 0.01).half()
        if fractional:  # GGUF Q4_1 / Q4_K: zero = -min / scale, float32
            zeros = torch.rand(n, groups) * 30 - 15
        else:
            zeros = torch.randint(0, 2**bits, (n, groups)).half()
        return PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(k) // min(group, k), bits))

    def check(packed, x, bias, config, label):
        ref = x.float() @ packed.dequantize(torch.float32).t()
        if bias is not None:
            ref += bias.float()
        y = int_gemm(x, packed.qweight, packed.scales, packed.zeros, packed.group_size, bias,
                     bits=packed.bits, config=config)
        assert y.shape == ref.shape and y.dtype == x.dtype, label
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err <= BOUND[x.dtype], (label, err)

    # (bits, N, K, group, fractional zeros, dtype, bias, M, config): every group kind at both
    # widths, each dtype with and without bias, M / N tails below the tile, a K tail inside a
    # whole-row group.
    CASES = (
        (4, 40, 128, 32, False, torch.bfloat16, True, 17, GemmConfig(32, 32, 64, 4, 2)),  # 2 groups/tile
        (4, 48, 128, 64, True, torch.float16, False, 33, GemmConfig(32, 32, 64, 4, 2)),   # GGUF-like
        (4, 24, 256, 128, False, torch.float16, True, 20, GemmConfig(16, 16, 64, 4, 2, group_m=2)),
        (4, 20, 96, 96, False, torch.bfloat16, False, 18, GemmConfig(32, 32, 64, 4, 2)),  # per-channel, K tail
        (8, 40, 128, 128, False, torch.float16, False, 17, GemmConfig(32, 32, 64, 4, 2)),
        (8, 24, 128, 32, False, torch.bfloat16, True, 40, GemmConfig(32, 16, 64, 4, 2)),
        (4, 32, 64, 32, True, torch.bfloat16, True, 24, GemmConfig(16, 32, 32, 4, 2)),   # tile = group
        (4, 40, 128, 64, False, torch.bfloat16, True, 20,
         GemmConfig(16, 32, 64, 4, 2, x_split=True)),  # x split in registers
        (4, 24, 128, 32, True, torch.float16, True, 40,
         GemmConfig(32, 16, 64, 4, 2, x_split=True, w_first=True)),  # y.T = W @ x.T, 2 groups/tile
        (4, 40, 128, 128, False, torch.bfloat16, False, 17,
         GemmConfig(16, 32, 64, 4, 2, w_first=True)),  # y.T = W @ x.T, one group per tile
        (8, 24, 64, 32, False, torch.float16, True, 18, GemmConfig(16, 16, 32, 4, 2, w_first=True)),
        # "dq": the tile dequantized to x's dtype in feature order, acc carried through the dots
        (4, 40, 128, 32, False, torch.bfloat16, True, 17, GemmConfig(32, 32, 64, 4, 2, path="dq")),
        (4, 48, 128, 64, True, torch.float16, False, 33,
         GemmConfig(32, 32, 64, 4, 2, path="dq", w_first=True)),  # GGUF-like, tile = group
        (4, 20, 96, 96, False, torch.bfloat16, True, 18, GemmConfig(32, 32, 64, 4, 2, path="dq")),
        (8, 24, 128, 32, False, torch.float16, True, 40, GemmConfig(32, 16, 64, 4, 2, path="dq")),
        # the tile built from int32 words (8 nibbles each), one group per tile; 2 groups per
        # tile falls back to the byte-wise tile
        (4, 40, 256, 128, False, torch.bfloat16, True, 17,
         GemmConfig(32, 32, 64, 4, 2, path="dq", words=True)),
        (4, 24, 128, 64, True, torch.float16, False, 20,
         GemmConfig(16, 32, 64, 4, 2, path="dq", w_first=True, words=True)),
        (4, 24, 128, 32, False, torch.bfloat16, False, 18,
         GemmConfig(16, 32, 64, 4, 2, path="dq", words=True)),
        # dequantize (one kernel) then F.linear: several groups per tile, a K tail, int8
        (4, 24, 256, 64, False, torch.bfloat16, True, 20, GemmConfig(0, 16, 128, 4, 1, path="cublas")),
        (4, 20, 96, 96, True, torch.float16, False, 18, GemmConfig(0, 16, 128, 4, 1, path="cublas")),
        (8, 24, 128, 32, False, torch.bfloat16, False, 17, GemmConfig(0, 16, 64, 4, 1, path="cublas")),
    )
    for bits, n, k, group, fractional, dtype, with_bias, m, config in CASES:
        packed = packed_weight(n, k, group, bits, fractional)
        bias = torch.randn(n).to(dtype) if with_bias else None
        x = torch.randn(m, k).to(dtype)
        check(packed, x, bias, config, (bits, n, k, group, fractional, dtype, with_bias, m))

    # IntLinear above 16 rows: the GEMM (its first candidate off CUDA), batched leading dims,
    # act-order columns gathered by perm, against the dequantizing path of the same weight.
    g_idx = torch.randperm(128) % 2  # two groups of 64, features in any order
    q = torch.randint(0, 16, (24, 128), dtype=torch.uint8)
    scales, zeros = (torch.rand(24, 2) * 0.1).half(), torch.randint(0, 16, (24, 2)).half()
    packed = PackedInt.pack(UnpackedInt(q, scales, zeros, g_idx, 4))
    bias = torch.randn(24).bfloat16()
    fused = IntLinear(packed, bias, use_gemv=True)
    plain = IntLinear(packed, bias, use_gemv=False)
    assert fused.use_gemv and fused.perm is not None and not plain.use_gemv
    x = torch.randn(2, 9, 128).bfloat16()  # 18 rows
    ref, y = plain(x).float(), fused(x).float()
    assert y.shape == (2, 9, 24)
    err = float((y - ref).abs().max() / ref.abs().max())
    assert err <= 2**-6, err

    # The "lop3" path (int_gemv's lop3 tile with x padded to the bucket's 32 / 64 rows, its
    # pure-Triton unpack here): split-K 2 with shared counters (left at zero), an N tail, bias,
    # bf16 / fp16, and rows past block_m (two launches); int8 falls back to the dq tile.
    counters = torch.zeros(8, dtype=torch.int32)
    for bits, dtype, n, m, config in (
            (4, torch.bfloat16, 40, 20, GemmConfig(32, 16, 64, 4, 2, path="lop3", split_k=2)),
            (4, torch.float16, 32, 40, GemmConfig(64, 32, 32, 4, 2, path="lop3")),
            (4, torch.bfloat16, 24, 70, GemmConfig(64, 16, 64, 4, 2, path="lop3")),
            (8, torch.float16, 24, 20, GemmConfig(32, 16, 64, 4, 2, path="lop3"))):
        k, group = 128, 64
        q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, 2) * 0.1 + 0.01).half()
        zeros = torch.randint(0, 2**bits, (n, 2)).half()
        packed = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(k) // group, bits))
        bias = torch.randn(n).to(dtype)
        x = torch.randn(m, k).to(dtype)
        ref = x.float() @ packed.dequantize(torch.float32).t() + bias.float()
        y = int_gemm(x, packed.qweight, packed.scales, packed.zeros, group, bias, bits=bits,
                     config=config, counters=counters)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert y.shape == (m, n) and err <= 2**-6, (bits, dtype, m, config, err)
        assert int(counters.abs().sum()) == 0
    """
)


def test_int_gemm_in_interpreter():
    run_interpreted(BF16_DOT_PRELUDE + _CHECK)


# The 32 / 64-row buckets' new paths: the dq tile split along K (partials and arrival counters
# per output tile, int_tiles.finish); the lop3z tile
# (shard/kernels/int_gemm_lop3.py: the zero point subtracted in the unpack, here its Triton
# form). Counters shared across calls and left at zero; M / N / K-split tails; bias; bf16 and fp16;
# fractional zero points send a lop3z config to the lop3 tile.
_SPLIT_CHECK = textwrap.dedent(
    """
    from shard.kernels.int_gemm import GemmConfig, int_gemm
    from shard.quantization.int_weights import PackedInt, UnpackedInt

    torch.manual_seed(1)
    counters = torch.zeros(16, dtype=torch.int32)

    def packed_weight(n, k, group, fractional=False):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, k // group) * 0.1 + 0.01).half()
        zeros = (torch.rand(n, k // group) * 30 - 15 if fractional
                 else torch.randint(0, 16, (n, k // group)).half())
        return PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(k) // group, 4))

    # (N, K, group, fractional, dtype, bias, M, config)
    CASES = (
        # split-K 3 of 5 K tiles (the last split shorter), 2 M tiles x 2 N tiles, N tail
        (24, 320, 64, False, torch.bfloat16, True, 20,
         GemmConfig(16, 16, 64, 4, 2, path="dq", words=True, split_k=3)),
        (32, 256, 128, False, torch.float16, False, 33,
         GemmConfig(32, 16, 64, 4, 2, path="dq", split_k=2)),
        (16, 256, 64, True, torch.bfloat16, True, 17,
         GemmConfig(32, 16, 64, 4, 2, path="dq", w_first=True, split_k=4)),
        # 8 K steps over 4 groups (the scales carried one step ahead), dq and lop3z
        (16, 512, 128, False, torch.bfloat16, False, 18,
         GemmConfig(16, 16, 64, 4, 2, path="dq", words=True)),
        (16, 512, 64, False, torch.float16, True, 18,
         GemmConfig(32, 16, 64, 4, 2, path="lop3z")),
        # lop3z: split-K 2 with an N tail (masked loads), whole-tile shapes (unmasked), fp16
        (40, 256, 128, False, torch.bfloat16, True, 20,
         GemmConfig(32, 16, 64, 4, 2, path="lop3z", split_k=2)),
        (32, 256, 64, False, torch.float16, False, 64,
         GemmConfig(64, 32, 64, 4, 2, path="lop3z", split_k=1)),
        (32, 256, 128, False, torch.bfloat16, False, 40,
         GemmConfig(32, 16, 64, 4, 2, path="lop3z", split_k=4)),  # rows past 32
        (24, 128, 64, True, torch.bfloat16, True, 20,
         GemmConfig(32, 16, 64, 4, 2, path="lop3z")),  # fractional zeros: the lop3 tile
    )
    for n, k, group, fractional, dtype, with_bias, m, config in CASES:
        packed = packed_weight(n, k, group, fractional)
        bias = torch.randn(n).to(dtype) if with_bias else None
        x = torch.randn(m, k).to(dtype)
        ref = x.float() @ packed.dequantize(torch.float32).t()
        if bias is not None:
            ref += bias.float()
        y = int_gemm(x, packed.qweight, packed.scales, packed.zeros, group, bias, config=config,
                     counters=counters, int_zeros=not fractional)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        label = (n, k, group, fractional, dtype, m, config)
        assert y.shape == (m, n) and y.dtype == dtype, label
        assert err <= (2**-6 if dtype == torch.bfloat16 else 2**-9), (label, err)
        assert int(counters.abs().sum()) == 0, label
    """
)


def test_int_gemm_split_k_and_lop3z_in_interpreter():
    run_interpreted(BF16_DOT_PRELUDE + _SPLIT_CHECK)
