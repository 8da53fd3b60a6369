"""Key rotation for fp8 KV caches (shard/quantization/kv_rotation.py): the rotation is orthogonal
and fixed, PagedAttention with it computes the same attention in exact arithmetic, and on keys
and queries that share an outlier channel (as trained models' do) it lowers the fp8 cache's
error against an unquantized reference. Checkpoint scales turn it off."""

from __future__ import annotations

import pytest
import torch

from shard.attention.base import AttentionMetadata
from shard.attention.torch_backend import TorchAttentionBackend
from shard.layers.attention import PagedAttention
from shard.layers.rotary import RotaryEmbedding
from shard.quantization.kv_cache import scales_from_amax
from shard.quantization.kv_rotation import orthogonal_rotation
from shard.quantization.methods import parse_kv_cache_rotation

HEADS, KV_HEADS, HEAD_DIM, BLOCK, TOKENS = 4, 2, 64, 16, 96


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_rotation_is_orthogonal_and_fixed(head_dim):
    r = orthogonal_rotation(head_dim)
    assert r.shape == (head_dim, head_dim)
    torch.testing.assert_close(r.T @ r, torch.eye(head_dim), atol=1e-5, rtol=0)
    assert torch.equal(r, orthogonal_rotation(head_dim))  # same on every rank and launch
    if head_dim in (64, 128):  # Hadamard: +-1/sqrt(d), symmetric
        assert torch.equal(r.abs(), torch.full_like(r, head_dim**-0.5))
        assert torch.equal(r, r.T)


def test_flag_values():
    assert parse_kv_cache_rotation("Hadamard").value == "hadamard"
    with pytest.raises(ValueError, match="--kv-cache-rotation.*hadamard, none"):
        parse_kv_cache_rotation("random")


def _attention(rotate: bool, kv_dtype: torch.dtype) -> PagedAttention:
    rotary = RotaryEmbedding(HEAD_DIM, 512, {"rope_type": "default", "rope_theta": 10000.0},
                             torch.device("cpu"))
    return PagedAttention(TorchAttentionBackend(), rotary, HEADS, KV_HEADS, HEAD_DIM, None,
                          kv_dtype, torch.device("cpu"), rotate_keys=rotate)


def _prefill(attn: PagedAttention, q, k, v) -> torch.Tensor:
    """One sequence of TOKENS new tokens -> [TOKENS, HEADS * HEAD_DIM] float32."""
    blocks = -(-TOKENS // BLOCK)
    cache = tuple(torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=attn.kv_dtype)
                  for _ in range(2))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, TOKENS], dtype=torch.int32),
        seq_lens=torch.tensor([TOKENS], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(TOKENS, dtype=torch.int64), max_query_len=TOKENS,
        max_seq_len=TOKENS, query_lens_host=[TOKENS], seq_lens_host=[TOKENS])
    with torch.no_grad():
        return attn(q, k, v, torch.arange(TOKENS), cache, meta).float()


def _outlier_qkv(seed: int):
    """q, k, v [TOKENS, heads, HEAD_DIM] float32, q and k sharing a large channel pair (the
    low-frequency rotary pair where trained models' queries and keys concentrate)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=g)
    for x in (q, k):
        x[..., HEAD_DIM // 2 - 1] *= 12.0
        x[..., HEAD_DIM - 1] *= 12.0
    return q, k, v


def _calibrated(attn: PagedAttention, k: torch.Tensor, v: torch.Tensor) -> PagedAttention:
    """Per-KV-head scales from the keys as this layer stores them (warmup's calibration)."""
    stored_k = k if attn.key_rotation is None else k @ attn.key_rotation
    attn.kv_scales.k_scale.copy_(scales_from_amax(stored_k.abs().amax(dim=(0, 2)), attn.kv_dtype))
    attn.kv_scales.v_scale.copy_(scales_from_amax(v.abs().amax(dim=(0, 2)), attn.kv_dtype))
    return attn


def test_rotated_fp8_cache_is_closer_to_the_unquantized_attention():
    """Rotary keeps the outlier pair's energy in that pair, so q.k's fp8 error concentrates there
    without rotation; with it, the error per score drops (here by well over 2x)."""
    errs = {True: [], False: []}
    for seed in range(3):
        q, k, v = _outlier_qkv(seed)
        want = _prefill(_attention(False, torch.float32), q, k, v)  # unquantized cache
        for rotate in (True, False):
            attn = _calibrated(_attention(rotate, torch.float8_e4m3fn), k, v)
            got = _prefill(attn, q, k, v)
            errs[rotate].append(float((got - want).norm() / want.norm()))
    rotated, plain = sum(errs[True]), sum(errs[False])
    assert rotated < plain / 2, errs


def test_rotation_only_with_an_fp8_cache_and_not_with_checkpoint_scales():
    assert _attention(True, torch.float32).key_rotation is None  # model-dtype cache: nothing
    attn = _attention(True, torch.float8_e4m3fn)
    assert attn.key_rotation is not None

    class CheckpointScales:  # the Weights surface PagedAttention.load reads
        class dist:
            rank, world_size = 0, 1

        def has(self, name: str) -> bool:
            return True

        def get(self, name: str, raw: bool = False) -> torch.Tensor:
            return torch.full((KV_HEADS,), 0.05)

    attn.load(CheckpointScales(), "model.layers.0.self_attn.attn")
    assert attn.key_rotation is None  # the checkpoint's scales describe unrotated keys
    assert torch.equal(attn.kv_scales.k_scale, torch.full((KV_HEADS,), 0.05))
