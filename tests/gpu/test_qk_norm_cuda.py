"""The per-head q/k RMSNorm kernel (shard/kernels/qk_norm.py, Qwen3's q_norm / k_norm) equals
the torch form it replaces (shard/layers/norm.py's RMSNorm over each head), on q and k as the
model passes them (column slices of the merged qkv output), eagerly and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _inputs(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen) * 3
           ).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    wq = (torch.randn(head_dim, device="cuda", generator=gen) + 1).to(dtype)
    wk = (torch.randn(head_dim, device="cuda", generator=gen) + 1).to(dtype)
    return q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), wq, wk


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "head_dim"),
                         [(1, 32, 8, 128), (257, 32, 8, 128), (7, 16, 2, 64), (3, 5, 1, 80)])
def test_kernel_equals_torch(dtype, n, heads, kv_heads, head_dim):
    from shard.kernels.qk_norm import qk_rms_norm

    q, k, wq, wk = _inputs(n, heads, kv_heads, head_dim, dtype)
    qo, ko = qk_rms_norm(q, k, wq, wk, 1e-6)
    torch.testing.assert_close(qo, _reference(q, wq, 1e-6), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ko, _reference(k, wk, 1e-6), rtol=1e-2, atol=1e-2)


def test_layer_dispatch_in_a_cuda_graph():
    """shard.layers.qk_norm.qk_rms_norm takes the kernel on CUDA and replays in a graph."""
    from shard.layers.qk_norm import HeadRMSNorm, qk_rms_norm

    q, k, wq, wk = _inputs(64, 32, 8, 128, torch.bfloat16)
    nq, nk = HeadRMSNorm(128, 1e-6).cuda(), HeadRMSNorm(128, 1e-6).cuda()
    nq.weight.data, nk.weight.data = wq, wk
    qs, ks = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    qk_rms_norm(qs, ks, nq, nk)  # compile outside the capture
    with torch.cuda.graph(graph):
        qo, ko = qk_rms_norm(qs, ks, nq, nk)
    qs.copy_(q * 2)
    ks.copy_(k * 0.5)
    graph.replay()
    torch.testing.assert_close(qo, _reference(q * 2, wq, 1e-6), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ko, _reference(k * 0.5, wk, 1e-6), rtol=1e-2, atol=1e-2)
