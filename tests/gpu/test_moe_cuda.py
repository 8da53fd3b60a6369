"""The fused MoE path on CUDA (shard/kernels/fused_moe.py, moe_decode.py, moe_route.py,
shard/layers/moe.py):
the compiled kernels against the per-expert loop (bf16 and fp8 experts, top-k 1 / 2 / 8, decode
and prefill sizes, empty experts), a CUDA-graph capture of the layer (replays equal eager,
padding rows not counted), and the tiny Mixtral / Qwen2-MoE / Qwen3-MoE shards on CUDA (float32:
exact dots) generating the CPU path's greedy tokens from their decode CUDA graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E, H, INTER = 16, 256, 128


def _layer(top_k: int, fp8: bool = False, renormalize: bool = True):
    from shard.distributed.groups import Dist
    from shard.kernels.moe_align import MoeRouting
    from shard.layers.moe import FusedMoE
    from shard.quantization.fp8 import quantize_fp8_per_channel

    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = FusedMoE(E, H, INTER, MoeRouting(top_k, renormalize), Dist())
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=gen) * 0.05).bfloat16()
    if fp8:
        q13, s13 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w13)))
        q2, s2 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w2)))
        moe.w13.data, moe.w2.data, moe.scale13, moe.scale2 = q13, q2, s13, s2
    else:
        moe.w13.data, moe.w2.data = w13, w2
    return moe


def _reference(moe, x, logits):
    from shard.kernels.moe_align import per_expert_loop, route
    from shard.quantization.fp8 import dequantize_fp8

    w13, w2 = moe.w13.float(), moe.w2.float()
    if moe.scale13 is not None:
        w13 = torch.stack([dequantize_fp8(q, s, torch.float32) for q, s in zip(moe.w13, moe.scale13)])
        w2 = torch.stack([dequantize_fp8(q, s, torch.float32) for q, s in zip(moe.w2, moe.scale2)])
    w, ids = route(logits, moe.routing)
    return per_expert_loop(x.float(), w13, w2, w, ids)


# (tokens, top_k, fp8): decode sizes (the one-launch layout), a prefill past ALIGN_MAX_SLOTS (the
# torch layout, 64-row tiles), each top-k; a few cases only: every (top_k, dtype) compiles its
# own kernel variants.
@pytest.mark.parametrize(("n", "top_k", "fp8"), [
    (1, 8, False), (64, 8, False), (1500, 8, False), (7, 1, False), (300, 2, False),
    (1, 8, True), (300, 8, True),
])
def test_fused_layer_matches_the_per_expert_loop(n, top_k, fp8):
    moe = _layer(top_k, fp8)
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(n, E, device="cuda", generator=gen).bfloat16()
    got = moe(x, logits)
    want = _reference(moe, x, logits)
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert got.dtype == torch.bfloat16 and err < 2**-6, err


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_kernels_compiled_match_the_loop(fp8):
    """shard/kernels/moe_decode.py compiled: every decode config of the table, with the routing
    inside the gate/up launch and as its own launch (and the other grid order); given ids with experts another rank holds
    (ids >= E) contribute nothing."""
    import dataclasses

    from shard.kernels import moe_decode
    from shard.kernels.moe_align import per_expert_loop

    moe = _layer(8, fp8)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(3, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(3, E, device="cuda", generator=gen).bfloat16()
    want = _reference(moe, x, logits)
    for _, cfg in moe_decode.DECODE_CONFIGS[fp8]:
        for inside in (True, False):
            got = moe_decode.decode_layer(x, logits, moe.w13, moe.w2, moe.routing, moe.scale13,
                                          moe.scale2, dataclasses.replace(
                                              cfg, route_inside=inside, slots_first=inside))
            err = float((got.float() - want).abs().max() / want.abs().max())
            assert err < 2**-6, (cfg, inside, err)
    ids = torch.tensor([[1, E, 5, 5, E + 2, 0, 3, 2]] * 3, device="cuda")
    w = torch.rand(3, 8, device="cuda", generator=gen)
    got = moe_decode.moe_decode(x, moe.w13, moe.w2, 8, moe.scale13, moe.scale2,
                                topk_weights=w, topk_ids=ids)
    keep = ids < E
    ref13, ref2 = moe.w13.float(), moe.w2.float()
    if fp8:
        ref13 = ref13 * moe.scale13[:, :, None]
        ref2 = ref2 * moe.scale2[:, :, None]
    want = per_expert_loop(x.float(), ref13, ref2, w * keep, torch.where(keep, ids, 0))
    assert float((got.float() - want).abs().max() / want.abs().max()) < 2**-6


def _layer_calls(moe, seed: int, calls: int = 12):
    """run(cfg) -> the outputs of `calls` batch-1 decode_layer calls of `moe` under the decode
    config cfg, each with its own random activations and router logits (so its own routing)."""
    from shard.kernels import moe_decode

    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(1, H, device="cuda", generator=gen).bfloat16() for _ in range(calls)]
    lgs = [torch.randn(1, E, device="cuda", generator=gen).bfloat16() for _ in range(calls)]

    def run(cfg):
        return [moe_decode.decode_layer(x, lg, moe.w13, moe.w2, moe.routing, moe.scale13,
                                        moe.scale2, cfg) for x, lg in zip(xs, lgs)]

    return run


def _replayed(run, cfg, replays: int = 3):
    """run(cfg) eagerly (compiles: a capture cannot), then captured in a CUDA graph and replayed
    `replays` times: the captured outputs after the last replay."""
    run(cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run(cfg)
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("fp8", [False, True])
def test_split_down_from_a_cuda_graph_matches_the_fused_sum(fp8):
    """The split down launch (DecodeConfig.down_split: per-slot programs, a ticketed finish; the
    fp8 table's batch-1 entry), compiled, at batch 1 from a CUDA graph of 12 layer calls with
    different routings, replayed 3 times (its tickets must be back at zero for each replay),
    equals the fused-sum down launch's eager results; K in tiles and the whole slice in one."""
    import dataclasses

    from shard.kernels import moe_decode

    run = _layer_calls(_layer(8, fp8), seed=5)
    fused = dataclasses.replace(moe_decode.DECODE_CONFIGS[fp8][-1][1], down_split=0)
    want = [w.float() for w in run(fused)]
    table = moe_decode.decode_config_for(8, fp8)
    assert table is not None and bool(table.down_split) == fp8
    for opts in ({"down_split": 16, "down_block_k": 64, "down_stages": 3},
                 {"down_split": 32, "down_block_k": 1024, "down_stages": 1}):
        outs = _replayed(run, dataclasses.replace(table, **opts))
        for got, w in zip(outs, want, strict=True):
            err = float((got.float() - w).abs().max() / w.abs().max())
            assert err < 2**-6, (opts, err)
        assert moe_decode._SPLIT_TICKETS.all_zero(torch.device("cuda", 0))


@pytest.mark.parametrize("fp8", [False, True])
def test_early_ids_and_route_trigger_from_a_cuda_graph_match_the_plain_launches(fp8):
    """The fused-sum down launch with its ids loaded before the PDL wait (down_early_ids: a
    guess, checked after the wait) and the routing launch letting gate/up launch as it starts
    (route_trigger), alone and together (then down's guess is often stale: its programs can be
    placed before the routing completes), the routing launch as a programmatic dependent
    (route_dependent), gate/up letting down launch only after its wait (up_late_trigger), the
    routing's sorted top-k (route_sorted), compiled, from a CUDA graph of 12 layer calls with
    different routings replayed 3 times, equal the plain launches' eager results bit for bit."""
    import dataclasses

    from shard.kernels import moe_decode

    run = _layer_calls(_layer(8, fp8), seed=9)
    plain = dataclasses.replace(moe_decode.DECODE_CONFIGS[fp8][-1][1], down_split=0,
                                down_early_ids=False, route_trigger=False, route_dependent=False,
                                up_late_trigger=False, route_sorted=False)
    want = run(plain)
    for opts in ({"down_early_ids": True}, {"route_trigger": True},
                 {"down_early_ids": True, "route_trigger": True},
                 {"route_dependent": True}, {"route_dependent": True, "route_trigger": True},
                 {"route_trigger": True, "up_late_trigger": True, "down_early_ids": True},
                 {"route_sorted": True}):
        outs = _replayed(run, dataclasses.replace(plain, **opts))
        for got, w in zip(outs, want, strict=True):
            assert torch.equal(got, w), opts


@pytest.mark.parametrize("fp8", [False, True])
def test_gate_up_stream_from_a_cuda_graph_matches_the_gridded_launch(fp8):
    """The persistent gate/up launch (DecodeConfig.up_stream: benchmarks/moe_b1_bench.py's
    old:up-stream variants, and 64-wide K tiles: several an item, the stream crossing items),
    compiled, from a CUDA graph of layer calls at batch 1 and 3 (one with ids another rank
    holds), replayed twice, equals the gridded gate/up launch's eager results and counts the
    same routing statistics."""
    import dataclasses

    from benchmarks.moe_b1_bench import up_stream_configs
    from shard.kernels import moe_decode

    moe = _layer(8, fp8)
    gen = torch.Generator(device="cuda").manual_seed(7)
    calls = []
    for n in (1, 3, 3):
        x = torch.randn(n, H, device="cuda", generator=gen).bfloat16()
        w, ids = torch.rand(n, 8, device="cuda", generator=gen), torch.randperm(E)[:8]
        calls.append((x, w, ids.repeat(n, 1).cuda()))
    calls[-1][2][1:, ::3] = E + 1  # another rank's experts: dropped, not counted
    gridded = moe_decode.decode_config_for(8, fp8)
    assert gridded is not None and not gridded.up_stream

    def run(cfg, counts):
        return [moe_decode.moe_decode(x, moe.w13, moe.w2, 8, moe.scale13, moe.scale2, cfg,
                                      topk_weights=w, topk_ids=ids, count_into=counts)
                for x, w, ids in calls]

    want_counts = torch.zeros(E, dtype=torch.int64, device="cuda")
    want = run(gridded, want_counts)
    streams = [cfg for _, cfg in up_stream_configs(8, fp8)]
    streams.append(dataclasses.replace(streams[0], up_block_k=64, up_stream=1))
    for cfg in streams:
        counts = torch.zeros(E, dtype=torch.int64, device="cuda")
        run(cfg, counts)  # compiles (a capture cannot)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = run(cfg, counts)
        counts.zero_()
        for _ in range(2):
            g.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs, want, strict=True):
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
            assert err < 2**-6, (cfg.name(), err)
        assert torch.equal(counts, 2 * want_counts), cfg.name()


