"""The Triton kernels' Gemma options under Triton's interpreter on CPU tensors (no GPU), float32
against the portable torch forms:
- attention-logit soft-capping and per-layer sliding windows in paged decode (one split and
  several; the fused rotary mode too) and paged prefill (a chunk over a cached prefix);
- RMSNorm's (1 + w) weight offset (rms_norm, add_rms_norm with and without the sandwich's
  normalized delta, the q/k head norm);
- GELU(tanh)-and-mul.
One interpreted process for all of them (each costs its imports); shapes kept small.
tests/gpu/test_gemma_kernels_cuda.py checks the compiled kernels in bf16.
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import INTERPRETER_MARKS, run_interpreted

pytestmark = INTERPRETER_MARKS

_CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F

    from shard.attention.base import AttentionMetadata
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.kernels.attention_decode import (
        paged_decode_attention, rotary_store_decode_attention)
    from shard.kernels.attention_prefill import paged_prefill_attention
    from shard.kernels.elementwise import add_rms_norm, gelu_tanh_mul, rms_norm, rotary_store_kv
    from shard.kernels.qk_norm import qk_rms_norm
    from shard.layers.norm import RMSNorm
    from shard.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    HEADS, KV_HEADS, D, PAGE, BLOCKS = 4, 2, 32, 16, 24
    backend = TorchAttentionBackend()
    cache = torch.randn(2, BLOCKS, PAGE, KV_HEADS, D)
    tables = torch.randperm(BLOCKS)[:12].view(2, 6).to(torch.int32)
    scale = 0.2  # with randn q/k: scores of several units, which a cap of 2 bends hard

    def meta(q_lens, seq_lens):
        q_start = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
        return AttentionMetadata(q_start, torch.tensor(seq_lens, dtype=torch.int32), tables,
                                 torch.zeros(sum(q_lens), dtype=torch.int64), max(q_lens),
                                 max(seq_lens), list(q_lens), list(seq_lens))

    def close(got, want, what):
        err = float((got - want).abs().max())
        assert err < 2e-5, (what, err)

    seq_lens = [70, 45]
    m = meta([1, 1], seq_lens)
    q = torch.randn(2, HEADS, D)
    for softcap in (None, 2.0):
        for window in (None, 20):
            want = backend.attend(q, *cache, m, scale, window, softcap=softcap)
            for splits in (1, 3):
                got = paged_decode_attention(q, *cache, tables, m.seq_lens, scale, window,
                                             splits, softcap=softcap)
                close(got, want, ("decode", softcap, window, splits))
            if softcap is not None:  # the cap changes the output: the check can fail
                plain = backend.attend(q, *cache, m, scale, window)
                assert float((plain - want).abs().max()) > 1e-2

    # Fused rotary decode with the cap: equal to rotary_store_kv + capped decode attention.
    rope = RotaryEmbedding(D, 256, {"rope_type": "default", "rope_theta": 100.0},
                           torch.device("cpu"))
    k_new, v_new = torch.randn(2, KV_HEADS, D), torch.randn(2, KV_HEADS, D)
    pos = torch.tensor([s - 1 for s in seq_lens])
    slots = torch.stack([tables[i, (s - 1) // PAGE].long() * PAGE + (s - 1) % PAGE
                         for i, s in enumerate(seq_lens)])
    fused_cache, pair_cache = cache.clone(), cache.clone()
    got = rotary_store_decode_attention(q, k_new, v_new, pos, rope.cos, rope.sin, *fused_cache,
                                        slots, tables, m.seq_lens, scale, 20, 3, softcap=2.0)
    q_rot = rotary_store_kv(pos, q, k_new, v_new, rope.cos, rope.sin, *pair_cache, slots,
                            None, None, 0.0)
    want = paged_decode_attention(q_rot, *pair_cache, tables, m.seq_lens, scale, 20, 3,
                                  softcap=2.0)
    assert torch.equal(got, want) and torch.equal(fused_cache, pair_cache)

    # Prefill: sequence 0 a 20-token chunk over 50 cached tokens, sequence 1 a whole 30-token
    # prompt.
    m = meta([20, 30], [70, 30])
    q = torch.randn(50, HEADS, D)
    for softcap in (None, 2.0):
        for window in (None, 9):
            want = backend.attend(q, *cache, m, scale, window, softcap=softcap)
            got = paged_prefill_attention(q, *cache, tables, m.query_start_loc, m.seq_lens,
                                          m.max_query_len, scale, window, block_m=16,
                                          block_n=16, softcap=softcap)
            close(got, want, ("prefill", softcap, window))

    # RMSNorm with Gemma's (1 + w), and its residual-add form.
    x, d = torch.randn(3, 48), torch.randn(3, 48)
    norm = RMSNorm(48, 1e-6, weight_offset=1.0)
    norm.weight.data = torch.randn(48)
    close(rms_norm(x, norm.weight, 1e-6, 1.0), norm(x), "rms_norm offset")
    y, s = add_rms_norm(d, x, norm.weight, 1e-6, 1.0)
    close(s, x + d, "add")
    close(y, norm(x + d), "add_rms_norm offset")
    post = RMSNorm(48, 1e-5, weight_offset=1.0)  # sandwich: delta normalized before the add
    post.weight.data = torch.randn(48)
    y, s = add_rms_norm(d, x, norm.weight, 1e-6, 1.0, post.weight, 1e-5)
    close(s, x + post(d), "add of the normalized delta")
    close(y, norm(x + post(d)), "add_rms_norm with delta norm")
    qh, kh = torch.randn(3, HEADS, D), torch.randn(3, KV_HEADS, D)
    head = RMSNorm(D, 1e-6, weight_offset=1.0)
    head.weight.data = torch.randn(D)
    gq, gk = qk_rms_norm(qh, kh, head.weight, head.weight, 1e-6, 1.0)
    close(gq, head(qh), "q norm offset")
    close(gk, head(kh), "k norm offset")

    g, u = torch.randn(3, 40) * 3, torch.randn(3, 40)
    close(gelu_tanh_mul(g, u), F.gelu(g, approximate="tanh") * u, "gelu_tanh_mul")
    """
)


def test_gemma_kernel_options_in_interpreter():
    run_interpreted(_CHECK)
