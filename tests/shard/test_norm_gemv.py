"""shard/kernels/norm_gemv.py: the residual add + RMSNorm in the prologue of the GEMV that reads
the normalized row (the opt-in shard.layers.linear.norm_prologue).

Under Triton's interpreter on CPU tensors: the launch equals elementwise.add_rms_norm followed by
the matmul (the residual bit for bit in fp32 and bf16, the outputs to fp32 rounding) for several
tilings, token counts and sizes that are not powers of two, and for e4m3 weights with per-row
scales against their dequantized matmul; MergedColumnParallelLinear's fused
path splits it into its parts like its forward; the opt-in declines when off and on CPU. Compiled
for sm_90 on the CPU (no GPU), 16-bit and e4m3 weights: the weight slice is loaded before the
PDL wait, the activations after it.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.helpers.sm90 import compile_sm90, cuda_backend_available
from tests.helpers.tools import needs
from tests.helpers.triton_interpreter import INTERPRETER_MARKS, run_interpreted

_CHECK = textwrap.dedent(
    """
    import torch
    from shard.distributed.groups import Dist
    from shard.kernels import elementwise, norm_gemv
    from shard.layers.linear import MergedColumnParallelLinear, norm_prologue

    torch.manual_seed(0)
    for n, H, N in ((1, 48, 40), (3, 64, 24), (2, 40, 7)):
        d, x = torch.randn(n, H), torch.randn(n, H)
        nw, w = torch.rand(H) + 0.5, torch.randn(N, H) * 0.2
        h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
        for cfg in (None, norm_gemv.NormGemvConfig(1, 1), norm_gemv.NormGemvConfig(8, 2)):
            y, res = norm_gemv.add_rms_norm_linear(d, x, nw, 1e-6, w, cfg)
            assert torch.equal(res, s), (n, H, N)
            torch.testing.assert_close(y, h @ w.T, rtol=1e-5, atol=1e-5)
    # bf16: the sum rounded to bf16 first, as the add_rms_norm kernel rounds it
    d, x = torch.randn(2, 40).bfloat16(), torch.randn(2, 40).bfloat16()
    nw, w = (torch.rand(40) + 0.5).bfloat16(), (torch.randn(24, 40) * 0.2).bfloat16()
    y, res = norm_gemv.add_rms_norm_linear(d, x, nw, 1e-6, w)
    h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
    assert torch.equal(res, s)
    torch.testing.assert_close(y.float(), h.float() @ w.float().T, rtol=2**-6, atol=2**-6)

    # e4m3 weights with per-row scales (--quantize fp8's merged q/k/v): the dequantized matmul
    from shard.quantization.fp8 import dequantize_fp8, quantize_fp8_per_channel
    d, x, nw = torch.randn(2, 40), torch.randn(2, 40), torch.rand(40) + 0.5
    q8, s8 = quantize_fp8_per_channel(torch.randn(24, 40) * 0.2)
    assert norm_gemv.applies(x, q8, s8) and not norm_gemv.applies(x, q8)
    y, res = norm_gemv.add_rms_norm_linear(d, x, nw, 1e-6, q8, scale=s8)
    h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
    assert torch.equal(res, s)
    torch.testing.assert_close(y, h @ dequantize_fp8(q8, s8, torch.float32).T, rtol=1e-5,
                               atol=1e-5)

    # the merged q/k/v linear: the fused path's parts equal forward's of the normed row
    qkv = MergedColumnParallelLinear(40, {"q_proj": 32, "k_proj": 8, "v_proj": 8}, False, Dist(),
                                     merge=True)
    for part in qkv.parts.values():
        part.weight.data = torch.randn(part.weight.shape) * 0.2
    from shard.layers.linear import _merge_rows
    qkv.merged = _merge_rows(list(qkv.parts.values()))
    d, x, nw = torch.randn(2, 40), torch.randn(2, 40), torch.rand(40) + 0.5
    assert qkv.norm_prologue_serves(d, x)
    parts, res = qkv.forward_add_rms_norm_fused(d, x, nw, 1e-6)
    h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
    assert torch.equal(res, s) and [p.shape[1] for p in parts] == [32, 8, 8]
    for got, want in zip(parts, qkv(h)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert qkv.forward_add_rms_norm(d, x, nw, 1e-6) is None  # off by default
    with norm_prologue(True):
        assert qkv.forward_add_rms_norm(d, x, nw, 1e-6) is None  # CPU tensors: declined
    assert not qkv.norm_prologue_serves(d, x, weight_offset=1.0)  # Gemma's norm: not served
    """
)


@INTERPRETER_MARKS[0]
@INTERPRETER_MARKS[1]
def test_add_norm_gemv_in_interpreter():
    run_interpreted(_CHECK)


@needs(cuda_backend_available(), "triton without its CUDA backend (ptxas)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fp8", [False, True])
def test_weights_stream_before_the_wait_on_sm90(fp8: bool) -> None:
    pytest.importorskip("triton")
    from shard.kernels import norm_gemv

    hidden, warps = 2048, 4
    cfg = norm_gemv.default_config(hidden)
    types = {"d_ptr": "*bf16", "x_ptr": "*bf16", "nw_ptr": "*bf16",
             "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32", "y_ptr": "*bf16", "res_ptr": "*bf16", "N": "i32", "H": "i32", "stride_d": "i32",
             "stride_x": "i32", "stride_w": "i32", "stride_y": "i32", "eps": "fp32"}
    consts = {"BLOCK_H": hidden, "ROWS": cfg.rows, "HAS_SCALE": fp8, "PDL": True,
              "OFFSET": 0.0}
    kernel = compile_sm90(norm_gemv._add_norm_gemv_kernel, types, consts, warps, 1,
                          divisible=("N", "H"))
    lines = kernel.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    loads = [i for i, line in enumerate(lines) if re.search(r"ld\.global", line)]
    slice_vectors = cfg.rows * hidden * (1 if fp8 else 2) // (32 * warps) // 16
    assert sum(1 for i in loads if i < wait) >= slice_vectors, "weights after the wait"
    # delta, residual, the norm weight (and the scales)
    assert 0 < sum(1 for i in loads if i > wait) <= 8
    assert all(i > wait for i, line in enumerate(lines) if "st.global" in line)
