"""The transformers backend (shard/models/transformers_backend.py): transformers' own modeling
code on tokenwire's paged KV cache, flat ragged batch and tensor-parallel linears.

Greedy tokens equal transformers' `generate` (float32, tiny random models of each architecture)
through the engine with requests joining and leaving and chunked prefill, on one shard and on two
(gloo), and under --speculate 4 through the router's engine; llama forced through the backend
equals the native path token for token; unsupported models fail at start-up with one line."""

from __future__ import annotations

import pytest
import torch
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim, engine_call

from service.engine.backend import WarmupBudgets
from shard.distributed.groups import Dist
from shard.server.loader import Shard, ShardConfig
from shard.testing.ranks import run_ranks
from shard.testing.tiny import tiny_prompts
from tests.helpers.hf_models import hf_model
from tests.helpers.shards import make_shard
from tests.helpers.spec_engine import Req, ShardServer, router_engine, run_all, token_ids
from tests.helpers.transformers_backend import STEPS, backend_shard, greedy_rank, held_weights

# The twelve architectures (one and two shards), and two more (one shard).
TP_ARCHS = ["gemma", "gemma2", "qwen3", "phi3", "olmo2", "granite", "starcoder2", "stablelm",
            "cohere", "gpt_neox", "mixtral", "qwen2_moe"]
ARCHS = [*TP_ARCHS, "phi", "qwen3_moe"]
N = 12  # new tokens per request


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: hf_model(tmp_path_factory, arch) for arch in ARCHS}


def scenario(shard: Shard, p: list[list[int]]) -> dict[int, list[int]]:
    """A (17) and B (5) prefill together, decode; C (30) prefills in chunks of 16 while A and B
    decode; everything runs to completion."""
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    for i, prompt in enumerate(p):
        sim.add(i + 1, prompt, N)
    sim.prefill([(1, 0), (2, 0)])
    sim.decode()
    sim.prefill([(3, 16)])
    sim.decode()
    sim.prefill([(3, 0)])
    sim.run_to_completion()
    return {rid: req.generated for rid, req in sim.done.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(models, arch):
    model_dir = models[arch]
    shard = backend_shard(model_dir)
    assert shard.info.model_impl == "transformers" and shard.runner.model.supports_lora
    p = prompts(model_dir, [17, 5, 30])
    got = scenario(shard, p)
    hf = load_hf(model_dir)
    for rid in (1, 2, 3):
        assert got[rid] == hf_greedy(hf, p[rid - 1], N), f"{arch} request {rid}"


@pytest.mark.slow
@pytest.mark.timeout(900)  # two processes importing transformers on a shared host
def test_two_ranks_match_transformers(models):
    """Every architecture split over two gloo ranks (one pair of processes for all of them)
    generates what transformers does, holding fewer weights per rank than one shard."""
    dirs = {a: str(models[a]) for a in TP_ARCHS}
    res = run_ranks(2, {"device": "cpu", "dirs": dirs}, greedy_rank, timeout_s=800)
    assert "error" not in res, res.get("error")
    for arch in TP_ARCHS:
        model_dir = models[arch]
        hf = load_hf(model_dir)
        want = [hf_greedy(hf, p, STEPS) for p in tiny_prompts(hf.config.vocab_size)]
        assert res["tokens"][arch] == want, arch
        single = held_weights(backend_shard(model_dir))
        assert res["params"][arch] < single, f"{arch} was not split: {res['params'][arch]}"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_forced_backend_equals_native(tiny_models, arch):
    model_dir = tiny_models[arch]
    p = prompts(model_dir, [17, 5, 30])
    native = make_shard(model_dir)
    backend = make_shard(model_dir, model_impl="transformers")
    assert native.info.model_impl == "native" and backend.info.model_impl == "transformers"
    assert scenario(backend, p) == scenario(native, p)


SPEC_BUDGETS = WarmupBudgets(
    max_input_tokens=64, max_total_tokens=128, max_batch_prefill_tokens=64, max_batch_size=8
)


@pytest.mark.parametrize("arch", ["gemma2", "qwen2_moe", "phi3"])
async def test_speculate_4_matches_transformers(models, tmp_path, arch):
    """--speculate 4 through the router's engine (n-gram drafts verified by the backend in
    steps of up to 5 tokens per request) generates what transformers does."""
    model_dir = models[arch]
    server = ShardServer(model_dir, tmp_path, kv_cache_memory_mb=2, model_impl="transformers")
    try:
        loop = [11, 12, 13, 14, 15] * 5  # repeats: the proposer drafts from the prompt
        reqs = [Req(loop, max_new_tokens=16), Req(prompts(model_dir, [20])[0], max_new_tokens=16)]
        async with router_engine(server.url, SPEC_BUDGETS, 4) as engine:
            events = await run_all(engine, reqs)
            stats = engine.stats()
    finally:
        server.stop()
    assert stats.spec_proposed_tokens > 0
    hf = load_hf(model_dir)
    for r, ev in zip(reqs, events, strict=True):
        assert token_ids(ev) == hf_greedy(hf, r.prompt, 16)


def _config_only(tmp_path, model_type: str, **kw) -> str:
    import transformers

    out = tmp_path / model_type
    transformers.AutoConfig.for_model(model_type, **kw).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("t5", "encoder-decoder models are not served"),
        ("bert", "its attention is not causal"),
        ("bloom", ("BloomForCausalLM does not route attention through transformers' attention "
                   "interface")),
        ("mamba", "MambaForCausalLM does not route attention"),
    ],
)
def test_unsupported_models_fail_at_start_up_naming_the_type(tmp_path, model_type, why):
    model_dir = _config_only(tmp_path, model_type)
    prefix = f"model_type '{model_type}' cannot be served by the transformers backend: "
    with pytest.raises(ValueError, match=prefix + why):
        Shard(ShardConfig(model_id=model_dir), Dist())


