"""GGUF files kept quantized (shard/tools/gguf_repack.py, shard/quantization/gguf_blocks.py): a
tiny llama written by the `gguf` package with its linears in Q8_0 / Q4_0 / Q4_1 (gguf's own
quantizer), Q4_K / Q6_K (valid random blocks: gguf has no K-quant quantizer) and one Q5_0 (a
type that still dequantizes), converted into a packed snapshot and served: its logits equal
transformers' dequantizing GGUF loader's (float32, CPU, to 1e-4: the packed weights equal
gguf's dequantized ones to float32 rounding; only summation order differs), with the linear
weights in a fraction of the bytes; two gloo ranks: test_int_two_ranks.py."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from reference import prompts
from safetensors.torch import load_file, save_file

from shard.distributed.groups import Dist
from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.quantization import linear_weight_bytes
from shard.quantization.gguf_blocks import GGUF_PACKED
from shard.quantization.int_weights import IntLinear
from shard.server.loader import Shard, ShardConfig
from shard.tools.gguf import ensure_snapshot
from tests.helpers.gguf_files import PACKED_LLAMA_TYPES
from tests.helpers.shards import make_shard
from tests.shard.test_quantization_shard import greedy_outputs, prefill_logits

T = gguf.GGMLQuantizationType


def test_packed_snapshot_holds_the_packed_types_and_says_what_dequantized(gguf_llama):
    file, packed, plain, log = gguf_llama.file, gguf_llama.packed, gguf_llama.plain, gguf_llama.log
    assert packed != plain and packed.name.endswith("-packed2")
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gguf", "types": {"Q4_0": 2, "Q4_1": 4, "Q4_K": 3, "Q6_K": 2, "Q8_0": 2}}
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    tensors = load_file(str(packed / "model.safetensors"))
    for name, qtype in PACKED_LLAMA_TYPES.items():
        prefix = name[: -len(".weight")]
        if qtype is T.Q5_0:
            assert name in tensors and f"{prefix}.qweight" not in tensors
        else:
            assert name not in tensors and int(tensors[f"{prefix}.gguf_type"]) == int(qtype)
            assert GGUF_PACKED[int(qtype)][0] == qtype.name
    line = "linears kept quantized: Q4_0 x2, Q4_1 x4, Q4_K x3, Q6_K x2, Q8_0 x2; " \
           "dequantized to float: Q5_0 x1"
    assert line in log
    again: list[str] = []  # a later start-up reuses the snapshot and says it again
    assert ensure_snapshot(file, packed.parent.parent, log=again.append, packed=True).path == packed
    assert again == [line]


def test_packed_snapshot_serves_transformers_gguf_logits(gguf_llama):
    from transformers import AutoModelForCausalLM

    file, packed, plain = gguf_llama.file, gguf_llama.packed, gguf_llama.plain
    shard, ref = make_shard(packed), make_shard(plain)
    layers = [m.quantized for m in shard.runner.model.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert sum(isinstance(m, IntLinear) for m in layers) == 13  # all but the Q5_0 one
    prompt = prompts(packed, [30])[0]
    got = prefill_logits(shard, prompt)
    hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    p = prompts(packed, [17, 5, 45])
    assert greedy_outputs(shard, p) == greedy_outputs(ref, p)
    # Memory of the 13 packed linears: bits per weight with their scales and zeros (float16
    # where exact, else float32): Q4_0 5, Q4_1 5.5, Q4_K 6, Q8_0 9, Q6_K 11 (8-bit storage, a
    # float32 scale per 16): 42 % of bf16 for this mix (Q4_1 alone: 34 %).
    packed_bytes = sum(m.weight_bytes for m in layers if isinstance(m, IntLinear))
    bf16_bytes = sum(m.out_features * m.in_features * 2 for m in layers if isinstance(m, IntLinear))
    assert packed_bytes < 0.45 * bf16_bytes, packed_bytes / bf16_bytes
    # All linears as served (the Q5_0 one in float32 here) against the float snapshot's.
    float32_bytes = sum(m.weight.numel() * m.weight.element_size()
                        for m in ref.runner.model.modules()
                        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    assert linear_weight_bytes(shard.runner.model) < float32_bytes / 3


def test_corrupt_snapshot_fails_at_start_up_naming_the_field(gguf_llama, tmp_path):
    packed = gguf_llama.packed
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["types"] = {"Q5_0": 1}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^quantization_config\.types: Q5_0 not supported"):
        Shard(ShardConfig(model_id=str(bad), device="cpu"), Dist())
    shutil.copy(packed / "config.json", bad / "config.json")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.gguf_type"] = torch.tensor([6], dtype=torch.int32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj\.gguf_type: 6 "):
        Shard(ShardConfig(model_id=str(bad), device="cpu"), Dist())


def test_published_smollm2_q4_1_blocks_repack_exactly():
    """Blocks llama.cpp wrote (the embedded SmolLM2 Q4_1 file: its first layer's seven Q4_1
    linears and the Q8_0 token embedding) decode to gguf's dequantized values, and Q4_1 costs
    4 + 16/32 (float16 scale) + 32/32 (float32 zero: -m/d is not a float16 in general) = 5.5
    bits per weight: 34.4 % of bf16. The whole model through the shard:
    benchmarks/gguf_packed.py."""
    from gguf import quants

    from service.app.launcher import default_model_file
    from shard.tools.gguf_repack import _half_if_exact, decode_blocks

    reader = gguf.GGUFReader(str(default_model_file()))
    chosen = [t for t in reader.tensors
              if t.name.startswith("blk.0.") and t.tensor_type == T.Q4_1]
    assert len(chosen) == 7
    bits = weights = 0
    for t in chosen:
        k, n = (int(x) for x in t.shape[:2])
        q, scales, zeros = decode_blocks(t.data, "Q4_1", n, k)
        scales, zeros = _half_if_exact(scales), _half_if_exact(zeros)
        assert scales.dtype == torch.float16 and zeros.dtype == torch.float32
        g = torch.arange(k) // 32
        got = (q.float() - zeros.float()[:, g]) * scales.float()[:, g]
        want = torch.from_numpy(quants.dequantize(t.data, t.tensor_type))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        bits += 4 * q.numel() + 8 * (scales.numel() * 2 + zeros.numel() * 4)
        weights += q.numel()
    assert bits / (16 * weights) == pytest.approx(0.34375)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embd.tensor_type == T.Q8_0  # kept packed too (tests/shard/test_quantized_embedding.py)


def test_launcher_keeps_gguf_linears_packed_on_cuda_by_default():
    from service.app.launcher import gguf_packed

    assert gguf_packed("auto", "cuda") and gguf_packed("auto", "cuda:1")
    assert not gguf_packed("auto", "cpu")  # CPU matmuls would dequantize every call
    assert gguf_packed("packed", "cpu") and not gguf_packed("dequantize", "cuda")
    assert gguf_packed("auto", None) == torch.cuda.is_available()  # where shards run by default
