"""Checkpoints written by the real tool, llm-compressor 0.14 (compressed-tensors 0.19), for a
tiny trained llama (tests/fixtures/llmcompressor/make_fixtures.py says how: its own venv, wheels
only): served by tokenwire, their logits equal what the tool's own loader (transformers 5.17 +
compressed-tensors, float32) computed from the same files for the same prompt
(reference.safetensors beside each checkpoint).

- W4A16 by GPTQ (`pack-quantized`, int4 symmetric, group 128): to 1e-5; the loader decompresses to
  float32 weights, tokenwire multiplies by exactly those values.
- W8A8 (`int-quantized`, int8 per channel, dynamic per-token int8 activations): to 3 % (relative
  Frobenius norm; 1.1 % measured), greedy choices equal where not near-tied: tokenwire scales
  activations by absmax / 127 (vLLM's kernels' convention), the tool's loader by absmax / 127.5;
  with the tool's rounding substituted the logits agree to 1e-3 (1.8e-4 measured).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.quantization import w8a8
from shard.quantization.int_weights import IntLinear
from shard.quantization.w8a8 import W8A8Linear
from tests.helpers.numerics import rel_err
from tests.helpers.shards import make_shard
from tests.shard.test_quantization_shard import prefill_logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmcompressor"


def served(name: str, layer: type) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokenwire's prefill logits of the fixture's prompt, the tool loader's)."""
    model_dir = FIXTURES / name
    shard = make_shard(model_dir)
    linears = [m.quantized for m in shard.runner.model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(isinstance(m, layer) for m in linears)
    ref = load_file(str(model_dir / "reference.safetensors"))
    return prefill_logits(shard, ref["input_ids"].tolist()), ref["logits"]


def clear_argmax_agrees(got: torch.Tensor, want: torch.Tensor, margin: float = 0.05) -> None:
    """Greedy choices equal wherever the reference's top two are at least `margin` apart."""
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= margin
    assert clear.sum() > len(clear) // 2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_w4a16_checkpoint_serves_the_tools_logits():
    got, want = served("w4a16-gptq-actorder", IntLinear)
    assert rel_err(got, want) < 1e-5  # measured 0
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_w8a8_checkpoint_serves_the_tools_logits(monkeypatch):
    got, want = served("w8a8-int8", W8A8Linear)
    assert 0 < rel_err(got, want) < 0.03  # measured 1.1 %
    clear_argmax_agrees(got, want)
    # With the tool's activation rounding (scale absmax / 127.5, values clamped to [-128, 127])
    # the rest of the path (int8 weights, per-channel scales, per-token structure) is exact.

    def tool_rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / 127.5
        return torch.round(x.float() / scale[:, None]).clamp(-128, 127).to(torch.int8), scale

    monkeypatch.setattr(w8a8, "quantize_per_token", tool_rounding)
    got, _ = served("w8a8-int8", W8A8Linear)
    assert rel_err(got, want) < 1e-3  # measured 1.8e-4