def test_empty_experts_on_cuda():
    moe = _layer(2)
    x = torch.randn(9, H, device="cuda").bfloat16()
    logits = torch.full((9, E), -10.0, device="cuda")
    logits[:, 3], logits[:, 11] = 5.0, 4.0  # every token on experts 3 and 11
    logits = logits.bfloat16()
    want = _reference(moe, x, logits)
    assert float((moe(x, logits).float() - want).abs().max() / want.abs().max()) < 2**-6


def test_layer_replays_from_a_cuda_graph_and_counts_real_rows():
    from shard.layers.moe import RoutingStats

    moe = _layer(8)
    stats = RoutingStats(1, E, torch.device("cuda"))
    moe.attach_stats(stats, 0)
    x = torch.randn(4, H, device="cuda").bfloat16()
    logits = torch.randn(4, E, device="cuda").bfloat16()
    valid = torch.tensor([1, 1, 1, 0], device="cuda")  # the last row: graph padding
    stats.begin_step(valid)
    eager = moe(x, logits)
    stats.take()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stats.begin_step(valid)
        out = moe(x, logits)
    stats.take()  # capture does not run the kernels, but be sure
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert sum(stats.take()[0]) == 3 * 3 * 8


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from tests.helpers.hf_models import hf_model

    return {a: hf_model(tmp_path_factory, a) for a in ("mixtral", "qwen2_moe", "qwen3_moe")}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_moe_models_on_cuda_match_cpu_with_graphs(moe_models, arch):
    """The shard as served (warm-up, then decode from its CUDA graphs) generates the CPU path's
    greedy tokens up to the first near-tie (float32: the MoE kernel's dots are exact fp32, the
    attention kernels' run as TF32; a GPU run saw Mixtral's tiny model flip a near-tie at step 9)."""
    from shard.testing.tiny import greedy_tokens
    from tests.helpers.moe import moe_shard
    from tests.helpers.numerics import agree_until_near_tie

    margins: list[list[float]] = []
    want = greedy_tokens(moe_shard(moe_models[arch]), 12, margins)
    gpu = moe_shard(moe_models[arch], device="cuda")
    assert gpu.info.model_impl == "native" and gpu.runner.graphs is not None
    agree_until_near_tie(greedy_tokens(gpu, 12), want, margins)
    assert gpu.runner.last_path == "decode_graph"


