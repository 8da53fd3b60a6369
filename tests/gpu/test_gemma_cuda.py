"""Gemma's kernel options on the GPU against torch references, and the tiny Gemma models on the
CUDA path (Triton attention, fused norms, CUDA-graph decode) against the CPU path.

- paged decode (one split and several, the fused rotary mode) and paged prefill with
  attention-logit soft-capping and per-layer sliding windows, bf16, Gemma-2-9B's head shape
  (head_dim 256, 2 query heads per KV head) and head_dim 128, against the torch backend in
  fp32;
- the (1 + w) RMSNorm kernels (alone, with the residual add, per q/k head) and GELU(tanh)-mul
  against their torch forms in bf16;
- tiny Gemma 2 / Gemma 3 (tests/helpers/gemma.py) in float32: prefill logits within TF32 noise
  of the CPU torch path's; greedy tokens of CUDA-graph decode equal eager CUDA decode's and the
  CPU path's up to the first near-tie.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gemma import gemma_model
from tests.helpers.numerics import agree_until_near_tie

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _meta(q_lens: list[int], seq_lens: list[int], tables: torch.Tensor):
    from shard.attention.base import AttentionMetadata

    dev = tables.device
    start = torch.tensor([0, *q_lens], device=dev).cumsum(0).to(torch.int32)
    return AttentionMetadata(start, torch.tensor(seq_lens, dtype=torch.int32, device=dev), tables,
                             torch.zeros(sum(q_lens), dtype=torch.int64, device=dev),
                             max(q_lens), max(seq_lens), q_lens, seq_lens)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 256), (8, 2, 128)])
def test_softcap_and_windows_match_torch(heads, kv_heads, head_dim):
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.kernels.attention_decode import (
        paged_decode_attention,
        rotary_store_decode_attention,
    )
    from shard.kernels.attention_prefill import paged_prefill_attention
    from shard.kernels.elementwise import rotary_store_kv
    from shard.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    dev, dt, page, blocks = torch.device("cuda"), torch.bfloat16, 16, 160
    torch_backend = TorchAttentionBackend()
    cache = torch.randn(2, blocks, page, kv_heads, head_dim, device=dev, dtype=dt)
    tables = torch.randperm(blocks, device=dev)[:150].view(3, 50).to(torch.int32)
    scale, cap = 256**-0.5, 50.0 / 8  # Gemma 2's 50 scaled down so that it binds on randn
    seq_lens = [700, 37, 129]
    m = _meta([1, 1, 1], seq_lens, tables)
    q = torch.randn(3, heads, head_dim, device=dev, dtype=dt) * 4
    # The reference in fp32 from the same bf16 values (the torch path in bf16 rounds its scores:
    # itself 1e-2 off).
    ref_cache = cache.float()
    for window in (None, 64):
        want = torch_backend.attend(q.float(), *ref_cache, m, scale, window, softcap=cap)
        plain = torch_backend.attend(q.float(), *ref_cache, m, scale, window)
        assert _rel(plain, want) > 0.5  # the cap binds: the check below can fail
        for splits in (1, 4):
            got = paged_decode_attention(q, *cache, tables, m.seq_lens, scale, window, splits,
                                         softcap=cap)
            assert _rel(got, want) < 1e-2, (window, splits)
    # Fused rotary decode: the same as rotary_store_kv + capped decode.
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0}, dev)
    k, v = (torch.randn(3, kv_heads, head_dim, device=dev, dtype=dt) for _ in range(2))
    pos = torch.tensor([s - 1 for s in seq_lens], device=dev)
    slots = torch.stack([tables[i, (s - 1) // page].long() * page + (s - 1) % page
                         for i, s in enumerate(seq_lens)])
    fused, pair = cache.clone(), cache.clone()
    got = rotary_store_decode_attention(q, k, v, pos, rope.cos, rope.sin, *fused, slots, tables,
                                        m.seq_lens, scale, 64, 4, softcap=cap)
    q_rot = rotary_store_kv(pos, q, k, v, rope.cos, rope.sin, *pair, slots, None, None, 0.0)
    want = paged_decode_attention(q_rot, *pair, tables, m.seq_lens, scale, 64, 4, softcap=cap)
    assert torch.equal(fused, pair) and _rel(got, want) < 1e-2
    # Prefill: a 300-token chunk over 400 cached tokens, a whole 37-token prompt, a 129 one.
    m = _meta([300, 37, 129], seq_lens, tables)
    q = torch.randn(466, heads, head_dim, device=dev, dtype=dt) * 4
    for window in (None, 64):
        want = torch_backend.attend(q.float(), *ref_cache, m, scale, window, softcap=cap)
        got = paged_prefill_attention(q, *cache, tables, m.query_start_loc, m.seq_lens,
                                      m.max_query_len, scale, window, softcap=cap)
        assert _rel(got, want) < 1e-2, window


def test_gemma_norms_and_gelu_match_torch():
    import torch.nn.functional as F

    from shard.kernels import elementwise
    from shard.layers.norm import RMSNorm
    from shard.layers.qk_norm import HeadRMSNorm, qk_rms_norm

    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(37, 3584, device=dev, dtype=dt) * 3
    d = torch.randn_like(x)
    norm = RMSNorm(3584, 1e-6, weight_offset=1.0).to(dev)
    norm.weight.data = torch.randn(3584, device=dev, dtype=dt)

    def ref(t: torch.Tensor) -> torch.Tensor:  # transformers' Gemma2RMSNorm
        tf = t.float()
        tf = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (tf * (1.0 + norm.weight.float())).to(t.dtype)

    assert _rel(norm(x), ref(x)) < 1e-2
    h, s = elementwise.add_rms_norm(d, x, norm.weight, 1e-6, 1.0)
    assert torch.equal(s, x + d) and _rel(h, ref(x + d)) < 1e-2
    # Sandwich: the delta normalized (same weights here) before the add, in the same kernel.
    h, s = elementwise.add_rms_norm(d, x, norm.weight, 1e-6, 1.0, norm.weight, 1e-6)
    assert _rel(s, x + ref(d)) < 1e-2 and _rel(h, ref(x + ref(d))) < 1e-2
    qkv = torch.randn(5, (16 + 2 * 8) * 256, device=dev, dtype=dt)
    q = qkv[:, : 16 * 256].view(5, 16, 256)
    k = qkv[:, 16 * 256 : 24 * 256].view(5, 8, 256)
    head = HeadRMSNorm(256, 1e-6, 1.0).to(dev)
    head.weight.data = torch.randn(256, device=dev, dtype=dt)
    gq, gk = qk_rms_norm(q, k, head, head)
    for got, t in ((gq, q), (gk, k)):
        tf = t.float()
        want = (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)
                * (1.0 + head.weight.float())).to(dt)
        assert _rel(got, want) < 1e-2
    g, u = (torch.randn(33, 14336, device=dev, dtype=dt) * 2 for _ in range(2))
    assert _rel(elementwise.gelu_tanh_mul(g, u), F.gelu(g, approximate="tanh") * u) < 1e-2


def _prefill_logits(shard, prompt: list[int]) -> torch.Tensor:  # [len(prompt), vocab] on CPU
    from shard.runner.model_runner import StepInputs

    n = len(prompt)
    step = StepInputs(prompt, list(range(n)), [n], [n], [list(range(-(-n // 16)))],
                      list(range(n)))
    return shard.runner.execute(step).float().cpu()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_tiny_gemma_cuda_graph_decode_matches_cpu(tmp_path_factory, arch):
    """The tiny model on CUDA (Triton attention with soft-capping and windows, fused norms),
    float32: every prompt position's logits within TF32 noise of the CPU torch path's; greedy
    tokens of CUDA-graph decode equal eager CUDA decode's and the CPU path's, each up to the
    first near-tie."""
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig
    from shard.testing.tiny import greedy_tokens

    model_dir = gemma_model(tmp_path_factory, arch)

    def shard(device: str) -> Shard:
        s = Shard(ShardConfig(model_id=str(model_dir), dtype="float32", device=device,
                              kv_cache_memory_mb=4), Dist())
        s.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
        return s

    cpu, gpu = shard("cpu"), shard("cuda")
    assert "triton" in gpu.info.attention_backend
    assert gpu.runner.graphs is not None  # soft-capped, windowed decode is captured
    prompt = [(7 * i + 3) % 500 for i in range(40)]  # crosses the window of 6
    want_logits = _prefill_logits(cpu, prompt)
    assert (_prefill_logits(gpu, prompt) - want_logits).abs().max() < 2e-2
    margins: list[list[float]] = []
    want = greedy_tokens(cpu, 20, margins)
    graph_margins: list[list[float]] = []
    from_graphs = greedy_tokens(gpu, 20, graph_margins)
    graphs, gpu.runner.graphs = gpu.runner.graphs, None
    # Eager decode: the same kernels, though the graph's padded batch may pick other GEMV
    # configs (another fp32 summation order), hence the near-tie rule here too.
    agree_until_near_tie(greedy_tokens(gpu, 20), from_graphs, graph_margins, tie=1e-4)
    gpu.runner.graphs = graphs
    agree_until_near_tie(from_graphs, want, margins)
