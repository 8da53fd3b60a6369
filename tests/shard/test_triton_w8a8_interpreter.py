"""The W8A8-int8 Triton kernels under Triton's interpreter on CPU tensors (no GPU):
shard/kernels/int8_quant.py against w8a8.quantize_per_token (the CPU reference: bit-equal, ties
rounded half to even, a zero row, K over several blocks, bf16 / fp16 / fp32 inputs), and
shard/kernels/int8_gemm.py: int32 sums exact against int64 matmuls for a candidate of every batch
bucket with M / N / K tails (masked, and K a multiple of the tile: the unmasked loop), the fused
epilogue against the torch form's float32 rescale (+ bias) within the output dtype's rounding,
and its SiLU-and-mul variant (a merged gate/up weight) against the unfused form's roundings;
W8A8Linear's CUDA-side glue (_triton_forward) on CPU tensors against its own torch form.

Triton reads TRITON_INTERPRET when a kernel is defined, hence a fresh process for the check
(tests/helpers/triton_interpreter.py). The interpreter's fp32 -> bf16 casts truncate, so outputs
are checked to one unit in the last place of the output dtype (2^-7 bf16, 2^-10 fp16, relative;
fp16 subnormals: one step, 2^-24).
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import INTERPRETER_MARKS, run_interpreted

pytestmark = INTERPRETER_MARKS

_QUANT = textwrap.dedent(
    """
    import torch
    from shard.kernels.int8_quant import quantize_int8_per_token
    from shard.quantization.w8a8 import quantize_per_token

    torch.manual_seed(0)
    cases = [torch.randn(6, 300) * torch.linspace(0.01, 50, 6)[:, None],  # one block, K tail
             torch.randn(3, 2100)]  # two blocks of 2048, a tail in the second
    ties = torch.zeros(2, 40)
    ties[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5])  # scale exactly 1: halves
    cases.append(ties)  # row 1 is all zeros: the 1e-12 floor
    for x in cases:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            xd = x.to(dtype)
            q, s = quantize_int8_per_token(xd)
            q_ref, s_ref = quantize_per_token(xd)
            assert q.dtype == torch.int8 and s.dtype == torch.float32
            assert torch.equal(s, s_ref), (dtype, x.shape)
            assert torch.equal(q, q_ref), (dtype, x.shape, (q != q_ref).sum())
    q, _ = quantize_int8_per_token(ties[:1])
    assert q[0, :6].tolist() == [127, 0, 2, 2, -2, 0], q[0, :6]
    # a strided input (a column slice of a wider tensor)
    wide = torch.randn(4, 96).bfloat16()
    assert torch.equal(quantize_int8_per_token(wide[:, 16:80])[0],
                       quantize_per_token(wide[:, 16:80])[0])
    """
)

_GEMM = textwrap.dedent(
    """
    import torch
    from shard.kernels.int8_gemm import CONFIGS, M_BUCKETS, int8_gemm, int8_mm, tune_int8_gemm

    torch.manual_seed(0)
    ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
    # (M, N, K, bucket): tails everywhere with a K that is no multiple of the tile (masked loop),
    # and K a multiple of 256 and 128 (the unmasked loop). One candidate per bucket.
    cases = [(5, 37, 300, 16), (19, 70, 256, 128), (130, 45, 384, 512), (3, 130, 256, None)]
    for i, (m, n, k, bucket) in enumerate(cases):
        config = CONFIGS[bucket][i % len(CONFIGS[bucket])]
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        acc = xq.long() @ wq.long().t()  # [M, N] exact
        got = int8_mm(xq, wq, config)
        assert got.dtype == torch.int32 and torch.equal(got.long(), acc), (m, n, k, config)
        a_scale = torch.rand(m) * 1e-2 + 1e-4
        w_scale = torch.rand(n) * 1e-3 + 1e-5
        for dtype in (torch.bfloat16, torch.float16):
            bias = torch.randn(n).to(dtype) if (i % 2) else None
            ref = acc.float() * a_scale[:, None] * w_scale[None, :]  # the torch form's order
            if bias is not None:
                ref = ref + bias.float()
            y = int8_gemm(xq, a_scale, wq, w_scale, bias, dtype, config)
            assert y.shape == (m, n) and y.dtype == dtype
            # one unit in the last place (normal numbers), one subnormal step (fp16: 2^-24)
            excess = (y.float() - ref).abs() - (ULP[dtype] * ref.abs() + 2**-24)
            assert excess.max() <= 0, (m, n, k, dtype, bias is not None, float(excess.max()))
    # SiLU-and-mul epilogue on a gate/up weight [2I, K] (I = 37: an output tail), with and
    # without bias: the unfused form's roundings (y in the dtype, silu(gate) rounded, product).
    i_cols, k = 37, 200
    wq = torch.randint(-127, 128, (2 * i_cols, k), dtype=torch.int8)
    w_scale = torch.rand(2 * i_cols) * 1e-3 + 1e-5
    for j, (m, bucket) in enumerate(((5, 16), (19, 128))):
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        a_scale = torch.rand(m) * 1e-2 + 1e-4
        acc = (xq.long() @ wq.long().t()).float()
        for dtype in (torch.bfloat16, torch.float16):
            bias = torch.randn(2 * i_cols).to(dtype) if j else None
            full = acc * a_scale[:, None] * w_scale[None, :]
            if bias is not None:
                full = full + bias.float()
            gate, up = full.to(dtype).float().chunk(2, dim=-1)
            ref = torch.nn.functional.silu(gate).to(dtype).float() * up
            y = int8_gemm(xq, a_scale, wq, w_scale, bias, dtype, CONFIGS[bucket][1],
                          silu_mul=True)
            assert y.shape == (m, i_cols) and y.dtype == dtype
            # three roundings, each to within one unit (truncating casts): four units of slack
            excess = (y.float() - ref).abs() - (4 * ULP[dtype] * ref.abs() + 2**-22)
            assert excess.max() <= 0, (m, dtype, bias is not None, float(excess.max()))
    # W8A8Linear's Triton glue (what runs on CUDA: quantize kernel, the bucket's config, the
    # GEMM, silu_mul), driven on CPU tensors against the layer's own torch form.
    from shard.quantization.int_weights import UnpackedInt
    from shard.quantization.w8a8 import W8A8Linear

    def w8a8_layer(n, k):
        q = torch.randint(1, 256, (n, k), dtype=torch.int16).to(torch.uint8)
        s = torch.rand(n, 1) * 1e-3 + 1e-4
        return W8A8Linear(UnpackedInt(q, s, torch.full_like(s, 128.0),
                                      torch.zeros(k, dtype=torch.int64), 8))

    gate, up = w8a8_layer(24, 96), w8a8_layer(24, 96)
    merged = W8A8Linear.merge_rows(gate, up)
    for silu in (False, True):
        merged._gemm_configs[(torch.bfloat16, silu)] = tune_int8_gemm(
            merged.qweight, merged.weight_scale, None, torch.bfloat16, silu)
    for m in (3, 20):
        x = (torch.randn(m, 96) * torch.linspace(0.1, 5, m)[:, None]).bfloat16()
        want = merged(x).float()  # CPU: the torch form
        got = merged._triton_forward(x).float()
        assert ((got - want).abs() <= 2**-7 * want.abs() + 1e-6).all(), m
        want = merged.forward_silu_mul(x).float()
        got = merged._triton_forward(x, silu_mul=True).float()
        assert got.shape == (m, 24)
        assert ((got - want).abs() <= 4 * 2**-7 * want.abs() + 1e-4).all(), m
    # The untimed tuning on CPU: every bucket gets its first candidate, each launched once.
    wq = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    chosen = tune_int8_gemm(wq, torch.ones(40), None, torch.bfloat16)
    assert list(chosen) == list(M_BUCKETS)
    assert all(chosen[b] is CONFIGS[b][0] for b in M_BUCKETS)
    """
)


def test_int8_quantize_kernel_is_bit_equal_to_quantize_per_token():
    run_interpreted(_QUANT)


def test_int8_gemm_sums_are_exact_and_the_epilogue_matches_the_torch_form():
    run_interpreted(_GEMM)
