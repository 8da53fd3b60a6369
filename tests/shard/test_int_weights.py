"""Pre-quantized integer checkpoints (GPTQ v1, AWQ GEMM, compressed-tensors pack-quantized) on CPU: config parsing, unpacking and
tensor-parallel slicing of the internal packed layout, and tiny llamas served from checkpoints
written by the test-side packer (tests/helpers/int_checkpoints.py) against the same integers
dequantized independently, at 1 and 2 (gloo) ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
from shard.quantization.int_weights import IntLinear, PackedInt, read_unpacked, tp_slice
from shard.quantization.methods import with_quantize_config
from shard.server.loader import Shard, ShardConfig
from shard.testing.ranks import run_ranks
from shard.testing.tiny import greedy_tokens, load_tiny
from tests.helpers.int_checkpoints import (
    GREEDY_STEPS,
    IntSpec,
    dequantize,
    pack,
    quantization_config,
    quantize,
    short_greedy_rank,
    write_int_checkpoint,
)
from tests.helpers.shards import make_shard
from tests.shard.test_quantization_shard import greedy_outputs, prefill_logits

# The tiny llama has hidden 64 and intermediate 128, so o_proj's 32 input features per rank at
# two ranks cut a 64-group in half, and act-order slices take features from every group.
SPECS = (
    IntSpec("gptq", 4, 32, sym=False, desc_act=True),
    IntSpec("gptq", 8, 64, sym=True),
    IntSpec("gptq", 4, -1, sym=True),
    IntSpec("awq", 4, 32, sym=False),
    IntSpec("ct", 4, 32, sym=False, desc_act=True),
    IntSpec("ct", 8, -1, sym=True),
)
# Group 128 (the common published setting) on a llama wide enough for it.
WIDE_SPECS = (IntSpec("gptq", 4, 128, sym=True, desc_act=True), IntSpec("awq", 4, 128, sym=False),
              IntSpec("ct", 4, 128, sym=True))


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("wide") / "llama"
    make_tiny_model(out, TinyModelSpec(arch="llama", hidden_size=128, intermediate_size=256,
                                       num_layers=1))
    return out


@pytest.fixture(scope="module")
def int_checkpoints(tiny_models, wide_llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """spec name -> (packed checkpoint, its dequantized float32 reference)."""
    root = tmp_path_factory.mktemp("int-ckpt")
    out = {}
    for spec in SPECS:
        out[spec.name] = (root / spec.name, write_int_checkpoint(tiny_models["llama"],
                                                                 root / spec.name, spec))
    for spec in WIDE_SPECS:
        name = "wide-" + spec.name
        out[name] = (root / name, write_int_checkpoint(wide_llama, root / name, spec))
    return out


def test_quantization_config_parsing_and_errors_name_the_field(tmp_path):
    q = checkpoint_quantization({"quantization_config": quantization_config(SPECS[0])})
    assert q.method is None and q.packed.layout is IntLayout.GPTQ
    assert (q.packed.bits, q.packed.group_size, q.packed.act_order) == (4, 32, True)
    q = checkpoint_quantization({"quantization_config": {
        "quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
        "version": "GEMM"}})
    assert q.packed.layout is IntLayout.AWQ and q.packed.group_size == 128
    q = checkpoint_quantization({"quantization_config": quantization_config(SPECS[4])})
    assert q.packed.layout is IntLayout.PACK_QUANTIZED and q.is_ignored("lm_head")
    assert (q.packed.bits, q.packed.group_size, q.packed.symmetric) == (4, 32, False)
    ct = quantization_config(SPECS[4])
    sparse = {**ct, "format": "sparse-24-bitmask"}
    with_acts = json.loads(json.dumps(ct))
    with_acts["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    tensor = json.loads(json.dumps(ct))
    tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    bad = {
        "bits": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits"),
        "format": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"},
                   "quantization_config.checkpoint_format"),
        "group": ({"quant_method": "gptq", "bits": 4, "group_size": 100},
                  "quantization_config.group_size"),
        "bits type": ({"quant_method": "gptq", "bits": "4"}, "quantization_config.bits"),
        "awq version": ({"quant_method": "awq", "bits": 4, "version": "gemv"},
                        "quantization_config.version"),
        "method": ({"quant_method": "hqq"}, "quantization_config.quant_method"),
        "ct format": (sparse, "quantization_config.format"),
        "ct acts": (with_acts, r"quantization_config.config_groups.group_0.input_activations"),
        "ct strategy": (tensor, r"quantization_config.config_groups.group_0.weights.strategy"),
    }
    for what, (qc, field) in bad.items():
        with pytest.raises(ValueError, match=field) as info:
            checkpoint_quantization({"quantization_config": qc})
        assert "\n" not in str(info.value), what
    # An older AutoGPTQ checkpoint keeps its settings in quantize_config.json.
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 64}))
    merged = with_quantize_config(tmp_path, {"model_type": "llama"})
    assert checkpoint_quantization(merged).packed.bits == 8


@pytest.mark.parametrize("spec", [*SPECS, *WIDE_SPECS], ids=lambda s: s.name)
def test_unpack_and_tp_slices_equal_the_writers_integers(spec):
    """The packed layout of every format dequantizes to exactly the writer's weights, whole and
    as each rank's column-parallel (rows) and row-parallel (input features) slice at 2 and 4
    ranks: groups cut by a slice and act-order permutations survive slicing."""
    torch.manual_seed(0)
    w = torch.randn(64, 256 if spec.group_size == 128 else 128)
    parts = quantize(w, spec, seed=1)
    want = dequantize(parts)  # [N, K] float32
    fmt = checkpoint_quantization({"quantization_config": quantization_config(spec)}).packed
    full = read_unpacked(fmt, "layer", pack(parts, spec))
    assert torch.equal(full.q.long(), parts["q"])
    linear = IntLinear(PackedInt.pack(full))
    assert torch.equal(linear.dequantized_weight(torch.float32), want)
    assert (linear.perm is not None) == spec.desc_act
    for world in (2, 4):
        for rank in range(world):
            rows = IntLinear(PackedInt.pack(tp_slice(full, 0, rank, world, "layer")))
            n = w.shape[0] // world
            assert torch.equal(rows.dequantized_weight(torch.float32),
                               want[rank * n:(rank + 1) * n])
            cols = IntLinear(PackedInt.pack(tp_slice(full, 1, rank, world, "layer")))
            k = w.shape[1] // world
            assert torch.equal(cols.dequantized_weight(torch.float32),
                               want[:, rank * k:(rank + 1) * k])
    # And the forward pass (gathering x by the act-order permutation) is x @ W.T.
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(linear(x), x @ want.t(), atol=1e-4, rtol=1e-5)


def int_linears(shard: Shard) -> list[torch.nn.Module]:
    return [m.quantized for m in shard.runner.model.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def test_checkpoints_serve_the_dequantized_models_logits(int_checkpoints):
    """Through the shard (CPU, float32): logits equal the independently dequantized checkpoint's
    to 1e-4 (the CPU path multiplies by exactly those weights; only the matmul's summation order
    may differ), greedy tokens through the engine are the same, and the linears hold at most 40 %
    (int4) / 65 % (int8) of the bytes of the same weights in bf16 (tiny layers: the per-group
    scales and zeros weigh more than at real sizes)."""
    for name, (packed_dir, ref_dir) in int_checkpoints.items():
        shard = make_shard(packed_dir)  # no --quantize: config.json says gptq / awq
        layers = int_linears(shard)
        assert layers and all(isinstance(m, IntLinear) for m in layers), name
        # q/k/v and gate/up stack into one packed weight where their group layouts agree: not
        # with act-order over several groups (the writer draws each tensor's order); the wide
        # model's act-order q/k/v and gate/up have one group of 128 inputs (nothing to permute).
        merged = [m.merged for m in shard.runner.model.modules()
                  if isinstance(m, MergedColumnParallelLinear)]
        several_ordered_groups = "-act" in name and not name.startswith("wide")
        assert merged and all((w is None) == several_ordered_groups for w in merged), name
        ref = make_shard(ref_dir)
        ref_bytes = sum(m.weight.numel() * 2 for m in ref.runner.model.modules()
                        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))  # as bf16
        bits = layers[0].bits
        # int4: 1/4 of bf16 plus scales and zeros (4 bytes per group of 32..128, or a whole row)
        assert linear_weight_bytes(shard.runner.model) < ref_bytes * (0.4 if bits == 4 else 0.65)
        prompt = prompts(packed_dir, [30])[0]
        got, want = prefill_logits(shard, prompt), prefill_logits(ref, prompt)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)
        p = prompts(packed_dir, [17, 5, 45])
        assert greedy_outputs(shard, p) == greedy_outputs(ref, p), name


def test_two_gloo_ranks_generate_the_one_rank_reference_tokens(int_checkpoints):
    """Act-order GPTQ and compressed-tensors (row-parallel slices take features from every
    group; o_proj's slices cut groups) and AWQ, split over two gloo ranks (one pair of processes
    for all three), generate the greedy tokens their dequantized references generate on one
    rank. The other formats' slices are checked exactly by
    test_unpack_and_tp_slices_equal_the_writers_integers (each model here costs seconds of rank
    start-up and warm-up)."""
    names = (SPECS[0].name, SPECS[3].name, SPECS[4].name)
    dirs = {name: str(int_checkpoints[name][0]) for name in names}
    res = run_ranks(2, {"device": "cpu", "tiny_dirs": dirs}, short_greedy_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    for name in names:
        want = greedy_tokens(load_tiny(int_checkpoints[name][1], "cpu", Dist()), GREEDY_STEPS)
        assert res["tiny_tokens"][name] == want, name


def test_corrupt_or_unsupported_config_fails_at_start_up(int_checkpoints, tmp_path):
    packed_dir, _ = int_checkpoints[SPECS[0].name]
    bad = tmp_path / "bad"
    shutil.copytree(packed_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^quantization_config\.bits: 3 is not supported"):
        Shard(ShardConfig(model_id=str(bad), device="cpu"), Dist())
    with pytest.raises(ValueError, match="--quantize fp8: the checkpoint is already quantized"):
        Shard(ShardConfig(model_id=str(packed_dir), device="cpu", quantize="fp8"), Dist())
