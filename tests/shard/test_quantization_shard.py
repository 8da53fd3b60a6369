"""Quantization through the shard on tiny models (CPU): --kv-cache-dtype fp8 keeps greedy output,
--quantize builds quantized TP linears at load time, pre-quantized fp8 checkpoints load."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import prompts
from safetensors.torch import load_file, save_file
from shard_driver import RouterSim, engine_call

from shard.distributed.groups import Dist
from shard.runner.warmup import WarmupSpec
from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.server.loader import Shard, ShardConfig
from shard.runner.model_runner import StepInputs
from shard.quantization import linear_weight_bytes
from shard.quantization.fp8 import Fp8Linear, quantize_fp8_per_channel
from shard.tools.tiny_training import task_continuation, task_prompts
from tests.helpers.numerics import rel_err
from tests.helpers.shards import make_shard
from tests.helpers.tools import needs

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
N = 32


def greedy_outputs(shard: Shard, p: list[list[int]]) -> dict[int, list[int]]:
    """Two requests prefilled together, a third joining mid-way in two chunks; N tokens each."""
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(1, p[0], N)
    sim.add(2, p[1], N)
    sim.prefill([(1, 0), (2, 0)])
    for _ in range(4):
        sim.decode()
    sim.add(3, p[2], N)
    sim.prefill([(3, 16)])
    sim.prefill([(3, 0)])
    sim.run_to_completion()
    return {rid: sim.done[rid].generated for rid in (1, 2, 3)}


def prefill_logits(shard: Shard, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, one sequence in blocks 0.. (the KV cache is scratch)."""
    n, bs = len(prompt), shard.runner.block_size
    step = StepInputs(
        token_ids=prompt,
        positions=list(range(n)),
        query_lens=[n],
        seq_lens=[n],
        block_tables=[list(range(-(-n // bs)))],
        logits_indices=list(range(n)),
    )
    return shard.runner.execute(step)  # [n, vocab] float32


def teacher_forced_logits(shard: Shard, tokens: list[int], prefill: int) -> torch.Tensor:
    """Logits after every token: a prefill of the first `prefill` tokens, then one decode step per
    further token (paged writes and reads across blocks). [len(tokens), vocab]."""
    bs = shard.runner.block_size
    table = list(range(-(-len(tokens) // bs)))
    rows = [
        shard.runner.execute(
            StepInputs(
                token_ids=tokens[:prefill],
                positions=list(range(prefill)),
                query_lens=[prefill],
                seq_lens=[prefill],
                block_tables=[table],
                logits_indices=list(range(prefill)),
            )
        )
    ]
    for pos in range(prefill, len(tokens)):
        rows.append(
            shard.runner.execute(
                StepInputs(
                    token_ids=[tokens[pos]],
                    positions=[pos],
                    query_lens=[1],
                    seq_lens=[pos + 1],
                    block_tables=[table],
                    logits_indices=[0],
                )
            )
        )
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_fp8_kv_cache_matches_where_the_choice_is_clear(tiny_models, arch):
    """fp8 K/V carry ~2.5% rms rounding (3 mantissa bits), which moves these random tiny models'
    logits by ~4% rms (max ~0.2 on logits of std ~0.8). Random weights give near-ties at many
    steps, so exact 32-token greedy equality is not a property of fp8 here; what must hold is
    that the fp8 cache changes no choice whose margin exceeds that noise."""
    model_dir = tiny_models[arch]
    tokens = prompts(model_dir, [80])[0]
    dense = make_shard(model_dir)
    fp8 = make_shard(model_dir, kv_cache_dtype="fp8_e4m3fn")
    key_cache, _ = fp8.runner.kv_cache[0]
    assert key_cache.dtype == torch.float8_e4m3fn
    want = teacher_forced_logits(dense, tokens, 20)  # 20-token prefill, 60 decode steps
    got = teacher_forced_logits(fp8, tokens, 20)
    assert rel_err(got, want) < 0.07
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.3
    assert clear.float().mean() > 0.2  # not vacuous (random models: many near-ties)
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


# The largest logit change an fp8 cache made in the teacher-forced check above on these models
# (measured: 0.19-0.21 max |dlogit|, 4.3-4.6% rms, CPU float32, per-KV-head calibrated scales).
FP8_KV_LOGIT_NOISE = 0.25


def test_fp8_kv_cache_greedy_32_tokens(tiny_models, record_property):
    """Greedy output through the engine (batched prefill, decode, chunked prefill) with an fp8
    cache equals the model-dtype cache for 32 tokens, except where the dense run itself had a
    near-tie: any divergence must be at a step whose dense top-2 margin is below the fp8 logit
    noise (e4m3 keeps 3 mantissa bits: ~2.5% rms per element whatever the scale). The margins
    at divergences are recorded (benchmarks/QUANT_TP.md lists them)."""
    model_dir = tiny_models["llama"]
    p = prompts(model_dir, [17, 5, 45])
    dense_shard = make_shard(model_dir)
    dense = greedy_outputs(dense_shard, p)
    fp8 = greedy_outputs(make_shard(model_dir, kv_cache_dtype="fp8_e4m3fn"), p)
    assert all(len(v) == N for v in fp8.values())
    margins = {}
    for i, rid in enumerate(sorted(dense)):
        first = next((j for j, (a, b) in enumerate(zip(fp8[rid], dense[rid])) if a != b), None)
        if first is None:
            continue
        prompt = p[i]
        logits = teacher_forced_logits(dense_shard, prompt + dense[rid], len(prompt))
        top2 = logits[len(prompt) - 1 + first].topk(2).values
        margins[rid] = (first, float(top2[0] - top2[1]))
    record_property("fp8_kv_divergences", margins)
    print(f"fp8 KV greedy divergences (request: (token, dense top-2 margin)): {margins}")
    for rid, (first, margin) in margins.items():
        assert margin < FP8_KV_LOGIT_NOISE, (rid, first, margin)


def greedy_path_margins(logits: torch.Tensor, prompt_len: int, generated: int) -> torch.Tensor:
    """Top-2 logit margin at each of `generated` greedy steps, from teacher_forced_logits of
    the prompt and its greedy tokens (prefill of the prompt). [generated]"""
    top2 = logits[prompt_len - 1 : prompt_len - 1 + generated].topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_fp8_kv_cache_greedy_32_tokens_trained_model(trained_tiny_models, arch, record_property):
    """Issue 8's acceptance, "greedy output unchanged for 32 tokens", exactly, on a tiny model
    trained on the progression task (shard/tools/tiny_training.py): its choices are confident like a
    real model's, unlike the random models' near-ties above. Same engine path (batched prefill,
    decode, chunked prefill). The margins and the fp8 cache's logit change along the greedy
    path are asserted too: the equality holds because every margin dwarfs the fp8 noise."""
    model_dir = trained_tiny_models(arch)
    p = task_prompts((17, 5, 45))
    dense_shard = make_shard(model_dir)
    fp8_shard = make_shard(model_dir, kv_cache_dtype="fp8_e4m3fn")
    dense = greedy_outputs(dense_shard, p)
    fp8 = greedy_outputs(fp8_shard, p)
    assert fp8 == dense
    margins, noise = [], []
    for i, rid in enumerate(sorted(dense)):
        assert dense[rid] == task_continuation(p[i], N), rid  # the model does the task
        tokens = p[i] + dense[rid]
        # One dense teacher-forced pass gives both the margins and the reference logits.
        want = teacher_forced_logits(dense_shard, tokens, len(p[i]))
        margins.append(greedy_path_margins(want, len(p[i]), len(dense[rid])))
        got = teacher_forced_logits(fp8_shard, tokens, len(p[i]))
        noise.append((got - want).abs().max())
    min_margin, max_noise = float(torch.cat(margins).min()), float(torch.stack(noise).max())
    record_property("min_top2_margin", min_margin)
    record_property("fp8_max_abs_logit_change", max_noise)
    print(f"{arch}: min top-2 margin {min_margin:.2f}, fp8 KV max |dlogit| {max_noise:.3f}")
    assert min_margin > 1.0
    assert min_margin > 2 * max_noise


def test_fp8_kv_cache_doubles_capacity(tiny_models):
    """Same memory budget, half the bytes per block of a bf16 cache: twice the blocks."""
    spec = WarmupSpec(128, 256, 256, 8)  # no token cap: the 1 MiB budget decides

    def blocks(**kw) -> tuple[int, int]:
        cfg = ShardConfig(
            model_id=str(tiny_models["llama"]), kv_cache_memory_mb=1, dtype="bfloat16", **kw
        )
        shard = Shard(cfg, Dist())
        shard.warmup(spec)
        return shard.runner.kv_bytes_per_block(), shard.runner.num_blocks

    bf16_bytes, bf16_blocks = blocks()
    fp8_bytes, fp8_blocks = blocks(kv_cache_dtype="fp8_e4m3fn")
    assert fp8_bytes * 2 == bf16_bytes
    assert fp8_blocks == 2 * bf16_blocks


def quantized_linears(shard: Shard) -> list[torch.nn.Module]:
    return [
        m.quantized
        for m in shard.runner.model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]


@pytest.mark.parametrize(
    ("method", "bound"),
    [
        ("fp8", 0.12),
        pytest.param("bitsandbytes", 0.04, marks=needs(HAS_BNB, "no bnb")),
        pytest.param(
            "bitsandbytes-nf4", 0.3, marks=needs(HAS_BNB, "no bnb")
        ),
    ],
)
def test_quantize_flag_on_tiny_llama(tiny_models, method, bound):
    model_dir = tiny_models["qwen2"]  # q/k/v biases exercise the quantized bias path
    prompt = prompts(model_dir, [40])[0]
    dense = make_shard(model_dir)
    quant = make_shard(model_dir, quantize=method)
    layers = quantized_linears(quant)
    assert layers and all(m is not None for m in layers)
    assert all(m is None for m in quantized_linears(dense))
    dense_bytes = sum(
        m.weight.numel() * 4
        for m in dense.runner.model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    )
    assert linear_weight_bytes(quant.runner.model) < dense_bytes / 3  # vs float32 weights
    # Random tiny weights are the worst case for low precision (no structure; errors compound
    # through the layers): the bounds check that the model is the same model, not the targets.
    assert rel_err(prefill_logits(quant, prompt), prefill_logits(dense, prompt)) < bound
    # And it serves: prefill, decode, chunked prefill, through the engine.
    out = greedy_outputs(quant, prompts(model_dir, [17, 5, 45]))
    assert all(len(tokens) == N for tokens in out.values())


def write_fp8_checkpoint(src: Path, dst: Path, layout: str) -> Path:
    """Copies a tiny model, storing every TP linear weight as float8_e4m3fn with weight_scale
    (per tensor, AutoFP8 style, or per channel [out, 1]); a second copy holds the dequantized
    weights in float32 as the reference."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in linear:
            if layout == "tensor":
                scale = t.abs().amax().float() / 448.0
                q = (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                stored_scale = scale.reshape(())
                dq = q.float() * scale
            else:
                q, scale = quantize_fp8_per_channel(t)
                stored_scale = scale[:, None]
                dq = q.float() * scale[:, None]
            quantized[name] = q
            quantized[name[: -len("weight")] + "weight_scale"] = stored_scale
            quantized[name[: -len("weight")] + "input_scale"] = torch.tensor(1.0)  # ignored
            dequantized[name] = dq
        else:
            quantized[name] = t
            dequantized[name] = t
    save_file(quantized, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if layout == "tensor":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": ["lm_head"],
        }
    else:
        config["quantization_config"] = {"quant_method": "fbgemm_fp8"}
    (dst / "config.json").write_text(json.dumps(config))
    ref = dst.parent / (dst.name + "-dequantized")
    shutil.copytree(src, ref)
    save_file(dequantized, str(ref / "model.safetensors"))
    return ref


@pytest.mark.parametrize("layout", ["tensor", "channel"])
def test_prequantized_fp8_checkpoint_loads(tiny_models, tmp_path, layout):
    fp8_dir = tmp_path / f"llama-fp8-{layout}"
    ref_dir = write_fp8_checkpoint(tiny_models["llama"], fp8_dir, layout)
    shard = make_shard(fp8_dir)  # no --quantize: config.json says fp8
    layers = quantized_linears(shard)
    assert layers and all(isinstance(m, Fp8Linear) for m in layers)
    reference = make_shard(ref_dir)
    prompt = prompts(fp8_dir, [30])[0]
    # The CPU path multiplies with exactly the dequantized weights.
    got, want = prefill_logits(shard, prompt), prefill_logits(reference, prompt)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    p = prompts(fp8_dir, [17, 5, 45])
    assert greedy_outputs(shard, p) == greedy_outputs(reference, p)


def test_quantize_rejected_where_the_transformers_backend_has_no_linears(tiny_models):
    # GPT-2's config names no base_model_tp_plan (and its projections are Conv1D): the backend
    # serves it with transformers' own layers, which --quantize cannot reach.
    with pytest.raises(ValueError, match="--quantize: model_type 'gpt2' has no base_model_tp_plan"):
        Shard(ShardConfig(model_id=str(tiny_models["gpt2"]), quantize="fp8"), Dist())