def test_model_impl_native_refuses_model_types_without_native_code(models):
    with pytest.raises(ValueError, match="--model-impl native: tokenwire has no native code for "
                                         "model_type 'granite'"):
        Shard(ShardConfig(model_id=str(models["granite"]), model_impl="native"), Dist())


def test_auto_serves_native_families_natively_and_others_through_the_backend(
        tiny_models, models):
    assert make_shard(tiny_models["llama"]).info.model_impl == "native"
    assert make_shard(models["qwen3"]).info.model_impl == "native"
    assert make_shard(models["granite"]).info.model_impl == "transformers"


def test_quantize_applies_to_the_backends_linears(models):
    from shard.quantization.fp8 import Fp8Linear

    shard = backend_shard(models["qwen3"], quantize="fp8")
    fp8 = [m for m in shard.runner.model.hf.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 2 * 7  # q, k, v, o, gate, up, down of both layers
    plain = backend_shard(models["qwen3"])
    p = prompts(models["qwen3"], [17])[0]
    # fp8 weights move the logits, but not far: the quantized linears are in the forward.
    got, want = (_prefill_logits(s, p) for s in (shard, plain))
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=0.5)


def _prefill_logits(shard: Shard, prompt: list[int]) -> torch.Tensor:
    from shard.runner.model_runner import StepInputs

    step = StepInputs(prompt, list(range(len(prompt))), [len(prompt)], [len(prompt)],
                      [list(range(-(-len(prompt) // 16)))], [len(prompt) - 1])
    return shard.runner.execute(step)



def test_swapped_rms_norms_still_compute_what_llamas_does():
    """The RMSNorm classes the backend replaces by tokenwire's (shard/models/transformers_norms.py)
    have Llama's forward to the letter in the installed transformers."""
    import importlib
    import inspect

    from shard.models.transformers_norms import LLAMA_STYLE_RMS_NORMS

    def forward_source(cls_name: str) -> str:
        for module in ("llama", "mistral", "qwen2", "qwen3", "granite", "mixtral", "qwen2_moe",
                       "qwen3_moe"):
            mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
            if hasattr(mod, cls_name):
                return inspect.getsource(getattr(mod, cls_name).forward)
        raise AssertionError(f"{cls_name} not found")

    llama = forward_source("LlamaRMSNorm")
    assert {n: forward_source(n) == llama for n in LLAMA_STYLE_RMS_NORMS} == dict.fromkeys(
        LLAMA_STYLE_RMS_NORMS, True)


def test_lora_adapters_apply_to_the_backends_linears(models, tmp_path):
    """A PEFT adapter on every projection of a model forced through the backend (qwen3) gives
    what transformers + PeftModel gives, beside base-model requests."""
    from shard.lora import AdapterSource
    from tests.helpers.lora import load_base, peft_greedy, write_adapter

    model_dir = models["qwen3"]
    base = load_base(model_dir)
    adapter = write_adapter(model_dir, tmp_path / "all4", r=4, alpha=8.0, seed=1, base=base)
    shard = backend_shard(model_dir, max_loras=2, max_lora_rank=4)
    shard.register_adapter(shard.read_adapter(AdapterSource("all4", str(adapter))))
    prompt = prompts(model_dir, [11])[0]
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(1, prompt, N, adapter="all4")
    sim.add(2, prompt, N)
    sim.prefill([(1, 0), (2, 0)])
    sim.run_to_completion()
    with_adapter = peft_greedy(model_dir, adapter, prompt, N, base=base)
    assert sim.done[1].generated == with_adapter
    assert sim.done[2].generated == peft_greedy(model_dir, None, prompt, N, base=base)
    assert with_adapter != sim.done[2].generated  # the adapter changes the output
