"""Native model code of Qwen3, OLMo-2 and Phi-3 (shard/models/qwen3.py, olmo2.py, phi3.py):
greedy tokens equal transformers' `generate` (float32, tiny random models, each family's quirks
switched on: per-head q/k norms, head_dim != hidden / heads, tied embeddings; post-norms and
projection-wide q/k norms; checkpoint-fused qkv_proj / gate_up_proj and LongRoPE across its
switch to the long factors) through the engine with requests joining and leaving and chunked
prefill; the transformers backend serving the same checkpoint gives the same tokens; two gloo
ranks give transformers' tokens holding fewer weights each; Qwen3 and Phi-3 (fused targets)
with a LoRA adapter equal transformers + PEFT; Qwen3 with an fp8 KV cache changes no clear
choice."""

from __future__ import annotations

import pytest
import torch
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim, engine_call
from test_quantization_shard import teacher_forced_logits
from test_transformers_backend import N, scenario

from shard.testing.ranks import run_ranks
from shard.testing.tiny import greedy_tokens, tiny_prompts
from shard.tools.tiny_any import write_tiny_any
from tests.helpers.native_families import (
    FAMILIES,
    LONGROPE_ORIGINAL,
    STEPS,
    held_weights,
    native_greedy_rank,
    native_shard,
)
from tests.helpers.lora import ALL_TARGETS
from tests.helpers.numerics import rel_err


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {f: write_tiny_any(tmp_path_factory.mktemp(f) / "model", f, **kw)
            for f, kw in FAMILIES.items()}


@pytest.fixture(scope="module")
def hf_models(models):
    return {f: load_hf(d) for f, d in models.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_greedy_equals_transformers_and_the_backend(models, hf_models, family):
    model_dir, hf = models[family], hf_models[family]
    native = native_shard(model_dir, model_impl="auto")  # auto picks the native code
    assert native.info.model_impl == "native"
    p = prompts(model_dir, [17, 5, 30])
    got = scenario(native, p)
    for rid in (1, 2, 3):
        assert got[rid] == hf_greedy(hf, p[rid - 1], N), f"{family} request {rid}"
    # Batched prefill then decode steps.
    want = [hf_greedy(hf, q, STEPS) for q in tiny_prompts(hf.config.vocab_size)]
    assert greedy_tokens(native, STEPS) == want
    if family == "phi3":  # a prompt past LongRoPE's original context: the long factors
        long_prompt = prompts(model_dir, [LONGROPE_ORIGINAL + 6])[0]
        sim = RouterSim(engine_call(native), native.runner.num_blocks, native.runner.block_size)
        sim.add(1, long_prompt, N)
        sim.add(2, p[1], N)  # a short sequence in the same batch keeps the short factors
        sim.prefill([(1, 0), (2, 0)])
        sim.run_to_completion()
        assert sim.done[1].generated == hf_greedy(hf, long_prompt, N)
        assert sim.done[2].generated == got[2]
    backend = native_shard(model_dir, model_impl="transformers")
    assert backend.info.model_impl == "transformers"
    assert scenario(backend, p) == got


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_equal_transformers(models, hf_models):
    """Every family split over two gloo ranks (one pair of processes for all of them)."""
    res = run_ranks(2, {"device": "cpu", "dirs": {f: str(d) for f, d in models.items()}},
                    native_greedy_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    for family, model_dir in models.items():
        hf = hf_models[family]
        want = [hf_greedy(hf, q, STEPS) for q in tiny_prompts(hf.config.vocab_size)]
        assert res["tokens"][family] == want, family
        single = held_weights(native_shard(model_dir))
        assert res["params"][family] < single, f"{family} was not split"


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen3", ALL_TARGETS),  # q/k/v feed the q/k norms
    ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # Phi-3's fused names
])
def test_lora_equals_peft(models, hf_models, tmp_path, family, targets):
    """A PEFT adapter on every projection gives what transformers + PeftModel gives, beside
    base-model requests in the same batch (Phi-3: adapters on the fused projections adapt each
    part with the shared A and its rows of B)."""
    from shard.lora import AdapterSource
    from tests.helpers.lora import peft_greedy, write_adapter

    model_dir, base = models[family], hf_models[family]
    adapter = write_adapter(model_dir, tmp_path / "all", r=4, alpha=8.0, seed=1, base=base,
                            targets=targets)
    shard = native_shard(model_dir, max_loras=2, max_lora_rank=4)
    shard.register_adapter(shard.read_adapter(AdapterSource("all", str(adapter))))
    prompt = prompts(model_dir, [11])[0]
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(1, prompt, N, adapter="all")
    sim.add(2, prompt, N)
    sim.prefill([(1, 0), (2, 0)])
    sim.run_to_completion()
    with_adapter = peft_greedy(model_dir, adapter, prompt, N, base=base)
    assert sim.done[1].generated == with_adapter
    assert sim.done[2].generated == peft_greedy(model_dir, None, prompt, N, base=base)
    assert with_adapter != sim.done[2].generated  # the adapter changes the output


def test_qwen3_fp8_kv_cache_keeps_clear_choices(models):
    """As tests/shard/test_quantization_shard.py checks llama's: an fp8 cache (per-KV-head scales
    calibrated on the normed keys) moves the logits by fp8 noise only."""
    model_dir = models["qwen3"]
    tokens = prompts(model_dir, [60])[0]
    fp8 = native_shard(model_dir, kv_cache_dtype="fp8_e4m3fn")
    assert fp8.runner.kv_cache[0][0].dtype == torch.float8_e4m3fn
    want = teacher_forced_logits(native_shard(model_dir), tokens, 20)
    got = teacher_forced_logits(fp8, tokens, 20)
    assert rel_err(got, want) < 0.07
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.3
    assert clear.float().mean() > 0.2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize(("family", "extra", "why"), [
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),  # Phi-4-mini
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 1024}},
     "rope_type 'yarn' is not supported"),
])
def test_variants_the_native_code_does_not_assemble_go_to_the_backend(tmp_path, family, extra,
                                                                       why):
    """auto serves them through the backend; native refuses them naming what it lacks."""
    from shard.distributed.groups import Dist
    from shard.server.loader import Shard, ShardConfig

    model_dir = write_tiny_any(tmp_path / family, family, **extra)
    assert native_shard(model_dir, model_impl="auto").info.model_impl == "transformers"
    with pytest.raises(ValueError, match=f"--model-impl native: the native {family} code "
                                         f"cannot serve this config: {why}"):
        Shard(ShardConfig(model_id=str(model_dir), model_impl="native"), Dist())
