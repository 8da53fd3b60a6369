"""Mixture of experts (shard/layers/moe.py, shard/kernels/moe_align.py, the MoE model files).

- The fused layer's math (block-aligned layout + grouped matmuls, the CPU path that mirrors the
  Triton kernel) equals the per-expert loop on random inputs for top-k 1, 2 and 8 and for
  batches that leave experts empty; each routing option matches its definition; fp8 experts
  equal the loop over their dequantized weights.
- Mixtral, Qwen2-MoE and Qwen3-MoE (tiny random checkpoints, float32) generate what transformers
  does, greedy, on one shard through the engine and on two gloo ranks (one pair of processes for
  all three families); the experts are stacked by the layer's loader (either checkpoint layout)
  and split over the ranks; Qwen's dense layers and norm_topk_prob as config variants.
- Routing statistics count real rows per expert, and the shard hands them to the router every
  window of steps with a step's answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim, engine_call

from service.shard_client.convert import step_output
from shard.distributed.groups import Dist
from shard.kernels.moe_align import (
    MoeRouting,
    align_by_expert,
    grouped_moe_torch,
    max_padded_rows,
    per_expert_loop,
    route,
)
from shard.layers.moe import FusedMoE, RoutingStats
from shard.quantization.fp8 import dequantize_fp8, quantize_fp8_per_channel
from shard.testing.ranks import run_ranks
from shard.testing.tiny import greedy_tokens, tiny_prompts
from tests.helpers.hf_models import hf_model
from tests.helpers.moe import MOE_ARCHS, STEPS, moe_greedy_rank, moe_shard

E, H, INTER = 8, 32, 24
N = 10  # new tokens per request of the engine scenario


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * INTER, H, generator=g) * 0.2,  # w13
            torch.randn(E, H, INTER, generator=g) * 0.2)  # w2


def _fused(x, w13, w2, weights, ids, block_m=4, **scales):
    layout = align_by_expert(ids, w13.shape[0], block_m)
    return grouped_moe_torch(x, w13, w2, weights, layout, ids.shape[1], **scales)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("n", [1, 3, 37])
def test_fused_layer_equals_the_per_expert_loop(top_k, n):
    w13, w2 = _weights()
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(n))
    weights, ids = route(torch.randn(n, E), MoeRouting(top_k, renormalize=True))
    want = per_expert_loop(x, w13, w2, weights, ids)
    for block_m in (1, 4, 16):
        got = _fused(x, w13, w2, weights, ids, block_m)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_empty_experts_and_the_layouts_static_bound():
    w13, w2 = _weights(1)
    n, k = 6, 2
    x = torch.randn(n, H)
    # Every token on experts 2 and 5: the other six are empty.
    ids = torch.tensor([[2, 5]] * n)
    weights = torch.rand(n, k)
    layout = align_by_expert(ids, E, 4)
    assert layout.num_padded.item() == 16  # 6 rows -> 8 each
    assert layout.sorted_ids.numel() == 4 * -(-max_padded_rows(n * k, E, 4) // 4)
    used = layout.block_expert[:4].tolist()
    assert used == [2, 2, 5, 5] and set(layout.block_expert[4:].tolist()) == {E}
    torch.testing.assert_close(_fused(x, w13, w2, weights, ids),
                               per_expert_loop(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # One expert for everyone, and ids of experts outside this rank's range (dropped: zeros).
    ids = torch.full((n, 1), 7)
    torch.testing.assert_close(_fused(x, w13, w2, weights[:, :1], ids),
                               per_expert_loop(x, w13, w2, weights[:, :1], ids))
    ids = torch.tensor([[1, E], [E, E], [3, 4], [E + 3, 0], [1, 1], [6, E]])
    keep = ids < E
    want = per_expert_loop(x, w13, w2, weights * keep, torch.where(keep, ids, 0))
    torch.testing.assert_close(_fused(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


def test_routing_options_follow_their_definitions():
    logits = torch.randn(5, E)
    probs = torch.softmax(logits, -1)
    top, idx = probs.topk(2, -1)
    w, ids = route(logits, MoeRouting(2, renormalize=False))
    assert torch.equal(ids, idx) and torch.allclose(w, top)  # Qwen, norm_topk_prob off
    w, ids = route(logits, MoeRouting(2, renormalize=True))
    assert torch.allclose(w, top / top.sum(-1, keepdim=True))  # Mixtral
    assert torch.allclose(w.sum(-1), torch.ones(5))
    # top-k of the logits, then a softmax over the k: the renormalized form by another road
    w2, ids2 = route(logits, MoeRouting(2, renormalize=False, softmax_first=False))
    assert torch.equal(ids2, ids) and torch.allclose(w2, w)


def test_fp8_experts_equal_the_loop_over_their_dequantized_weights():
    w13, w2 = _weights(2)
    q13, s13 = zip(*(quantize_fp8_per_channel(w) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_fp8_per_channel(w) for w in w2), strict=True)
    q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
    x = torch.randn(9, H)
    weights, ids = route(torch.randn(9, E), MoeRouting(2, renormalize=True))
    got = _fused(x, q13, q2, weights, ids, scale13=s13, scale2=s2)
    deq13 = torch.stack([dequantize_fp8(q, s, torch.float32) for q, s in zip(q13, s13)])
    deq2 = torch.stack([dequantize_fp8(q, s, torch.float32) for q, s in zip(q2, s2)])
    torch.testing.assert_close(got, per_expert_loop(x, deq13, deq2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    # and close to the unquantized layer (e4m3: ~2^-4 relative per weight)
    full = per_expert_loop(x, w13, w2, weights, ids)
    assert (got - full).abs().max() < 0.1 * full.abs().max()


def test_routing_stats_count_real_rows_only():
    stats = RoutingStats(num_layers=2, num_experts=4, device=torch.device("cpu"))
    stats.begin_step(torch.tensor([True, True, False]))  # the third row is graph padding
    stats.record(0, torch.tensor([[0, 1], [1, 3], [2, 2]]))
    stats.record(1, torch.tensor([[3, 3], [3, 3], [0, 0]]))
    assert stats.take() == [[1, 2, 0, 1], [0, 0, 0, 4]]
    assert stats.take() == [[0] * 4, [0] * 4]


def test_tensor_parallel_split_of_an_expert_sums_to_the_whole():
    """Each rank's gate/up rows and down columns give a partial output; the ranks' partials sum
    to the unsplit layer (what the all-reduce does)."""
    w13, w2 = _weights(3)
    x = torch.randn(7, H)
    weights, ids = route(torch.randn(7, E), MoeRouting(2, renormalize=True))
    gate, up = w13.chunk(2, dim=1)
    parts = []
    for r in range(2):
        rows = slice(r * INTER // 2, (r + 1) * INTER // 2)
        part13 = torch.cat([gate[:, rows], up[:, rows]], dim=1)
        parts.append(_fused(x, part13, w2[:, :, rows].contiguous(), weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], per_expert_loop(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


# --- the model families against transformers -------------------------------------------------


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    return {arch: hf_model(tmp_path_factory, arch) for arch in MOE_ARCHS}


def _scenario(shard, p: list[list[int]], responses: list | None = None) -> dict[int, list[int]]:
    """A (17) and B (5) prefill together, decode; C (30) prefills in chunks of 16 while A and B
    decode; everything runs to completion (each step's response appended to `responses`)."""
    inner = engine_call(shard)

    def call(method, request):
        resp = inner(method, request)
        if responses is not None and method in ("Prefill", "Decode"):
            responses.append(resp)
        return resp

    sim = RouterSim(call, shard.runner.num_blocks, shard.runner.block_size)
    for i, prompt in enumerate(p):
        sim.add(i + 1, prompt, N)
    sim.prefill([(1, 0), (2, 0)])
    sim.decode()
    sim.prefill([(3, 16)])
    sim.decode()
    sim.prefill([(3, 0)])
    sim.run_to_completion()
    return {rid: req.generated for rid, req in sim.done.items()}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_transformers_on_one_shard(moe_models, arch):
    model_dir = moe_models[arch]
    shard = moe_shard(model_dir)
    model = shard.runner.model
    assert shard.info.model_impl == "native"
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and experts[0].w13.shape == (4, 2 * experts[0].inter_local, 64)
    p = prompts(model_dir, [17, 5, 30])
    assert sum(model.take_expert_load()) == 0  # warmup's routing was discarded
    shard.engine.expert_load_window = 3
    responses: list = []
    got = _scenario(shard, p, responses)
    hf = load_hf(model_dir)
    for rid in (1, 2, 3):
        assert got[rid] == hf_greedy(hf, p[rid - 1], N), f"{arch} request {rid}"
    # Routing statistics: every third sampling step's response carries its window's counts
    # (through the router's converter), and with what is still counting, every routed
    # (token, layer) pair once per chosen expert: 2 layers, top-2.
    windows = [step_output(r).expert_load for r in responses if r.HasField("expert_load")]
    assert windows and all(len(w) == 4 for w in windows)
    assert all(r.expert_load.steps == 3 for r in responses if r.HasField("expert_load"))
    tokens = sum(len(x) for x in p) + 3 * N - 3
    assert sum(map(sum, windows)) + sum(model.take_expert_load()) == tokens * 2 * 2


@pytest.mark.timeout(600)
def test_two_ranks_match_transformers(moe_models):
    """All three families split over two gloo ranks (one pair of processes): same greedy tokens
    as transformers, each rank holding half of every expert's intermediate features."""
    dirs = {a: str(moe_models[a]) for a in MOE_ARCHS}
    res = run_ranks(2, {"device": "cpu", "dirs": dirs}, moe_greedy_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    for arch in MOE_ARCHS:
        hf = load_hf(moe_models[arch])
        want = [hf_greedy(hf, q, STEPS) for q in tiny_prompts(hf.config.vocab_size)]
        assert res["tokens"][arch] == want, arch
        assert res["inter_local"][arch] == hf.config.to_dict().get(
            "moe_intermediate_size", hf.config.intermediate_size) // 2, arch


def test_fp8_experts_through_the_model(moe_models):
    """--quantize fp8 stores every expert in e4m3 with per-expert, per-channel scales and the
    model still generates (CPU: the same layout through the torch path)."""
    shard = moe_shard(moe_models["mixtral"], quantize="fp8")
    experts = [m for m in shard.runner.model.modules() if isinstance(m, FusedMoE)]
    assert all(m.w13.dtype == torch.float8_e4m3fn and m.scale13.shape == (4, 256)
               and m.scale2.shape == (4, 64) for m in experts)
    got = _scenario(shard, prompts(moe_models["mixtral"], [17, 5, 30]))
    assert all(len(t) == N for t in got.values())


def test_tp_loader_reads_only_this_ranks_rows(moe_models, tmp_path):
    """Rank 1 of 2 holds rows [I/2, I) of each expert's gate/up and those columns of down, from
    the hub's one-tensor-per-expert layout and from transformers 5's stacked one alike."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shard.layers.weights import Weights

    d, p, rank1 = moe_models["qwen2_moe"], "model.layers.1.mlp.experts", Dist(1, 2)
    moe = FusedMoE(4, 64, 32, MoeRouting(2, False), rank1)
    moe.load(Weights(d, torch.device("cpu"), torch.float32, rank1), p)
    f = safe_open(str(d / "model.safetensors"), "pt")

    def t(e: int, name: str) -> torch.Tensor:
        return f.get_tensor(f"{p}.{e}.{name}.weight")

    assert torch.equal(moe.w13[3], torch.cat([t(3, "gate_proj")[16:], t(3, "up_proj")[16:]]))
    assert torch.equal(moe.w2[3], t(3, "down_proj")[:, 16:])
    stacked = {  # [E, 2I, H] (gate rows, then up rows) and [E, H, I]
        f"{p}.gate_up_proj": torch.stack(
            [torch.cat([t(e, "gate_proj"), t(e, "up_proj")]) for e in range(4)]),
        f"{p}.down_proj": torch.stack([t(e, "down_proj") for e in range(4)]),
    }
    (tmp_path / "stacked").mkdir()
    save_file(stacked, str(tmp_path / "stacked" / "model.safetensors"))
    again = FusedMoE(4, 64, 32, MoeRouting(2, False), rank1)
    again.load(Weights(tmp_path / "stacked", torch.device("cpu"), torch.float32, rank1), p)
    assert torch.equal(again.w13, moe.w13) and torch.equal(again.w2, moe.w2)


@pytest.mark.parametrize(("arch", "variant"), [
    ("qwen2_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}),  # layer 0 dense
    ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": True}),  # layer 1 dense
])
def test_config_variants_dense_layers_and_renormalized_qwen(tmp_path, arch, variant):
    """Qwen's dense layers (decoder_sparse_step, mlp_only_layers) and norm_topk_prob (as the
    released Qwen3-MoE checkpoints set it) generate what transformers does."""
    from shard.tools.tiny_any import write_tiny_any

    model_dir = write_tiny_any(tmp_path / arch, arch, **variant)
    shard = moe_shard(model_dir)
    assert len([m for m in shard.runner.model.modules() if isinstance(m, FusedMoE)]) == 1
    hf = load_hf(model_dir)
    want = [hf_greedy(hf, q, STEPS) for q in tiny_prompts(hf.config.vocab_size)]
    assert greedy_tokens(shard, STEPS) == want