@pytest.mark.parametrize("route", [True, False], ids=["route", "logits-only"])
@pytest.mark.parametrize("n", [1, 3])
def test_fused_add_norm_router_compiled_matches_the_three_launches(n, route):
    """shard/kernels/moe_router.py compiled, Qwen3-30B-A3B's router shape in bf16: the residual
    sum equals elementwise.add_rms_norm's bit for bit and the norm to a bf16 step, the logits equal the router
    matmul of the normed row to bf16 rounding, the routing equals moe_route's on those logits
    exactly; replayed from a CUDA graph (the per-token tickets reset themselves) it gives the
    same again. Without the routing (ROUTE False, add_rms_norm_logits, what ROUTER_NORM runs):
    the same normed row, sum and logits as the routing launch bit for bit (the same arithmetic
    up to the logits store), and the same again from a graph."""
    import functools

    from shard.kernels import elementwise, moe_route, moe_router
    from shard.kernels.moe_align import MoeRouting

    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden, experts = 2048, 128
    d = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16()
    x = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16()
    nw = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    rw = (torch.randn(experts, hidden, device="cuda", generator=gen) * 0.02).bfloat16()
    routing = MoeRouting(8, True)
    launch = (functools.partial(moe_router.add_rms_norm_route, routing=routing) if route
              else moe_router.add_rms_norm_logits)
    got = launch(d, x, nw, 1e-6, rw)
    h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
    assert torch.equal(got.residual, s)
    # the same arithmetic; the row's sum of squares may reduce in another order: one bf16 step
    torch.testing.assert_close(got.normed, h, rtol=2**-7, atol=1e-6)
    want = (h.float() @ rw.float().T)
    assert float((got.logits.float() - want).abs().max()) <= 2**-7 * float(want.abs().max())
    if isinstance(got, moe_router.NormedRouting):
        w, ids = moe_route.route(got.logits, routing)
        assert torch.equal(got.ids, ids)
        torch.testing.assert_close(got.weights, w, rtol=1e-6, atol=1e-7)
    else:
        routed = moe_router.add_rms_norm_route(d, x, nw, 1e-6, rw, routing)
        assert torch.equal(got.normed, routed.normed) and torch.equal(got.logits, routed.logits)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        again = launch(d, x, nw, 1e-6, rw)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(again.logits, got.logits) and torch.equal(again.normed, got.normed)
    if isinstance(got, moe_router.NormedRouting):
        assert torch.equal(again.ids, got.ids) and torch.equal(again.weights, got.weights)
        assert moe_router._TICKETS.all_zero(d.device)


