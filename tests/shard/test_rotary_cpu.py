"""shard/layers/rotary.py's portable path: bit-identical to the textbook rotate-half form, and its
once-per-step table lookup never serves stale rows."""

from __future__ import annotations

import pytest
import torch

from shard.layers.rotary import RotaryEmbedding


def textbook(rot: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cos = rot.cos[positions].unsqueeze(1).to(x.dtype)
    sin = rot.sin[positions].unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_textbook_form_bitwise(dtype: torch.dtype) -> None:
    rot = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"},
                          torch.device("cpu"))
    positions = torch.randint(0, 512, (13,))
    q = torch.randn(13, 9, 64).to(dtype)
    k = torch.randn(13, 3, 64).to(dtype)
    got_q, got_k = rot(positions, q, k)
    assert torch.equal(got_q, textbook(rot, positions, q))
    assert torch.equal(got_k, textbook(rot, positions, k))


def test_cached_lookup_follows_new_and_rewritten_positions() -> None:
    rot = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"},
                          torch.device("cpu"))
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    positions = torch.tensor([0, 1, 2, 3])
    rot(positions, q, k)
    positions.add_(100)  # rewritten in place (a reused buffer): the cached rows are stale
    got_q, _ = rot(positions, q, k)
    assert torch.equal(got_q, textbook(rot, positions, q))
    other = torch.tensor([7, 8, 9, 10])  # a new step's tensor
    got_q, _ = rot(other, q, k)
    assert torch.equal(got_q, textbook(rot, other, q))
    got_q, _ = rot(other, q.to(torch.bfloat16), k.to(torch.bfloat16))  # another dtype
    assert torch.equal(got_q, textbook(rot, other, q.to(torch.bfloat16)))
