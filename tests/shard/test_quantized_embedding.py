"""Token embedding and LM head served in the checkpoint's own integer form
(shard/quantization/embedding.py): a tiny llama whose tied embedding is GGUF Q8_0, one whose
embedding is Q4_1 and untied head Q8_0, and a compressed-tensors pack-quantized lm_head. Each is
checked against its own dequantized values (transformers' dequantizing GGUF loader, or the same
integers dequantized by the test-side writer), float32 on CPU; the tables stay packed (no float
weight), a tied head shares the embedding's one copy, and vocabulary slices of tensor-parallel
ranks (padded) sum to the whole lookup."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from reference import prompts
from safetensors.torch import load_file, save_file

from shard.distributed.groups import Dist
from shard.layers.embedding import VocabParallelEmbedding
from shard.layers.weights import Weights
from shard.quantization.embedding import load_int_rows, lookup_rows
from shard.quantization.int_weights import IntLinear, PackedInt, UnpackedInt
from shard.quantization.loading import LinearQuantization
from shard.tools.gguf import ensure_snapshot
from tests.helpers.gguf_files import write_gguf
from tests.helpers.int_checkpoints import IntSpec, write_int_checkpoint
from tests.helpers.shards import make_shard
from tests.shard.test_quantization_shard import prefill_logits

T = gguf.GGMLQuantizationType
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture
def tiny(tiny_model_dir: Path) -> Path:
    """The session's tiny random llama (vocabulary 512, hidden 64)."""
    return tiny_model_dir


