"""shard/kernels/int_gemv.py's W4A16 kernel under Triton's interpreter on CPU tensors (no GPU):
the CUDA-core path (1 row) and the tensor-core path (2..16 rows padded to 16), int4 and int8,
asymmetric groups,
a whole-row group, N and K tails, bias, fractional (GGUF) zero points, tiles holding several
groups, split-K (partials reduced by the last split, counters left at zero for the next launch);
against the dequantized weight in float32.

Triton reads TRITON_INTERPRET when a kernel is defined, hence a fresh process for the check
(tests/helpers/triton_interpreter.py). The interpreter's fp32 -> bf16 casts truncate, so bf16
outputs are checked to 2^-7 of the largest output, fp16 ones to 2^-10.
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import BF16_DOT_PRELUDE, INTERPRETER_MARKS, run_interpreted

pytestmark = INTERPRETER_MARKS

_CHECK = textwrap.dedent(
    """
    from shard.kernels.int_gemv import int4_gemv
    from shard.quantization.int_weights import PackedInt, UnpackedInt

    BOUND = {torch.float16: 2**-10, torch.bfloat16: 2**-7}


    def random_int4(n, k, group, frac=False):
        # (packed int4 weight [N, K] of random codes, scales and zeros (fractional with frac),
        # its fp32 dequantization [N, K])
        groups = k // group
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, groups) * 0.1 + 0.01).half()
        zeros = (torch.rand(n, groups) * 30 - 15 if frac
                 else torch.randint(0, 16, (n, groups)).half())
        packed = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(k) // group, 4))
        return packed, packed.dequantize(torch.float32)


    torch.manual_seed(0)
    # (N, K, group): two groups per row with a 64-wide tile; a whole-row group with a K tail
    # inside the last tile; an N tail below BLOCK_N. Shape, dtype and bias run as a pairwise
    # covering set (6 cases, not the full product's 12: every pair of their values meets in one),
    # each at every batch size.
    for i, (n, k, group) in enumerate(((48, 128, 64), (40, 96, 96), (5, 64, 32))):
        packed, w = random_int4(n, k, group)  # w [N, K]
        assert packed.group_size == group and packed.g_idx is None
        for j, dtype in enumerate((torch.bfloat16, torch.float16)):
            # shape i meets both bias states (j = 0, 1), dtype j too (i = 0, 1)
            for bias in ((torch.randn(n).to(dtype),) if (i + j) % 2 else (None,)):
                for m in (1, 3, 16):
                    x = torch.randn(m, k).to(dtype)
                    ref = x.float() @ w.t() + (0 if bias is None else bias.float())
                    y = int4_gemv(x, packed.qweight, packed.scales, packed.zeros, packed.group_size,
                                  bias, block_n=16)
                    assert y.shape == (m, n) and y.dtype == dtype
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                    assert err <= BOUND[dtype], (n, k, group, dtype, bias is not None, m, err)
    # Split-K (2 and 3 splits of a 96-feature K, 32-wide tiles; 2 of 128 in 64-wide tiles) and
    # tiles of several groups (64 features, groups of 16 and 32), int4 and int8, 1 and 5 rows:
    # every split's partial reaches y once, and the counters return to zero (a second launch on
    # the same counters gives the same result).
    from shard.kernels.int_gemv import GemvConfig

    for bits, k, group, config in ((4, 96, 32, GemvConfig(16, 32, 4, 2, split_k=2)),
                                   (8, 96, 96, GemvConfig(16, 32, 4, 2, split_k=3)),
                                   (4, 128, 16, GemvConfig(16, 64, 4, 2)),
                                   (8, 128, 32, GemvConfig(16, 64, 4, 2, split_k=2)),
                                   # int4 re-interleaved in registers, x contiguous
                                   (4, 96, 32, GemvConfig(16, 32, 4, 2, split_k=2, join=True)),
                                   (4, 128, 16, GemvConfig(16, 64, 4, 2, join=True)),
                                   # batch 1: int32 words (M = 5 falls back to the join tile)
                                   (4, 128, 64, GemvConfig(16, 64, 4, 2, split_k=2, words=True)),
                                   (4, 96, 96, GemvConfig(16, 128, 4, 2, words=True))):
        n = 20
        groups = k // group
        q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, groups) * 0.1 + 0.01).half()
        zeros = torch.randint(0, 2**bits, (n, groups)).half()
        packed = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(k) // group, bits))
        w = packed.dequantize(torch.float32)
        bias = torch.randn(n).half()
        counters = torch.zeros(4, dtype=torch.int32)
        for m in (1, 5):
            x = torch.randn(m, k).half()
            ref = x.float() @ w.t() + bias.float()
            for _ in range(2):
                y = int4_gemv(x, packed.qweight, packed.scales, packed.zeros, group, bias,
                              bits=bits, config=config, counters=counters)
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                assert err <= 2**-10, (bits, group, config, m, err)
                assert int(counters.abs().sum()) == 0
    # IntLinear's own dispatch: act-order columns (x gathered by perm) into the kernel, its
    # configs chosen at its first call; above 16 rows the dequant-fused GEMM.
    from shard.quantization.int_weights import IntLinear

    g_idx = torch.randperm(64) % 2  # two groups of 32, features in any order
    q = torch.randint(0, 16, (24, 64), dtype=torch.uint8)
    scales, zeros = (torch.rand(24, 2) * 0.1).half(), torch.randint(0, 16, (24, 2)).half()
    linear = IntLinear(PackedInt.pack(UnpackedInt(q, scales, zeros, g_idx, 4)), use_gemv=True)
    assert linear.use_gemv and linear.perm is not None
    w = linear.dequantized_weight(torch.float32)
    for m in (1, 5, 20):
        x = torch.randn(m, 64).bfloat16()
        ref = x.float() @ w.t()
        err = float((linear(x).float() - ref).abs().max() / ref.abs().max())
        assert err <= 2**-7, (m, err)
    assert set(linear._tuned) == {torch.bfloat16}
    # W8A16: one byte per value, zero points up to 255.
    q = torch.randint(0, 256, (24, 64), dtype=torch.uint8)
    zeros = torch.randint(0, 256, (24, 2)).half()
    packed = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(64) // 32, 8))
    w = packed.dequantize(torch.float32)
    for m in (1, 5):
        x = torch.randn(m, 64).half()
        ref = x.float() @ w.t()
        y = int4_gemv(x, packed.qweight, packed.scales, packed.zeros, 32, bits=8)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err <= 2**-10, (m, err)
    # GGUF Q4_1 / Q4_K: fractional float32 zero points (zero = -min / scale), through IntLinear.
    q = torch.randint(0, 16, (24, 64), dtype=torch.uint8)
    zeros = torch.rand(24, 2) * 30 - 15
    linear = IntLinear(PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(64) // 32, 4)),
                       use_gemv=True)
    assert linear.use_gemv and not linear.int_zeros
    w = linear.dequantized_weight(torch.float32)
    for m in (1, 5):
        x = torch.randn(m, 64).half()
        ref = x.float() @ w.t()
        err = float((linear(x).float() - ref).abs().max() / ref.abs().max())
        assert err <= 2**-10, (m, err)
    # (Last: the draws above keep their random streams.) The lop3 tiles (int4, 1..16 rows padded to 16, weights as the MMA's first operand): the
    # interpreter runs their pure-Triton unpack, bit for bit the inline PTX's operations. bf16 and
    # fp16, integer and fractional (GGUF) zero points, an N tail (masked loads) and none (the
    # unmasked EVEN form), bias, split-K 2 with its counters, a whole-row group; stages 1 (the
    # next tile prefetched in registers, nothing read past a split) and 2 (Triton's pipeliner).
    for dtype, n, k, group, frac, config in (
            (torch.bfloat16, 20, 128, 64, False, GemvConfig(32, 64, 4, 1, split_k=2,
                                                            use_dot=True, lop3=True)),
            (torch.float16, 32, 96, 96, True, GemvConfig(16, 32, 4, 2, use_dot=True,
                                                         lop3=True)),
            (torch.bfloat16, 32, 128, 128, False, GemvConfig(16, 32, 4, 1, split_k=2,
                                                             use_dot=True, lop3=True))):
        packed, w = random_int4(n, k, group, frac)
        bias = torch.randn(n).to(dtype)
        counters = torch.zeros(4, dtype=torch.int32)
        for m in (1, 7, 16):
            x = torch.randn(m, k).to(dtype)
            ref = x.float() @ w.t() + bias.float()
            for _ in range(2):
                y = int4_gemv(x, packed.qweight, packed.scales, packed.zeros, group, bias,
                              config=config, counters=counters, int_zeros=not frac)
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                assert err <= BOUND[dtype], (dtype, config, m, err)
                assert int(counters.abs().sum()) == 0
    # The multi-group tiles (shard/kernels/int_gemv_wide.py): "wide" (batch 1, CUDA cores, the
    # words as [BLOCK_N, groups, words per group]) and "diag" (1..16 rows, tensor cores, x as a
    # group-diagonal MMA operand: row m * NG + g holds x row m on group g's features). bf16 and
    # fp16, integer and fractional zero points, groups of 32 / 64 / 128 (2-4 per tile), an N
    # tail (masked loads) and none (EVEN), bias, split-K with its counters, stages 0 (one tile
    # at a time), 1 (register double buffer, the prefetch past a split reading nothing) and 2
    # (cp.async), diag at 1..16 rows (x' of 16 and 32 rows), and the persistent form.
    for dtype, n, k, group, frac, config, ms in (
            (torch.bfloat16, 24, 512, 128, False,
             GemvConfig(16, 256, 4, 1, split_k=2, wide=True, pdl=True), (1,)),
            (torch.float16, 32, 256, 32, True, GemvConfig(8, 128, 4, 2, wide=True), (1,)),
            (torch.float16, 24, 512, 64, False,
             GemvConfig(8, 256, 4, 0, split_k=2, wide=True, pdl=True), (1,)),
            (torch.bfloat16, 40, 512, 64, False,
             GemvConfig(16, 256, 4, 1, split_k=2, use_dot=True, diag=True, pdl=True), (1, 3, 8)),
            (torch.float16, 32, 256, 32, True,
             GemvConfig(16, 128, 4, 2, use_dot=True, diag=True), (2, 5)),
            (torch.bfloat16, 32, 256, 64, False,
             GemvConfig(32, 128, 4, 0, use_dot=True, diag=True), (16, 1)),
            # persistent (2 programs per "SM", 2 under the interpreter: each loops over several
            # units, the next unit's first tile prefetched; a split of 2 where 3 tiles a row
            # take a split of 1)
            (torch.bfloat16, 40, 512, 128, False,
             GemvConfig(8, 256, 4, 1, split_k=2, wide=True, pdl=True, persist=2), (1,)),
            (torch.float16, 32, 768, 64, True,
             GemvConfig(8, 256, 4, 1, split_k=2, wide=True, persist=1), (1,)),
            (torch.bfloat16, 40, 512, 64, False,
             GemvConfig(16, 256, 4, 1, split_k=2, use_dot=True, diag=True, persist=2), (1, 3)),
            # the wide tile's inline-PTX form (GemvConfig.ptx; here its Triton twin: x planes from
            # int32 pairs, scales per word column, 4-shift unpack): an N tail with split-K,
            # fp16 with fractional zeros in groups of 32 and the next tile prefetched (stages 1,
            # the prefetch past the range reading nothing), a 512-wide tile of groups of 64
            (torch.bfloat16, 24, 512, 128, False,
             GemvConfig(16, 256, 4, 0, split_k=2, wide=True, pdl=True, ptx=True), (1,)),
            (torch.float16, 32, 256, 32, True, GemvConfig(8, 128, 4, 1, wide=True, ptx=True),
             (1,)),
            (torch.bfloat16, 16, 1024, 64, True,
             GemvConfig(16, 512, 2, 0, wide=True, pdl=True, ptx=True), (1,)),
            # ... scaled per 4 words (ptx 2): groups of 32 (one 4-word run a group) with an N
            # tail and split-K, fp16 groups of 128 with the next tile prefetched
            (torch.bfloat16, 24, 512, 32, True,
             GemvConfig(16, 256, 4, 0, split_k=2, wide=True, pdl=True, ptx=2), (1,)),
            (torch.float16, 16, 1024, 128, False, GemvConfig(8, 256, 4, 1, wide=True, ptx=2),
             (1,))):
        packed, w = random_int4(n, k, group, frac)
        bias = torch.randn(n).to(dtype)
        counters = torch.zeros(8, dtype=torch.int32)
        for m in ms:
            x = torch.randn(m, k).to(dtype)
            ref = x.float() @ w.t() + bias.float()
            for _ in range(2 if config.split_k > 1 else 1):
                y = int4_gemv(x, packed.qweight, packed.scales, packed.zeros, group, bias,
                              config=config, counters=counters, int_zeros=not frac)
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                assert err <= BOUND[dtype], (dtype, config, m, err)
                assert int(counters.abs().sum()) == 0
    # A multi-group config where its tile does not apply (a group of 96: not a power of two)
    # runs the default tile instead, with the same result.
    q = torch.randint(0, 16, (16, 192), dtype=torch.uint8)
    scales, zeros = (torch.rand(16, 2) * 0.1).half(), torch.randint(0, 16, (16, 2)).half()
    packed = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(192) // 96, 4))
    w = packed.dequantize(torch.float32)
    for m, config in ((1, GemvConfig(8, 96, 4, 1, wide=True)),
                      (2, GemvConfig(8, 96, 4, 1, use_dot=True, diag=True))):
        x = torch.randn(m, 192).half()
        y = int4_gemv(x, packed.qweight, packed.scales, packed.zeros, 96, config=config)
        err = float((y.float() - x.float() @ w.t()).abs().max() / (x.float() @ w.t()).abs().max())
        assert err <= 2**-10, (m, config, err)
    """
)


def test_int4_gemv_in_interpreter():
    run_interpreted(BF16_DOT_PRELUDE + _CHECK)
