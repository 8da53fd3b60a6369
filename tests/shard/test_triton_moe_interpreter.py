"""shard/kernels/fused_moe.py's grouped-GEMM kernel under Triton's interpreter on CPU tensors (no
GPU): both launches (gate/up with the SiLU-and-mul epilogue, down with the routing weight)
against the per-expert loop, for top-k 1, 2 and 8, a batch that leaves experts empty, ids of
experts the rank does not hold, fp8 weights with per-expert, per-channel scales, and each row
block size of the config table. One fresh interpreter process (Triton reads TRITON_INTERPRET
when a kernel is defined); the GPU benchmark (benchmarks/moe_bench.py) runs the compiled kernel.
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import BF16_DOT_PRELUDE, INTERPRETER_MARKS, run_interpreted

_CHECK = BF16_DOT_PRELUDE + textwrap.dedent(
    """
    from shard.kernels.fused_moe import CONFIGS, MoeConfig, fused_moe
    from shard.kernels.moe_align import MoeRouting, per_expert_loop, route
    from shard.quantization.fp8 import dequantize_fp8, quantize_fp8_per_channel

    torch.manual_seed(0)
    E, H, I = 8, 48, 40  # K tails (48 % 32, 40 % 32) and N tails (40 % 16)
    w13 = torch.randn(E, 2 * I, H) * 0.2
    w2 = torch.randn(E, H, I) * 0.2
    small = MoeConfig(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)

    def check(x, ids, weights, cfg, a13=w13, a2=w2, tol=1e-5, **scales):
        got = fused_moe(x, a13, a2, weights, ids, config=cfg, **scales)
        r13 = a13.float() if not scales else torch.stack(
            [dequantize_fp8(q, s, torch.float32) for q, s in zip(a13, scales["scale13"])])
        r2 = a2.float() if not scales else torch.stack(
            [dequantize_fp8(q, s, torch.float32) for q, s in zip(a2, scales["scale2"])])
        keep = ids < E
        want = per_expert_loop(x.float(), r13, r2, weights * keep, torch.where(keep, ids, 0))
        assert got.shape == x.shape and got.dtype == x.dtype
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err <= tol, (tuple(ids.shape), str(cfg), err)

    for n, k in ((1, 1), (5, 2), (3, 8), (20, 2)):
        x = torch.randn(n, H)
        weights, ids = route(torch.randn(n, E), MoeRouting(k, renormalize=True))
        check(x, ids, weights, small)
    # empty experts: everything on experts 1 and 6; and ids of experts another rank holds
    x = torch.randn(6, H)
    check(x, torch.tensor([[1, 6]] * 6), torch.rand(6, 2), small)
    check(x, torch.tensor([[1, E], [E, E], [3, 4], [E + 2, 0], [5, 5], [6, E]]), torch.rand(6, 2),
          small)
    # the table's row blocks (16, 32, 64 rows), smaller column / K tiles to keep this quick
    x = torch.randn(9, H)
    weights, ids = route(torch.randn(9, E), MoeRouting(2, renormalize=False))
    for bm in sorted({cfg.block_m for _, cfg in CONFIGS}):
        check(x, ids, weights, MoeConfig(bm, 16, 32, 1, 1))
    # bf16 activations and weights (fp32 accumulation; the interpreter truncates each of the
    # epilogue's roundings to bf16 instead of rounding to nearest: a looser bound)
    check(x.bfloat16(), ids, weights, small, w13.bfloat16(), w2.bfloat16(), tol=2**-5)
    # fp8 weights: per expert and output channel scales, converted in registers
    q13, s13 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w13)))
    q2, s2 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w2)))
    check(x, ids, weights, small, q13, q2, scale13=s13, scale2=s2)
    check(x.bfloat16(), ids, weights, small, q13, q2, tol=2**-5, scale13=s13, scale2=s2)
    """
)

pytestmark = INTERPRETER_MARKS


def test_fused_moe_kernel_in_interpreter():
    run_interpreted(_CHECK)