def tied_copy(src: Path, dst: Path) -> Path:
    """src with tie_word_embeddings and no lm_head.weight (as tied checkpoints are saved)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[HEAD]
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def gguf_snapshot(model: Path, root: Path, types: dict[str, T]) -> tuple[Path, Path]:
    file = write_gguf(model, root / "files" / "m.gguf", gguf.MODEL_ARCH.LLAMA, types)
    return file, ensure_snapshot(file, root / "cache", log=lambda _: None, packed=True).path


def transformers_logits(file: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def tables(shard) -> tuple[VocabParallelEmbedding, torch.nn.Module]:
    model = shard.runner.model
    return model.model.embed_tokens, model.lm_head


def test_tied_q8_0_embedding_stays_packed_and_serves_gguf_logits(tiny, tmp_path):
    tied = tied_copy(tiny, tmp_path / "tied")
    file, snap = gguf_snapshot(tied, tmp_path, {EMBED: T.Q8_0,
                                                "model.layers.0.mlp.up_proj.weight": T.Q4_1})
    stored = load_file(str(snap / "model.safetensors"))
    assert EMBED not in stored and HEAD not in stored
    assert int(stored["model.embed_tokens.gguf_type"]) == int(T.Q8_0)
    assert json.loads((snap / "config.json").read_text())["quantization_config"]["types"] == {
        "Q4_1": 1, "Q8_0": 1}
    shard = make_shard(snap, dtype="float32")
    embed, head = tables(shard)
    assert embed.weight is None and isinstance(embed.quantized, IntLinear)
    assert head.quantized is embed.quantized  # one copy of the table
    vocab, hidden = embed.quantized.out_features, embed.quantized.in_features
    # int8 values, a float16 scale and a float16 zero (128) per 32: 9 bits per weight.
    assert embed.quantized.weight_bytes == vocab * hidden * 9 // 8
    prompt = prompts(snap, [30])[0]
    torch.testing.assert_close(prefill_logits(shard, prompt), transformers_logits(file, prompt),
                               atol=1e-4, rtol=1e-4)


def test_untied_q4_1_embedding_and_q8_0_head_serve_gguf_logits(tiny, tmp_path):
    file, snap = gguf_snapshot(tiny, tmp_path, {EMBED: T.Q4_1, HEAD: T.Q8_0})
    shard = make_shard(snap, dtype="float32")
    embed, head = tables(shard)
    assert isinstance(embed.quantized, IntLinear) and embed.quantized.bits == 4
    assert isinstance(head.quantized, IntLinear) and head.quantized.bits == 8
    assert head.weight is None and head.quantized is not embed.quantized
    prompt = prompts(snap, [30])[0]
    torch.testing.assert_close(prefill_logits(shard, prompt), transformers_logits(file, prompt),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("layout", "marker"), [("ct", "weight_packed"), ("gptq", "qweight")])
def test_int_checkpoint_lm_head_is_served_packed(tiny, tmp_path, layout, marker):
    """compressed-tensors pack-quantized (llm-compressor with lm_head targeted) and GPTQ v1
    (GPTQModel's lm_head=True) heads."""
    spec = IntSpec(layout, 4, 32, sym=True)
    ckpt = tmp_path / layout
    ref = write_int_checkpoint(tiny, ckpt, spec, tables=("lm_head",))
    assert f"lm_head.{marker}" in load_file(str(ckpt / "model.safetensors"))
    shard, want = make_shard(ckpt, dtype="float32"), make_shard(ref, dtype="float32")
    embed, head = tables(shard)
    assert embed.quantized is None and embed.weight is not None  # stored float
    assert isinstance(head.quantized, IntLinear) and head.weight is None
    prompt = prompts(ckpt, [30])[0]
    torch.testing.assert_close(prefill_logits(shard, prompt), prefill_logits(want, prompt),
                               atol=1e-4, rtol=1e-4)


def test_lookup_dequantizes_the_gathered_rows_act_order_included():
    g = torch.Generator().manual_seed(0)
    n, k, groups = 40, 64, 4
    g_idx = torch.randperm(k, generator=g) % groups  # act-order: groups all over the row
    w = UnpackedInt(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                    torch.rand(n, groups, generator=g).half(),
                    torch.randint(0, 16, (n, groups), generator=g).half(), g_idx, 4)
    table = IntLinear(PackedInt.pack(w))
    assert table.perm is not None
    ids = torch.tensor([3, 0, 39, 3, 17])
    torch.testing.assert_close(lookup_rows(table, ids, torch.float32),
                               w.dequantize(torch.float32)[ids], rtol=0, atol=0)


def test_vocabulary_slices_of_three_ranks_sum_to_the_lookup(tiny, tmp_path):
    """512 rows over 3 ranks: 171 per rank, the last padded with one zero row."""
    _, snap = gguf_snapshot(tiny, tmp_path, {EMBED: T.Q8_0})
    config = json.loads((snap / "config.json").read_text())
    quant = LinearQuantization.resolve(None, config)
    assert config["vocab_size"] == 512
    want = torch.from_numpy(gguf.quants.dequantize(
        gguf.quants.quantize(load_file(str(tiny / "model.safetensors"))[EMBED].numpy(), T.Q8_0),
        T.Q8_0))
    ids = torch.tensor([0, 170, 171, 341, 342, 511, 5])
    total = torch.zeros(len(ids), want.shape[1])
    for rank in range(3):
        dist = Dist(rank=rank, world_size=3)
        embed = VocabParallelEmbedding(512, want.shape[1], dist)
        embed.load(Weights(snap, torch.device("cpu"), torch.float32, dist, quant),
                   "model.embed_tokens")
        assert embed.quantized.out_features == 171
        total += embed.partial(ids)
        if rank == 2:  # rows 342..511 and one padding row of zeros
            last = lookup_rows(embed.quantized, torch.tensor([170]), torch.float32)
            assert not last.any()
    torch.testing.assert_close(total, want[ids], rtol=0, atol=0)
    weights = Weights(snap, torch.device("cpu"), torch.float32, Dist(), quant)
    with pytest.raises(ValueError, match=r"^model\.embed_tokens: 512 stored rows, the config's "
                                         r"vocabulary needs 600"):
        load_int_rows(weights, "model.embed_tokens", 0, 600, 600)


def test_an_int_quantized_head_is_refused_naming_the_tensor(tiny, tmp_path):
    """W8A8 int-quantized tables are not read: refused at start-up, not served as floats."""
    from shard.server.loader import Shard, ShardConfig

    ckpt = tmp_path / "w8a8"
    write_int_checkpoint(tiny, ckpt, IntSpec("w8a8", 8, -1, sym=True), tables=("lm_head",))
    with pytest.raises(ValueError, match=r"^lm_head\.weight_scale: int-quantized vocabulary "
                                         r"tables are not supported"):
        Shard(ShardConfig(model_id=str(ckpt), device="cpu", kv_cache_memory_mb=1), Dist())
