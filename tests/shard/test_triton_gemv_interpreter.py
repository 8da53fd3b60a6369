"""shard/kernels/gemv.py's kernel under Triton's interpreter on CPU tensors (no GPU): 16-bit
weights (every config of every batch path) and the fused SiLU-and-mul epilogue.

Triton reads TRITON_INTERPRET when a kernel is defined, hence a fresh process per check.
Interpreter limits (triton 3.6): its fp32 -> bf16 casts truncate (so bf16 outputs are checked to
2^-7, fp16 ones to 2^-10), and its tl.dot multiplies bf16 operands as raw 16-bit integers. The
check patches the interpreter's dot to widen bf16 operands to fp32 first (exact), so that the
bf16 tensor-core configs run here too; the GPU tests (tests/gpu/test_decode_linear_cuda.py) run
the real thing.
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import (
    BF16_DOT_PRELUDE,
    INTERPRETER_MARKS,
    run_interpreted,
)

_PRELUDE = BF16_DOT_PRELUDE + textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    from shard.kernels.gemv import configs_for, gemv

    def max_rel(y, ref):
        return float((y.float() - ref).abs().max() / ref.abs().max())

    def same_up_to_rounding(y, unfused, cfg):
        # Bit-equal without tl.dot; with it, within 4 ulps of the dtype (elementwise, relative)
        # plus 2^-10 of one ulp of the largest output (outputs near zero).
        if not cfg.kwargs["USE_DOT"]:
            return torch.equal(y, unfused)
        ulp = torch.finfo(unfused.dtype).eps  # 2^-10 (fp16), 2^-7 (bf16)
        a, b = y.float(), unfused.float()
        bound = 4 * ulp * b.abs() + ulp * 2**-10 * float(b.abs().max())
        return bool(((a - b).abs() <= bound).all())

    BOUND = {torch.float16: 2**-10, torch.bfloat16: 2**-7}
    """
)

# Plain GEMV vs an fp32 reference: every config of each batch path, whole N tiles, N and K tails,
# N < BLOCK_N. The interpreter's time goes per program (grid size): the whole-tile shape is N = 64
# (a multiple of every BLOCK_N, 2..64) rather than 96 (which left BLOCK_N 64 a tail), and shape,
# dtype and bias run as a pairwise covering set: every pair of their values meets in one case (6
# cases, not the 12 of the full product: ~2/3 of this check's interpreter time), and every case
# runs every batch size and config.
_GEMV_CHECK = textwrap.dedent(
    """
    torch.manual_seed(0)
    for i, (n, k) in enumerate(((64, 256), (37, 200), (5, 1999))):
        w32 = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]
        for j, dtype in enumerate((torch.bfloat16, torch.float16)):
            w = w32.to(dtype)
            # shape i meets both bias states (j = 0, 1), dtype j too (i = 0, 1)
            for bias in ((torch.randn(n).to(dtype),) if (i + j) % 2 else (None,)):
                for m in (1, 3, 16):
                    x = torch.randn(m, k).to(dtype)
                    ref = x.float() @ w.float().t() + (0 if bias is None else bias.float())
                    for cfg in configs_for(m, dtype):
                        y = gemv(x, w, None, bias, config=cfg)
                        assert y.shape == (m, n) and y.dtype == dtype
                        err = max_rel(y, ref)
                        what = (n, k, dtype, bias is not None, m, str(cfg), err)
                        assert err <= BOUND[dtype], what
    # Whole tiles: N and K multiples of every config's BLOCK_N and BLOCK_K (as the Llama-3-8B
    # shapes are), so no tile has a masked tail.
    w32 = torch.randn(32, 2048)
    for dtype in (torch.bfloat16, torch.float16):
        w, x = w32.to(dtype), torch.randn(1, 2048).to(dtype)
        ref = x.float() @ w.float().t()
        for cfg in configs_for(1, dtype):
            err = max_rel(gemv(x, w, config=cfg), ref)
            assert err <= BOUND[dtype], (dtype, str(cfg), err)
    # Strided and misaligned activations are normalized before the launch.
    w = torch.randn(40, 64).to(torch.bfloat16)
    base = torch.randn(4, 192).to(torch.bfloat16)
    for x in (base[:, 5:69], base[:, 8:72], base[:, :64].t().contiguous().t(), base[:1, 3:67]):
        ref = x.float() @ w.float().t()
        for cfg in configs_for(x.shape[0], torch.bfloat16):
            assert max_rel(gemv(x, w, config=cfg), ref) <= 2**-7
    """
)

