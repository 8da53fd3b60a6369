"""shard/kernels/fused_moe.py's grouped-GEMM kernel and shard/kernels/moe_route.py's routing and
layout kernels under Triton's interpreter on CPU tensors (no GPU). The GEMM: both launches (gate/up with the SiLU-and-mul epilogue, down with the routing weight)
against the per-expert loop, for top-k 1, 2 and 8, a batch that leaves experts empty, ids of
experts the rank does not hold, fp8 weights with per-expert, per-channel scales, and each row
block size of the config table. One fresh interpreter process (Triton reads TRITON_INTERPRET
when a kernel is defined); the GPU benchmark (benchmarks/moe_bench.py) runs the compiled kernel.
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import BF16_DOT_PRELUDE, INTERPRETER_MARKS, run_interpreted

_CHECK = BF16_DOT_PRELUDE + textwrap.dedent(
    """
    from shard.kernels.fused_moe import CONFIGS, MoeConfig, fused_moe
    from shard.kernels.moe_align import MoeRouting, per_expert_loop, route
    from shard.quantization.fp8 import dequantize_fp8, quantize_fp8_per_channel

    torch.manual_seed(0)
    E, H, I = 8, 48, 40  # K tails (48 % 32, 40 % 32) and N tails (40 % 16)
    w13 = torch.randn(E, 2 * I, H) * 0.2
    w2 = torch.randn(E, H, I) * 0.2
    small = MoeConfig(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)

    def check(x, ids, weights, cfg, a13=w13, a2=w2, tol=1e-5, **scales):
        got = fused_moe(x, a13, a2, weights, ids, config=cfg, **scales)
        r13 = a13.float() if not scales else torch.stack(
            [dequantize_fp8(q, s, torch.float32) for q, s in zip(a13, scales["scale13"])])
        r2 = a2.float() if not scales else torch.stack(
            [dequantize_fp8(q, s, torch.float32) for q, s in zip(a2, scales["scale2"])])
        keep = ids < E
        want = per_expert_loop(x.float(), r13, r2, weights * keep, torch.where(keep, ids, 0))
        assert got.shape == x.shape and got.dtype == x.dtype
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err <= tol, (tuple(ids.shape), str(cfg), err)

    for n, k in ((1, 1), (5, 2), (3, 8)):
        x = torch.randn(n, H)
        weights, ids = route(torch.randn(n, E), MoeRouting(k, renormalize=True))
        check(x, ids, weights, small)
    # empty experts: everything on experts 1 and 6; and ids of experts another rank holds
    x = torch.randn(6, H)
    check(x, torch.tensor([[1, 6]] * 6), torch.rand(6, 2), small)
    check(x, torch.tensor([[1, E], [E, E], [3, 4], [E + 2, 0], [5, 5], [6, E]]), torch.rand(6, 2),
          small)
    # the table's row blocks (16, 32, 64 rows), smaller column / K tiles to keep this quick
    x = torch.randn(9, H)
    weights, ids = route(torch.randn(9, E), MoeRouting(2, renormalize=False))
    for bm in sorted({cfg.block_m for _, cfg in CONFIGS}):
        check(x, ids, weights, MoeConfig(bm, 16, 32, 1, 1))
    # bf16 activations and weights (fp32 accumulation; the interpreter truncates each of the
    # epilogue's roundings to bf16 instead of rounding to nearest: a looser bound)
    check(x.bfloat16(), ids, weights, small, w13.bfloat16(), w2.bfloat16(), tol=2**-5)
    # fp8 weights: per expert and output channel scales, converted in registers
    q13, s13 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w13)))
    q2, s2 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w2)))
    check(x, ids, weights, small, q13, q2, scale13=s13, scale2=s2)
    check(x.bfloat16(), ids, weights, small, q13, q2, tol=2**-5, scale13=s13, scale2=s2)
    """
)

# The routing launch's sorted top-k (route(..., sort=True), DecodeConfig.route_sorted) against
# its max / argmax loop: the same ids in the same order and the same weights, bit for bit, for
# softmax before / after top-k, renormalized or not, 6 and 60 experts (padded to 8 and 64),
# top-k 1, 2, 6 and 8, logits with ties (repeated values: the lowest index first), negative
# zeros beside zeros, and -inf.
_SORTED_TOPK_CHECK = textwrap.dedent(
    """
    import torch
    from shard.kernels import moe_route
    from shard.kernels.moe_align import MoeRouting

    torch.manual_seed(1)
    for E, n, k in ((6, 3, 1), (6, 3, 2), (60, 4, 6), (128, 3, 8), (60, 2, 8)):
        logits = torch.randn(n, E)
        logits[0, : E // 2] = logits[0, E // 2 : 2 * (E // 2)]  # every value twice
        logits[1] = torch.round(logits[1])  # many ties, zeros among them
        logits[1, 1] = -0.0
        logits[-1] = 0.0  # all tied, a negative zero first: the loop takes index 0 first
        logits[-1, 0] = -0.0
        logits[-1, -1] = float("-inf")
        for r in (MoeRouting(k, True), MoeRouting(k, False), MoeRouting(k, False, False)):
            w, i = moe_route.route(logits, r)
            ws, is_ = moe_route.route(logits, r, sort=True)
            assert torch.equal(i, is_), (E, n, k, r, i, is_)
            assert torch.equal(w, ws), (E, n, k, r)
    """
)

# shard/kernels/moe_route.py: routing and the one-program layout equal the torch forms exactly
# (ids, weights, every row of the layout, the statistics of real rows), over several chunks of
# slots and with dropped ids; then FusedMoE's CUDA path (route, align with statistics, the two
# GEMMs) run on CPU tensors equals its CPU path.
_ROUTE_CHECK = textwrap.dedent(
    """
    import torch
    from shard.distributed.groups import Dist
    from shard.kernels import moe_route
    from shard.kernels.moe_align import MoeRouting, align_by_expert, route
    from shard.layers.moe import FusedMoE, RoutingStats

    torch.manual_seed(0)
    for E, n, k in ((8, 5, 2), (16, 20, 8), (128, 2, 8)):
        logits = torch.randn(n, E)
        for r in (MoeRouting(k, True), MoeRouting(k, False), MoeRouting(k, False, False)):
            w, i = moe_route.route(logits, r)
            w0, i0 = route(logits, r)
            assert torch.equal(i.long(), i0) and torch.allclose(w, w0, atol=1e-6), (E, n, k, r)
        ids = i0.clone()
        ids[-1, 0] = E  # another rank's expert: dropped
        valid = torch.ones(n, dtype=torch.int64)
        valid[0] = 0  # a CUDA-graph padding row: not counted
        for bm in (1, 16):
            got, want = moe_route.align(ids.int(), E, bm), align_by_expert(ids, E, bm)
            for f in ("sorted_ids", "block_expert", "num_padded"):
                assert torch.equal(getattr(got, f), getattr(want, f)), (E, n, k, bm, f)
            counts = torch.zeros(E, dtype=torch.int64)
            moe_route.align(ids.int(), E, bm, counts, valid)
            real = ids[1:][ids[1:] < E]
            assert torch.equal(counts, torch.bincount(real, minlength=E)), (E, n, k, bm)

    E, H, I = 8, 32, 24
    moe = FusedMoE(E, H, I, MoeRouting(2, True), Dist())
    moe.w13.data = torch.randn(E, 2 * I, H) * 0.2
    moe.w2.data = torch.randn(E, H, I) * 0.2
    x, logits = torch.randn(6, H), torch.randn(6, E)
    stats = RoutingStats(1, E, torch.device("cpu"))
    moe.attach_stats(stats, 0)
    moe._warm = True  # compiling every tiling is a GPU concern (tests/gpu/test_moe_cuda.py)
    stats.begin_step(torch.tensor([1, 1, 1, 1, 1, 0]))
    fused = moe._forward_cuda(x, logits)
    through_triton = stats.take()
    stats.begin_step(torch.tensor([1, 1, 1, 1, 1, 0]))
    torch.testing.assert_close(fused, moe.forward(x, logits), rtol=1e-5, atol=1e-5)
    assert through_triton == stats.take() and sum(through_triton[0]) == 5 * 2
    """
)

# shard/kernels/moe_decode.py: the decode launches (gate/up per slot, down with the weighted sum
# over the k slots fused) against the per-expert loop: given routing for top-k 1, 2 and 8, ids of
# experts another rank holds, a batch that leaves experts empty, routing computed inside the
# gate/up launch (weights, ids and the statistics of real rows equal moe_route's), fp8 weights
# (1-byte loads, per-expert per-channel scales) with fp32 and bf16 activations, the split down
# launch, the persistent gate/up launch; then FusedMoE's CUDA path at a decode-sized batch (which
# takes these kernels) equals its CPU path.
_DECODE_CHECK = textwrap.dedent(
    """
    import dataclasses
    import torch
    from shard.distributed.groups import Dist
    from shard.kernels import moe_decode
    from shard.kernels.moe_align import MoeRouting, per_expert_loop, route
    from shard.layers.moe import FusedMoE, RoutingStats
    from shard.quantization.fp8 import dequantize_fp8, quantize_fp8_per_channel

    torch.manual_seed(0)
    E, H, I = 8, 48, 40  # K tails (48 % 32, 40 % 16) and N tails (40 % 4, 48 % 32)
    w13 = torch.randn(E, 2 * I, H) * 0.2
    w2 = torch.randn(E, H, I) * 0.2
    cfg = moe_decode.DecodeConfig(8, 32, 1, 32, 16, 1, 1)

    def check(got, x, ids, weights, a13=w13, a2=w2, tol=1e-5):
        keep = ids < E
        want = per_expert_loop(x.float(), a13.float(), a2.float(), weights * keep,
                               torch.where(keep, ids, 0))
        assert got.shape == x.shape and got.dtype == x.dtype
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err <= tol, (tuple(ids.shape), err)

    for n, k in ((1, 1), (3, 2), (2, 8)):
        x = torch.randn(n, H)
        logits = torch.randn(n, E)
        r = MoeRouting(k, renormalize=k > 1, softmax_first=k != 2)
        weights, ids = route(logits, r)
        check(moe_decode.moe_decode(x, w13, w2, k, config=cfg, topk_weights=weights,
                                    topk_ids=ids), x, ids, weights)
        counts = torch.zeros(E, dtype=torch.int64)
        valid = torch.ones(n, dtype=torch.int64)
        valid[-1] = 0  # a CUDA-graph padding row: routed, not counted
        got = moe_decode.moe_decode(x, w13, w2, k, config=cfg, logits=logits, routing=r,
                                    count_into=counts, valid=valid)
        check(got, x, ids, weights)
        assert torch.equal(counts, torch.bincount(ids[:-1].reshape(-1), minlength=E)), counts
    # experts another rank holds (ids >= E: neither computed nor counted) and empty experts
    x = torch.randn(4, H)
    ids = torch.tensor([[1, E], [E, E], [6, 6], [E + 3, 1]])
    weights = torch.rand(4, 2)
    counts = torch.zeros(E, dtype=torch.int64)
    check(moe_decode.moe_decode(x, w13, w2, 2, config=cfg, topk_weights=weights, topk_ids=ids,
                                count_into=counts), x, ids, weights)
    assert counts.tolist() == [0, 2, 0, 0, 0, 0, 2, 0], counts
    # the routing as its own launch (route_inside=False), as the layer runs it; the other grid
    # order
    x, logits, r = torch.randn(2, H), torch.randn(2, E), MoeRouting(8, True)
    weights, ids = route(logits, r)
    sep = dataclasses.replace(cfg, route_inside=False, slots_first=False)
    check(moe_decode.decode_layer(x, logits, w13, w2, r, None, None, sep), x, ids, weights)
    # fp8 weights, fp32 and bf16 activations
    q13, s13 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w13)))
    q2, s2 = map(torch.stack, zip(*(quantize_fp8_per_channel(w) for w in w2)))
    r13 = torch.stack([dequantize_fp8(q, s, torch.float32) for q, s in zip(q13, s13)])
    r2 = torch.stack([dequantize_fp8(q, s, torch.float32) for q, s in zip(q2, s2)])
    x = torch.randn(2, H)
    weights, ids = route(torch.randn(2, E), MoeRouting(8, True))
    for xx, tol in ((x, 1e-5), (x.bfloat16(), 2**-5)):
        got = moe_decode.moe_decode(xx, q13, q2, 8, s13, s2, cfg, topk_weights=weights,
                                    topk_ids=ids)
        check(got, xx, ids, weights, r13, r2, tol=tol)

    # the split down launch (down_split: one program per (slot, row block), fp32 partials, the
    # last program of a row block sums them by an acq_rel ticket; the fp8 table's batch-1
    # entry): the whole K in one tile (64 >= I) and K tiles with a tail (16 + 16 + 8), row
    # blocks with a tail (48 % 32), dropped slots (slot 0 included: the tile before the wait
    # reads nothing); equal to the fused-sum launch; the tickets back at zero after each launch
    whole = dataclasses.replace(cfg, down_split=32, down_block_k=64)
    tiled = dataclasses.replace(cfg, down_split=16, down_block_k=16, down_stages=2)
    assert "-split32" in whole.name() and "-dst2" in tiled.name()
    assert moe_decode.decode_config_for(8, fp8=True).down_split
    assert not moe_decode.decode_config_for(8, fp8=False).down_split
    for n, k in ((1, 1), (3, 2), (2, 8)):
        x = torch.randn(n, H)
        weights, ids = route(torch.randn(n, E), MoeRouting(k, renormalize=k > 1))
        if k == 2:
            ids[1, 1] = E
            ids[2, 0] = E + 1
        ref = moe_decode.moe_decode(x, w13, w2, k, config=cfg, topk_weights=weights,
                                    topk_ids=ids)
        for c in (whole, tiled) if k == 2 else (whole,):  # K tiles: with the dropped slots
            got = moe_decode.moe_decode(x, w13, w2, k, config=c, topk_weights=weights,
                                        topk_ids=ids)
            check(got, x, ids, weights)
            assert moe_decode._SPLIT_TICKETS.all_zero(x.device), "tickets not reset"
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        # fp8, as the table uses it (bf16 activations at top-8, the served case)
        fp8_cases = {1: (), 2: ((x, 1e-5),), 8: ((x, 1e-5), (x.bfloat16(), 2**-5))}[k]
        for xx, tol in fp8_cases:
            got = moe_decode.moe_decode(xx, q13, q2, k, s13, s2, whole, topk_weights=weights,
                                        topk_ids=ids)
            check(got, xx, ids, weights, r13, r2, tol=tol)

    # the fused-sum down launch with the slots' ids loaded before its wait (down_early_ids, a
    # guess checked after it) and the routing launch letting gate/up launch early
    # (route_trigger) and waiting for the router GEMV as a programmatic dependent
    # (route_dependent): the same sums bit for bit as without, dropped slots included (here the
    # guess is never stale: the GPU test covers a stale one)
    plain = dataclasses.replace(cfg, route_inside=False)
    early = dataclasses.replace(plain, down_early_ids=True, route_trigger=True,
                                route_dependent=True, up_late_trigger=True)
    assert early.name().endswith("-route-trigger-route-dependent-up-late-trigger-down-early-ids")
    for n, k in ((1, 8), (3, 2)):
        x, logits = torch.randn(n, H), torch.randn(n, E)
        r = MoeRouting(k, renormalize=True)
        want = moe_decode.decode_layer(x, logits, w13, w2, r, None, None, plain)
        assert torch.equal(moe_decode.decode_layer(x, logits, w13, w2, r, None, None, early), want)
        weights, ids = route(logits, r)
        ids[0, 0] = E + 2  # another rank's expert
        got = moe_decode.moe_decode(x, w13, w2, k, config=early, topk_weights=weights,
                                    topk_ids=ids)
        check(got, x, ids, weights)
        assert torch.equal(got, moe_decode.moe_decode(x, w13, w2, k, config=plain,
                                                      topk_weights=weights, topk_ids=ids))

    # the persistent gate/up launch (up_stream: m programs per SM, 3 "SMs" on CPU; items (held
    # slot, row tile) strided over the programs, each program's K tiles one flattened loop):
    # equal to the gridded launch bit for bit (the same K order per row) and to the loop. Row
    # tiles of 32 columns (I = 40: 2 tiles, the second a tail), K tiles of 32 (H = 48: a tail);
    # items not divisible by the programs (top-8: 16 on 3; top-2 with a slot dropped: 10 on 6 and
    # on 3), a program left without items (5 of 6 slots dropped: 2 items on 3), every slot
    # dropped, both item orders, the statistics of real rows, fp8 weights with fp32 and bf16
    # activations.
    grid = dataclasses.replace(cfg, up_block_n=64, route_inside=False)
    stream = dataclasses.replace(grid, up_stream=1)
    assert "-upstream1" in stream.name()

    def same_as_grid(x, ids, weights, c, a13=w13, a2=w2, s13=None, s2=None, valid=None):
        counts = [torch.zeros(E, dtype=torch.int64) for _ in range(2)]
        outs = [moe_decode.moe_decode(x, a13, a2, ids.shape[1], s13, s2, g, topk_weights=weights,
                                      topk_ids=ids, count_into=n, valid=valid)
                for g, n in ((grid, counts[0]), (c, counts[1]))]
        assert torch.equal(outs[1], outs[0]) and torch.equal(counts[1], counts[0]), c.name()
        real = ids if valid is None else ids[valid.bool()]
        assert torch.equal(counts[1], torch.bincount(real[real < E], minlength=E)), counts
        return outs[1]

    for n, k in ((1, 1), (1, 8), (3, 2)):
        x = torch.randn(n, H)
        weights, ids = route(torch.randn(n, E), MoeRouting(k, renormalize=k > 1))
        if k == 2:
            ids[0, 1] = E  # 5 held slots: 10 items on 6 programs (2 per "SM")
            valid = torch.tensor([1, 0, 1])  # a CUDA-graph padding row: not counted
            for c in (dataclasses.replace(stream, up_stream=2),
                      dataclasses.replace(stream, slots_first=False)):
                check(same_as_grid(x, ids, weights, c, valid=valid), x, ids, weights)
            ids[1:, :] = E + 1  # 1 held slot: 2 items on 3 programs
        check(same_as_grid(x, ids, weights, stream), x, ids, weights)
    assert not same_as_grid(x, torch.full_like(ids, E), weights, stream).any()
    weights, ids = route(torch.randn(1, E), MoeRouting(8, renormalize=True))
    x = torch.randn(1, H)
    for xx, tol in ((x, 1e-5), (x.bfloat16(), 2**-5)):
        check(same_as_grid(xx, ids, weights, stream, q13, q2, s13, s2), xx, ids, weights, r13,
              r2, tol=tol)
    # another rank's slots: no item, their inter rows never written (left NaN here)
    inter = torch.full((3 * 2, I), float("nan"))
    ids = torch.tensor([[2, E], [E + 5, 2], [7, 0]])
    moe_decode._gate_up_stream(x.expand(3, H), w13, None, inter, ids.reshape(-1), None, None, 2,
                               stream)
    held = ids.reshape(-1) < E
    gate, up = torch.einsum("h,snh->sn", x[0], w13[ids.reshape(-1)[held]]).chunk(2, dim=-1)
    torch.testing.assert_close(inter[held], torch.nn.functional.silu(gate) * up)
    assert inter[~held].isnan().all()

    # FusedMoE's CUDA path at 2 tokens x top-2 (decode kernels) = its CPU path
    assert moe_decode.decode_config_for(4) is not None
    moe = FusedMoE(E, H, I, MoeRouting(2, True), Dist())
    moe.w13.data, moe.w2.data = w13, w2
    stats = RoutingStats(1, E, torch.device("cpu"))
    moe.attach_stats(stats, 0)
    moe._warm = True  # compiling every tiling is a GPU concern (tests/gpu/test_moe_cuda.py)
    x, logits = torch.randn(2, H), torch.randn(2, E)
    stats.begin_step(torch.tensor([1, 1]))
    fused = moe._forward_cuda(x, logits)
    through_triton = stats.take()
    stats.begin_step(torch.tensor([1, 1]))
    torch.testing.assert_close(fused, moe.forward(x, logits), rtol=1e-5, atol=1e-5)
    assert through_triton == stats.take() and sum(through_triton[0]) == 2 * 2
    """
)

# shard/kernels/moe_router.py: residual add + RMSNorm + router GEMV + routing in one launch equals
# elementwise.add_rms_norm (the sum bit for bit, the norm to fp32 rounding), the router's matmul
# and moe_route's routing (ids exactly) for several tilings, hidden sizes that are not powers of
# two, expert counts that are not multiples of the tile, each routing variant; the per-token
# tickets are back at zero after every launch (the next launch, or graph replay, relies on it).
# The launch without the routing (ROUTE False, add_rms_norm_logits) stores the same normed row,
# sum and logits as the routing launch, bit for bit, and touches no ticket.
# Then the sparse block's fused paths (SparseMoeBlock.forward_add_norm_fused, what the decoder
# layer runs on CUDA at decode-sized batches, under fused_router and under ROUTER_NORM) equal the
# unfused add + norm + block, with and without Qwen2-MoE's gated shared expert, counting the
# same routing statistics.
_ROUTER_CHECK = textwrap.dedent(
    """
    import torch
    from shard.distributed.groups import Dist
    from shard.kernels import elementwise, moe_router
    from shard.kernels.moe_align import MoeRouting, route
    from shard.layers.moe import (
        QWEN_EXPERT_NAMES, ROUTER_NORM, RoutingStats, SparseMoeBlock, fused_router)
    from shard.layers.norm import RMSNorm, add_rms_norm

    torch.manual_seed(0)
    tickets_zero = lambda: moe_router._TICKETS.all_zero(torch.device("cpu"))
    cases = ((1, 48, 8, MoeRouting(2, True)), (3, 40, 12, MoeRouting(3, False, False)),
             (2, 64, 128, MoeRouting(8, True)), (2, 24, 6, MoeRouting(1, False)))
    for n, H, E, r in cases:
        d, x = torch.randn(n, H), torch.randn(n, H)
        nw = torch.rand(H) + 0.5
        rw = torch.randn(E, H) * 0.3
        h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
        for cfg in (None, moe_router.RouterConfig(1, 1), moe_router.RouterConfig(8, 2)):
            got = moe_router.add_rms_norm_route(d, x, nw, 1e-6, rw, r, cfg)
            assert tickets_zero()
            alone = moe_router.add_rms_norm_logits(d, x, nw, 1e-6, rw, cfg)  # ROUTE False
            for out in (got, alone):
                assert torch.equal(out.residual, s), (n, H, E)
                torch.testing.assert_close(out.normed, h, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(out.logits, out.normed @ rw.T, rtol=1e-5, atol=1e-5)
            assert torch.equal(alone.normed, got.normed) and torch.equal(alone.logits, got.logits)
            assert tickets_zero()
            w, i = route(got.logits, r)
            assert torch.equal(got.ids.long(), i), (n, H, E, r, got.ids, i)
            torch.testing.assert_close(got.weights, w, rtol=1e-6, atol=1e-6)
    # bf16: the sum rounded to bf16 before the norm, as the add_rms_norm kernel rounds it (the
    # same interpreter roundings on both sides: equal bit for bit)
    d, x, nw = (torch.randn(2, 40).bfloat16(), torch.randn(2, 40).bfloat16(),
                (torch.rand(40) + 0.5).bfloat16())
    rw = torch.randn(8, 40).bfloat16()
    got = moe_router.add_rms_norm_route(d, x, nw, 1e-6, rw, MoeRouting(2, True))
    h, s = elementwise.add_rms_norm(d, x, nw, 1e-6)
    assert torch.equal(got.residual, s) and torch.equal(got.normed, h)
    alone = moe_router.add_rms_norm_logits(d, x, nw, 1e-6, rw)
    assert torch.equal(alone.residual, s) and torch.equal(alone.normed, h)
    assert torch.equal(alone.logits, got.logits)

    E, H, I = 8, 40, 24
    for shared, switch in ((0, fused_router), (16, fused_router), (0, ROUTER_NORM.override),
                           (16, ROUTER_NORM.override)):
        block = SparseMoeBlock(H, E, I, MoeRouting(2, True), Dist(), QWEN_EXPERT_NAMES, shared)
        for p in block.parameters():
            p.data = torch.randn(p.shape) * 0.3
        norm = RMSNorm(H, 1e-6)
        norm.weight.data = torch.rand(H) + 0.5
        stats = RoutingStats(1, E, torch.device("cpu"))
        block.experts.attach_stats(stats, 0)
        block.experts._warm = True  # compiling every tiling is a GPU concern
        d, x = torch.randn(3, H), torch.randn(3, H)
        assert block.fused_router_serves(d, x, norm)
        stats.begin_step(torch.tensor([1, 1, 0]))  # the last row: CUDA-graph padding
        with switch(True):
            x_new, y = block.forward_add_norm_fused(d, x, norm)
            assert block.forward_add_norm(d, x, norm) is None  # CPU tensors: the unfused form
        fused_counts = stats.take()
        h, s = add_rms_norm(d, x, norm)
        stats.begin_step(torch.tensor([1, 1, 0]))
        want = block(h, reduce=False)
        assert torch.equal(x_new, s)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        assert fused_counts == stats.take() and sum(fused_counts[0]) == 2 * 2
    """
)

pytestmark = INTERPRETER_MARKS


def test_fused_moe_kernel_in_interpreter():
    run_interpreted(_CHECK)


def test_decode_kernels_in_interpreter():
    run_interpreted(_DECODE_CHECK)


def test_routing_and_layout_kernels_in_interpreter():
    run_interpreted(_ROUTE_CHECK)


def test_fused_add_norm_router_kernel_in_interpreter():
    run_interpreted(_ROUTER_CHECK)


def test_sorted_routing_top_k_equals_the_argmax_loop_in_interpreter():
    run_interpreted(_SORTED_TOPK_CHECK)
