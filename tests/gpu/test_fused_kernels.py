"""Fused CUDA kernels equal their unfused forms (`pytest -m gpu tests/gpu`): the rotary
embedding with the KV-cache store (shard.triton_ops.rotary_store_kv), and fp8 gate/up with
SiLU-and-mul (Fp8Linear.forward_silu_mul)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotary_store_kv_equals_rotary_then_store(cache_dtype):
    from shard.attention.triton_decode import store_kv
    from shard.rotary import RotaryEmbedding
    from shard.triton_ops import rotary, rotary_store_kv

    heads, kv_heads, head_dim, n = 16, 4, 128, 5
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 500000.0},
                           torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # q/k/v as column slices of one merged projection output, as the model passes them.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(n, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 7, 300, 1023, 4095], device="cuda")
    slots = torch.tensor([3, -1, 40, 17, 63], device="cuda")  # -1: a graph padding row
    scales = None
    if cache_dtype != torch.bfloat16:
        scales = (torch.rand(kv_heads, device="cuda", generator=gen) + 0.01,
                  torch.rand(kv_heads, device="cuda", generator=gen) + 0.01)
    caches = [tuple(torch.zeros(4, 16, kv_heads, head_dim, device="cuda").to(cache_dtype)
                    for _ in range(2)) for _ in range(2)]
    q_ref, k_ref = rotary(positions, q, k, rope.cos, rope.sin)
    store_kv(k_ref, v, *caches[0], slots, *(scales or (None, None)))
    fp8_max = float(torch.finfo(cache_dtype).max) if scales else 0.0
    q_got = rotary_store_kv(positions, q, k, v, rope.cos, rope.sin, *caches[1], slots,
                            *(scales or (None, None)), fp8_max)
    assert torch.equal(q_got, q_ref)
    for want, got in zip(caches[0], caches[1]):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    assert caches[1][0].float().abs().sum() > 0  # something was stored


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_fp8_gate_up_silu_equals_linear_then_silu_mul(rows):
    """Batches on the GEMV path (1, 8) take the SiLU epilogue: equal to forward() then silu_mul
    up to bf16 rounding (the two may be tuned to different tiles, i.e. summation orders); 32
    takes the W8A8 path + silu_mul, exactly the two-step form."""
    from shard.quantization.fp8 import Fp8Linear
    from shard.triton_ops import silu_mul

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate = Fp8Linear.from_float(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02)
    up = Fp8Linear.from_float(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02)
    merged = Fp8Linear.merge_rows(gate, up)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    g, u = merged(x).chunk(2, dim=-1)
    want, got = silu_mul(g, u), merged.forward_silu_mul(x)
    if rows > 16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