# Fused SiLU-and-mul vs (a) the unfused Triton path with the same config: each output's gate and
# up sums are the same products and the epilogue rounds at the same points with the same
# expression as elementwise.silu_mul. On CUDA cores (USE_DOT off: tl.sum) the interpreter sums in
# a fixed order, so the two are bit-equal. With USE_DOT the interpreter's tl.dot is numpy's
# matmul, which takes OpenBLAS's sgemm or numpy's own loop depending on the operands' memory
# alignment (it differs between the fused and the unfused launch, and between runs of a busy
# machine): the fp32 sums may then differ in their last bits, the rounding of gate or up to the
# dtype by one ulp, and the output by a few ulps (same_up_to_rounding); a loaded CI run saw
# fp16, inter 48, USE_DOT differ once. The GPU test checks the compiled kernel bit for bit.
# (b) an fp32 reference of gate and up rounded to the dtype, to a tolerance (the sums' order
# differs).
_SILU_CHECK = textwrap.dedent(
    """
    from shard.quantization.fp8 import quantize_fp8_per_channel
    from shard.kernels.elementwise import silu_mul

    torch.manual_seed(1)
    # One shape without a bias, the other (N and K tails) with one: running both shapes both
    # ways doubled the interpreter's time here (~55 s) and reached no other code path. The first
    # has whole tiles: inter = 32 is a multiple of every config's BLOCK_N // 2 outputs (1..32;
    # 48 left BLOCK_N 64 a tail, which the second shape has anyway) with a third fewer programs.
    for inter, k, with_bias in ((32, 256, False), (19, 200, True)):
        w32 = torch.randn(2 * inter, k) * 0.1
        for dtype in (torch.bfloat16, torch.float16):
            w = w32.to(dtype)
            for bias in ((torch.randn(2 * inter).to(dtype),) if with_bias else (None,)):
                bg, bu = (None, None) if bias is None else bias.chunk(2)
                for m in (1, 3, 16):
                    x = torch.randn(m, k).to(dtype)
                    g = (x.float() @ w[:inter].float().t() + (0 if bg is None else bg.float()))
                    u = (x.float() @ w[inter:].float().t() + (0 if bu is None else bu.float()))
                    ref = torch.nn.functional.silu(g.to(dtype).float()) * u.to(dtype).float()
                    for cfg in configs_for(m, dtype):
                        y = gemv(x, w, None, bias, silu_mul=True, config=cfg)
                        assert y.shape == (m, inter) and y.dtype == dtype
                        unfused = silu_mul(
                            gemv(x, w[:inter], None, bg, config=cfg),
                            gemv(x, w[inter:], None, bu, config=cfg),
                        )
                        assert same_up_to_rounding(y, unfused, cfg), (inter, k, dtype, m, str(cfg))
                        err = max_rel(y, ref)
                        assert err <= 4 * BOUND[dtype], (inter, k, dtype, m, str(cfg), err)
    # fp8 weights take the same epilogue after their per-channel scale.
    q, s = quantize_fp8_per_channel(torch.randn(2 * 24, 128))
    for m in (1, 5):
        x = torch.randn(m, 128).half()
        for cfg in configs_for(m, q.dtype):
            y = gemv(x, q, s, silu_mul=True, config=cfg)
            unfused = silu_mul(gemv(x, q[:24], s[:24], config=cfg),
                               gemv(x, q[24:], s[24:], config=cfg))
            assert same_up_to_rounding(y, unfused, cfg), (m, str(cfg))
    """
)

# Programmatic dependent launch (shard/kernels/pdl.py), batch 1 only: the kernel loads its first weight
# tile before the wait (CUDA cores) or waits first (tensor cores). The interpreter has no grid dependencies, so
# the two PTX instructions become counted no-ops; what is checked is that the peeled first
# iteration computes exactly what the plain loop does (same products, same order: bit-equal),
# for K below, at and above BLOCK_K, and that the PDL path really ran. N: whole tiles for every
# CUDA-core BLOCK_N (16) and tails (12, 17); the peel is along K, so more programs along N (the
# interpreter's cost) would only repeat it.
_PDL_CHECK = textwrap.dedent(
    """
    import triton.language.extra.cuda as cuda_extra

    calls = {"wait": 0, "launch": 0}

    def _count(name):
        def no_op(*args, **kwargs):
            calls[name] += 1
        return no_op

    cuda_extra.gdc_wait = _count("wait")
    cuda_extra.gdc_launch_dependents = _count("launch")
    from shard.kernels import gemv as gemv_kernel, pdl

    torch.manual_seed(2)
    for n, k in ((12, 100), (16, 1024), (17, 2500)):
        for dtype in (torch.bfloat16,):
            w = (torch.randn(n, k) * 0.1).to(dtype)
            for m in (1, 3):
                x = torch.randn(m, k).to(dtype)
                for cfg in configs_for(m, dtype):
                    plain = gemv(x, w, config=cfg)
                    pdl.launch_options = lambda device: {"PDL": True}
                    try:
                        before = dict(calls)
                        dependent = gemv(x, w, config=cfg)
                    finally:
                        pdl.launch_options = lambda device: {"PDL": False}
                    # PDL serves batch 1 only (its tensor-core config included).
                    assert (calls["wait"] > before["wait"]) == (m == 1), (m, str(cfg))
                    assert (calls["launch"] > before["launch"]) == (m == 1), (m, str(cfg))
                    assert torch.equal(plain, dependent), (n, k, m, str(cfg))
    """
)


def _run_interpreted(check: str) -> None:
    run_interpreted(_PRELUDE + check)


pytestmark = INTERPRETER_MARKS


def test_16bit_gemv_every_config_in_interpreter():
    _run_interpreted(_GEMV_CHECK)


def test_fused_silu_mul_epilogue_in_interpreter():
    _run_interpreted(_SILU_CHECK)


def test_pdl_first_tile_peel_in_interpreter():
    _run_interpreted(_PDL_CHECK)