@pytest.mark.parametrize("route", [True, False], ids=["fused-router", "router-norm"])
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_tiny_moe_models_same_tokens_with_and_without_the_fused_router(moe_models, arch, route):
    """The decode graphs with the fused add + norm + router launch (with the routing,
    fused_router(True), opt-in; without it, ROUTER_NORM, the default) and with the three
    launches (ROUTER_NORM off) generate the same greedy tokens (float32 models) up to the first
    near-tie (the router's dot products sum in another order)."""
    from shard.layers.moe import ROUTER_NORM, fused_router
    from shard.testing.tiny import greedy_tokens
    from tests.helpers.moe import moe_shard
    from tests.helpers.numerics import agree_until_near_tie

    margins: list[list[float]] = []
    with ROUTER_NORM.override(False):
        want = greedy_tokens(moe_shard(moe_models[arch], device="cuda"), 12, margins)
    with fused_router(True) if route else ROUTER_NORM.override(True):
        fused = moe_shard(moe_models[arch], device="cuda")
        agree_until_near_tie(greedy_tokens(fused, 12), want, margins)
    assert fused.runner.last_path == "decode_graph"
    from shard.layers.moe import SparseMoeBlock

    blocks = [m for m in fused.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b._router_warm == {route} for b in blocks)  # the fused launch ran


