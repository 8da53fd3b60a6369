"""compressed-tensors `int-quantized` W8A8-int8 checkpoints on CPU (shard/quantization/w8a8.py):
config parsing with errors naming the field, the int8 matmul against a test-side per-token
reference, and a tiny trained llama written by the test-side writer
(tests/helpers/int_checkpoints.py) served against the same int8 weights dequantized to float32
with float activations (two gloo ranks: test_int_two_ranks.py; a checkpoint written by
llm-compressor itself: test_llmcompressor_fixtures.py).

Tolerance: activations are rounded to int8 per token (a relative step of 1/127 of the row's
largest value): the logits differ from the float-activation reference by under 3 % (relative
Frobenius norm; 1.6 % measured on the tiny llama, hidden size 64, whose per-token ranges are
set by few values). The trained model's greedy choices are confident: tokens match exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from reference import prompts

from shard.distributed.groups import Dist
from shard.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from shard.quantization import IntLayout, checkpoint_quantization, linear_weight_bytes
from shard.quantization.int_weights import tp_slice
from shard.quantization.w8a8 import W8A8Linear, read_w8a8
from shard.server.loader import Shard, ShardConfig
from tests.helpers.int_checkpoints import (
    IntSpec,
    dequantize,
    pack,
    quantization_config,
    quantize,
)
from tests.helpers.numerics import rel_err
from tests.helpers.shards import make_shard
from tests.shard.test_quantization_shard import greedy_outputs, prefill_logits

SPEC = IntSpec("w8a8", 8, -1, sym=True)


def reference_w8a8(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Written from the scheme's description: symmetric int8 per token, int64 sums."""
    a_scale = x.abs().amax(dim=1, keepdim=True) / 127  # [M, 1]
    xq = torch.round(x / a_scale).clamp(-127, 127).long()
    return (xq @ wq.long().t()).double() * a_scale.double() * w_scale.double()[None, :]


def test_config_parsing_and_errors_name_the_field():
    qc = quantization_config(SPEC)
    q = checkpoint_quantization({"quantization_config": qc})
    assert q.packed.layout is IntLayout.INT_QUANTIZED and q.is_ignored("lm_head")
    group = "quantization_config.config_groups.group_0"
    cases = {
        "weights.num_bits": ("weights", "num_bits", 4),
        "weights.strategy": ("weights", "strategy", "group"),
        "weights.symmetric": ("weights", "symmetric", False),
        "input_activations.num_bits": ("input_activations", "num_bits", 4),
        "input_activations.strategy": ("input_activations", "strategy", "tensor"),
        "input_activations.dynamic": ("input_activations", "dynamic", False),
        "input_activations.symmetric": ("input_activations", "symmetric", False),
    }
    for field, (part, key, value) in cases.items():
        bad = json.loads(json.dumps(qc))
        bad["config_groups"]["group_0"][part][key] = value
        with pytest.raises(ValueError, match=f"^{group}.{field}: ") as info:
            checkpoint_quantization({"quantization_config": bad})
        assert "\n" not in str(info.value)
    weight_only = json.loads(json.dumps(qc))
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(ValueError, match=f"^{group}.input_activations: None"):
        checkpoint_quantization({"quantization_config": weight_only})


def test_int8_matmul_equals_the_per_token_reference_whole_and_sliced():
    """W8A8Linear's output is the reference's to float32 rounding, whole, and as the column- and
    row-parallel slices of 2 ranks (row-parallel ranks quantize their own input columns)."""
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    parts = quantize(w, SPEC, seed=0)
    stored = pack(parts, SPEC)
    full = read_w8a8("layer", stored)
    wq, w_scale = stored["weight"], stored["weight_scale"].float().reshape(-1)
    x = torch.randn(5, 96) * torch.linspace(0.1, 10, 5)[:, None]  # rows of different ranges
    linear = W8A8Linear(full)
    torch.testing.assert_close(linear(x).double(), reference_w8a8(x, wq, w_scale),
                               rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(linear.dequantized_weight(torch.float32), dequantize(parts))
    for rank in range(2):
        rows = W8A8Linear(tp_slice(full, 0, rank, 2, "layer"))
        want = reference_w8a8(x, wq[rank * 24:(rank + 1) * 24], w_scale[rank * 24:(rank + 1) * 24])
        torch.testing.assert_close(rows(x).double(), want, rtol=1e-6, atol=1e-5)
        cols = W8A8Linear(tp_slice(full, 1, rank, 2, "layer"))
        xs = x[:, rank * 48:(rank + 1) * 48]
        torch.testing.assert_close(cols(xs).double(),
                                   reference_w8a8(xs, wq[:, rank * 48:(rank + 1) * 48], w_scale),
                                   rtol=1e-6, atol=1e-5)
    # int8 weights: a quarter of fp32, plus one float32 scale per row.
    assert linear.weight_bytes == 48 * 96 + 48 * 4


def test_checkpoint_serves_the_dequantized_models_logits_and_tokens(w8a8_checkpoint):
    packed_dir, ref_dir = w8a8_checkpoint
    shard, ref = make_shard(packed_dir), make_shard(ref_dir)
    layers = [m.quantized for m in shard.runner.model.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert layers and all(isinstance(m, W8A8Linear) for m in layers)
    merged = [m.merged for m in shard.runner.model.modules()
              if isinstance(m, MergedColumnParallelLinear)]
    assert merged and all(w is not None for w in merged)  # q/k/v and gate/up: one GEMM each
    ref_bytes = sum(m.weight.numel() * 2 for m in ref.runner.model.modules()
                    if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))  # as bf16
    assert linear_weight_bytes(shard.runner.model) < ref_bytes * 0.6
    prompt = prompts(packed_dir, [30])[0]
    got, want = prefill_logits(shard, prompt), prefill_logits(ref, prompt)
    err = rel_err(got, want)  # measured 1.6 %
    assert 0 < err < 0.03, err  # > 0: the activations really are quantized
    p = prompts(packed_dir, [17, 5, 45])
    assert greedy_outputs(shard, p) == greedy_outputs(ref, p)


def test_corrupt_config_fails_at_start_up(w8a8_checkpoint, tmp_path):
    packed_dir, _ = w8a8_checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(packed_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^quantization_config\.config_groups\.group_0\."
                                         r"input_activations\.dynamic: False is not supported"):
        Shard(ShardConfig(model_id=str(bad), device="cpu"), Dist())
