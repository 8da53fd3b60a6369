"""Native Gemma 2 and Gemma 3 text (shard/models/gemma.py) against transformers, float32 on CPU.

Tiny random models whose every Gemma option changes the output: norm weights random (the (1 + w)
offset and its rounding), a sliding window of 6 that every prompt crosses, local and global
layers with different rotary bases (Gemma 3: scaled global rotary), an attention soft-cap small
enough to bind (Gemma 2), query_pre_attn_scalar unlike head_dim, and a final-logit soft-cap
(monotonic, so it never changes a greedy token: the logits test checks it). Greedy tokens equal
transformers' generate through the engine (requests joining and leaving, chunked prefill), the
transformers backend's tokens on the same scenario, and the two-rank (gloo) tokens.
"""

from __future__ import annotations

import pytest
import torch
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim, engine_call
from test_engine_greedy import joining_and_leaving

from shard.layers.rotary import rope_parameters
from shard.models.layer_types import FULL, SLIDING, layer_types
from shard.runner.model_runner import StepInputs
from shard.testing.ranks import run_ranks
from shard.testing.tiny import tiny_prompts
from tests.helpers.gemma import GEMMA_CONFIGS, gemma_model
from tests.helpers.native_families import STEPS, held_weights, native_greedy_rank
from tests.helpers.shards import make_shard

ARCHS = list(GEMMA_CONFIGS)


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory):
    return {arch: gemma_model(tmp_path_factory, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(gemma_models):
    return {arch: load_hf(d) for arch, d in gemma_models.items()}


def _scenario(shard, p: list[list[int]]) -> dict[int, list[int]]:
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    joining_and_leaving(sim, p)
    return {rid: req.generated for rid, req in sim.done.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_and_the_backend(gemma_models, hf_models, arch):
    model_dir = gemma_models[arch]
    native = make_shard(model_dir)
    assert native.info.model_impl == "native"
    p = prompts(model_dir, [17, 5, 45, 30])
    got = _scenario(native, p)
    hf = hf_models[arch]
    for rid in (1, 2, 3, 4):
        prompt, n = p[rid - 1], len(got[rid])
        assert n > 0 and got[rid] == hf_greedy(hf, prompt, n), f"{arch} request {rid}"
    backend = make_shard(model_dir, model_impl="transformers")
    assert backend.info.model_impl == "transformers"
    assert _scenario(backend, p) == got


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(gemma_models, hf_models, arch):
    """The logits themselves (final-logit soft-capping included) at every prompt position."""
    model_dir = gemma_models[arch]
    shard = make_shard(model_dir)
    prompt = prompts(model_dir, [20])[0]
    n = len(prompt)
    step = StepInputs(prompt, list(range(n)), [n], [n], [list(range(-(-n // 16)))],
                      list(range(n)))
    got = shard.runner.execute(step)  # [n, vocab]
    with torch.inference_mode():
        want = hf_models[arch](torch.tensor([prompt])).logits[0].float()
    cap = GEMMA_CONFIGS[arch]["final_logit_softcapping"]
    assert float(got.abs().max()) < cap  # capped
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_match_transformers(gemma_models, hf_models):
    """Both models split over two gloo ranks (one pair of processes) generate transformers'
    tokens, each rank holding fewer weights than one shard."""
    dirs = {arch: str(d) for arch, d in gemma_models.items()}
    res = run_ranks(2, {"device": "cpu", "dirs": dirs}, native_greedy_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    for arch in ARCHS:
        hf = hf_models[arch]
        want = [hf_greedy(hf, p, STEPS) for p in tiny_prompts(hf.config.vocab_size)]
        assert res["tokens"][arch] == want, arch
        assert res["params"][arch] < held_weights(make_shard(gemma_models[arch])), arch


def test_layer_types_and_rotary_bases_from_old_and_new_configs():
    """Checkpoints written before transformers 5 give patterns and rope_local_base_freq."""
    assert layer_types({"model_type": "gemma2", "num_hidden_layers": 4}) == [
        SLIDING, FULL, SLIDING, FULL]
    old3 = {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window_pattern": 3,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert layer_types(old3) == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    assert rope_parameters(old3, SLIDING) == {"rope_theta": 1e4, "rope_type": "default"}
    assert rope_parameters(old3, FULL) == {"rope_theta": 1e6, "rope_type": "linear",
                                           "factor": 8.0}
    new3 = {"rope_parameters": GEMMA_CONFIGS["gemma3_text"]["rope_parameters"]}
    assert rope_parameters(new3, FULL)["factor"] == 4.0
    assert rope_parameters(new3, SLIDING)["rope_theta"] == 10.0
    with pytest.raises(ValueError, match="layer_types must list 2 entries"):
        layer_types({"num_hidden_layers": 2, "layer_types": [SLIDING]})


def test_lora_adapter_matches_peft(gemma_models, tmp_path):
    """A PEFT adapter on every projection of native Gemma 2 (the GELU gate/up path included)
    gives what transformers + PeftModel gives, beside a base-model request."""
    from shard.lora import AdapterSource
    from tests.helpers.lora import load_base, peft_greedy, write_adapter

    model_dir = gemma_models["gemma2"]
    base = load_base(model_dir)
    adapter = write_adapter(model_dir, tmp_path / "all4", r=4, alpha=8.0, seed=1, base=base)
    shard = make_shard(model_dir, max_loras=2, max_lora_rank=4)
    assert shard.info.model_impl == "native"
    shard.register_adapter(shard.read_adapter(AdapterSource("all4", str(adapter))))
    prompt = prompts(model_dir, [11])[0]
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(1, prompt, 12, adapter="all4")
    sim.add(2, prompt, 12)
    sim.prefill([(1, 0), (2, 0)])
    sim.run_to_completion()
    with_adapter = peft_greedy(model_dir, adapter, prompt, 12, base=base)
    assert sim.done[1].generated == with_adapter
    assert sim.done[2].generated == peft_greedy(model_dir, None, prompt, 12, base=base)
    assert with_adapter != sim.done[2].generated  # the adapter changes the output


def test_bidirectional_gemma_is_refused_natively_naming_the_field(tmp_path):
    import transformers

    from shard.distributed.groups import Dist
    from shard.server.loader import Shard, ShardConfig

    transformers.AutoConfig.for_model(
        "gemma3_text", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="native gemma3_text code cannot serve this config: "
                                         "use_bidirectional_attention"):
        Shard(ShardConfig(model_id=str(tmp_path), model_impl="native"), Dist())