@pytest.mark.parametrize(("splits", "block_n", "warps"), [(8, 32, 4), (32, 16, 2)])
def test_few_program_decode_tilings_match_the_default_on_cuda(splits, block_n, warps):
    """CudaAttentionBackend.few_program_decode's tilings (what benchmarks/moe_b1_bench.py sweeps
    at batch 1 on Qwen3-30B-A3B's 32 / 4 heads) compiled: the fused rotary + store + attention
    stores the same cache and attends to the default tiling's output within bf16 rounding."""
    from shard.attention.cuda_backend import CudaAttentionBackend, DecodeTiling
    from shard.layers.rotary import RotaryEmbedding
    from shard.testing.paged_batch import random_paged_step

    heads, kv_heads, hd, page, ctx = 32, 4, 128, 16, 300
    q, cache, meta = random_paged_step([1], [ctx], heads, kv_heads, hd, page, device="cuda",
                                       dtype=torch.bfloat16, seed=5)
    meta.slot_mapping[0] = int(meta.block_tables[0, (ctx - 1) // page]) * page + (ctx - 1) % page
    rotary = RotaryEmbedding(hd, 1024, {"rope_theta": 1e6, "rope_type": "default"},
                             torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(6)
    k = torch.randn(1, kv_heads, hd, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, kv_heads, hd, device="cuda", generator=gen).bfloat16()
    pos = torch.tensor([ctx - 1], device="cuda")
    results = []
    for tiling in (None, DecodeTiling(kv_heads, splits, block_n, warps)):
        backend = CudaAttentionBackend("cuda")
        backend.few_program_decode = tiling
        kc, vc = cache[0].clone(), cache[1].clone()
        out = backend.rotate_write_and_attend_decode(rotary, pos, q, k, v, kc, vc, meta,
                                                     hd**-0.5, None)
        results.append((out.float(), kc, vc))
    (o1, k1, v1), (o2, k2, v2) = results
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert float((o1 - o2).abs().max()) <= 2**-6 * float(o1.abs().max())


def test_tiny_qwen3_moe_same_tokens_with_the_norm_prologue(moe_models, monkeypatch):
    """The opt-in norm prologue (the input add + RMSNorm inside the qkv GEMV's launch,
    shard/kernels/norm_gemv.py) runs in the decode graphs and generates the greedy tokens of the
    default path up to the first near-tie."""
    from shard.kernels import norm_gemv
    from shard.layers.linear import norm_prologue
    from shard.testing.tiny import greedy_tokens
    from tests.helpers.moe import moe_shard
    from tests.helpers.numerics import agree_until_near_tie

    margins: list[list[float]] = []
    want = greedy_tokens(moe_shard(moe_models["qwen3_moe"], device="cuda"), 12, margins)
    calls = []
    launch = norm_gemv.add_rms_norm_linear
    monkeypatch.setattr(norm_gemv, "add_rms_norm_linear",
                        lambda *a, **k: calls.append(1) or launch(*a, **k))
    with norm_prologue(True):
        shard = moe_shard(moe_models["qwen3_moe"], device="cuda")
        agree_until_near_tie(greedy_tokens(shard, 12), want, margins)
    assert calls and shard.runner.last_path == "decode_graph"


@pytest.mark.parametrize("fp8", [False, True])
def test_norm_prologue_gemv_compiled_matches_norm_then_linear(fp8):
    """shard/kernels/norm_gemv.py compiled at Qwen3-30B-A3B's q/k/v shape (5,120 x 2,048), bf16
    and e4m3 with per-row scales: the residual equals elementwise.add_rms_norm's bit for bit,
    the outputs the matmul of its normalized row to bf16 rounding."""
    from shard.kernels import elementwise, norm_gemv
    from shard.quantization.fp8 import dequantize_fp8, quantize_fp8_per_channel

    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden, rows = 2048, 5120
    d = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
    x = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
    nw = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    w = torch.randn(rows, hidden, device="cuda", generator=gen) * 0.02
    scale = None
    if fp8:
        w, scale = quantize_fp8_per_channel(w)
        ref_w = dequantize_fp8(w, scale, torch.float32)
    else:
        w = w.bfloat16()
        ref_w = w.float()
    y, res = norm_gemv.add_rms_norm_linear(d, x, nw, 1e-6, w, scale=scale)
    h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
    assert torch.equal(res, s)
    want = h.float() @ ref_w.T
    assert float((y.float() - want).abs().max()) <= 2**-7 * float(want.abs().max()) + 1e-3


@pytest.mark.parametrize("fp8", [False, True])
def test_stamped_expert_launches_from_a_cuda_graph_equal_the_plain_ones(fp8):
    """The routing, gate/up and down launches captured under shard.kernels.stamps.recording
    (moe_b1_bench --stamps): the same outputs bit for bit; one recorded launch per kernel and
    layer call, in launch order; every program's stamps rise in point order (those it passed)."""
    from shard.kernels import moe_decode, stamps

    run = _layer_calls(_layer(8, fp8), seed=11, calls=4)
    table = moe_decode.decode_config_for(8, fp8)
    want = run(table)
    recorder = stamps.StampRecorder(1 << 16, torch.device("cuda"))
    with stamps.recording(recorder):
        outs = _replayed(run, table)
    for got, w in zip(outs, want, strict=True):
        assert torch.equal(got, w)
    down = "down split" if table.down_split else "down+sum"
    assert [launch.kernel for launch in recorder.launches] == ["route", "gate/up", down] * 4
    for launch in recorder.launches:
        rows = recorder.rows(launch)[:, :len(launch.points)].cpu()
        assert bool((rows[:, :2] > 0).all()), launch.kernel  # start, after the wait: all
        # A point a program passes only sometimes (the split down's "merged": the last program
        # of its row block) keeps an earlier replay's stamp when not passed: older than the
        # program's start (point 0) this replay, as benchmarks/harness/stamps.py reads it.
        passed = rows >= rows[:, :1]
        later = rows[:, 1:][passed[:, 1:] & passed[:, :-1]]
        earlier = rows[:, :-1][passed[:, 1:] & passed[:, :-1]]
        assert bool((later >= earlier).all()), launch.kernel
