"""GGUF files kept quantized (shard/tools/gguf_repack.py, shard/quantization/gguf_blocks.py): a
tiny llama written by the `gguf` package with its linears in Q8_0 / Q4_0 / Q4_1 (gguf's own
quantizer), Q4_K / Q6_K (valid random blocks: gguf has no K-quant quantizer) and one Q5_0 (a
type that still dequantizes), converted into a packed snapshot and served: its logits equal
transformers' dequantizing GGUF loader's (float32, CPU, to 1e-4: the packed weights equal
gguf's dequantized ones to float32 rounding; only summation order differs), at 1 and 2 (gloo)
ranks, with the linear weights in a fraction of the bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
from shard.testing.ranks import run_ranks
from shard.testing.tiny import greedy_tokens, load_tiny
from shard.tools.gguf import ensure_snapshot
from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers.gguf_files import write_gguf
from tests.helpers.int_checkpoints import GREEDY_STEPS, short_greedy_rank
from tests.helpers.shards import make_shard
from tests.shard.test_quantization_shard import greedy_outputs, prefill_logits

T = gguf.GGMLQuantizationType
# Every packed type on several kinds of linear; layer 1's gate_proj in Q5_0 stays float.
TYPES = {
    "model.layers.0.self_attn.q_proj.weight": T.Q8_0,
    "model.layers.0.self_attn.k_proj.weight": T.Q4_0,
    "model.layers.0.self_attn.v_proj.weight": T.Q4_1,
    "model.layers.0.self_attn.o_proj.weight": T.Q4_K,
    "model.layers.0.mlp.gate_proj.weight": T.Q6_K,
    "model.layers.0.mlp.up_proj.weight": T.Q4_1,
    "model.layers.0.mlp.down_proj.weight": T.Q4_K,
    "model.layers.1.self_attn.q_proj.weight": T.Q4_K,
    "model.layers.1.self_attn.k_proj.weight": T.Q6_K,
    "model.layers.1.self_attn.v_proj.weight": T.Q8_0,
    "model.layers.1.self_attn.o_proj.weight": T.Q4_0,
    "model.layers.1.mlp.gate_proj.weight": T.Q5_0,
    "model.layers.1.mlp.up_proj.weight": T.Q4_1,
    "model.layers.1.mlp.down_proj.weight": T.Q4_1,
}


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory) -> tuple[Path, Path, Path, list[str]]:
    """(the GGUF file, its packed snapshot, its float snapshot, the packed conversion's log)."""
    root = tmp_path_factory.mktemp("gguf-packed")
    # K-quants need rows of 256: hidden 256, intermediate 512 (head dim 64, GQA 4/2)
    model = make_tiny_model(root / "model", TinyModelSpec(arch="llama", hidden_size=256,
                                                          intermediate_size=512))
    file = write_gguf(model, root / "files" / "tiny-llama.gguf", gguf.MODEL_ARCH.LLAMA, TYPES)
    log: list[str] = []
    cache = root / "cache"
    packed = ensure_snapshot(file, cache, log=log.append, packed=True).path
    plain = ensure_snapshot(file, cache, log=lambda _: None).path
    return file, packed, plain, log


def test_packed_snapshot_holds_the_packed_types_and_says_what_dequantized(gguf_llama):
    file, packed, plain, log = gguf_llama
    assert packed != plain and packed.name.endswith("-packed")
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gguf", "types": {"Q4_0": 2, "Q4_1": 4, "Q4_K": 3, "Q6_K": 2, "Q8_0": 2}}
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    tensors = load_file(str(packed / "model.safetensors"))
    for name, qtype in TYPES.items():
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

    file, packed, plain, _ = gguf_llama
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


def test_two_gloo_ranks_generate_the_float_snapshots_tokens(gguf_llama):
    _, packed, plain, _ = gguf_llama
    res = run_ranks(2, {"device": "cpu", "tiny_dirs": {"gguf": str(packed)}},
                    short_greedy_rank, timeout_s=300)
    assert "error" not in res, res.get("error")
    assert res["tiny_tokens"]["gguf"] == greedy_tokens(load_tiny(plain, "cpu", Dist()),
                                                       GREEDY_STEPS)


def test_corrupt_snapshot_fails_at_start_up_naming_the_field(gguf_llama, tmp_path):
    _, packed, _, _ = gguf_llama
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
