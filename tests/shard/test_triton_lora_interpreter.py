"""shard/kernels/lora.py's batched LoRA shrink / expand / expand + SiLU-and-mul under Triton's
interpreter on CPU tensors, against a per-row torch reference and the CPU path of
shard/layers/lora.py: rows of several adapters and base rows (slot -1, left untouched), three
parts of uneven sizes (q/k/v: column tiles laid out per part, a part's tail), a rank below the
block (masked ranks), K split over programs with a tail and the partials summed in the expand,
row tails in both kernels, the one-dot expand over all slots and the per-slot loop (many slots
at a large rank), and bf16. The folded expands (every slot's A in extra rows of the base weight,
h read from the base GEMM's wide output) likewise, and against LoraWeights' CPU folded path."""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import BF16_DOT_PRELUDE, INTERPRETER_MARKS, run_interpreted

pytestmark = INTERPRETER_MARKS

_CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F

    from shard.kernels import lora as K
    from shard.kernels.lora import lora_expand_, lora_expand_silu_mul, lora_shrink
    from shard.layers.lora import LoraBatch, LoraPart, LoraWeights

    def make(slots_n, parts, rank, k, sizes, seed):
        g = torch.Generator().manual_seed(seed)
        r = parts * rank
        a = torch.randn(slots_n + 1, r, k, generator=g) * 0.1
        b = torch.zeros(slots_n + 1, sum(sizes), r)
        at = 0
        for p, size in enumerate(sizes):  # block-diagonal, as LoraWeights stores it
            b[:, at : at + size, p * rank : (p + 1) * rank] = torch.randn(
                slots_n + 1, size, rank, generator=g) * 0.1
            at += size
        a[-1].zero_(); b[-1].zero_()
        return a, b

    def reference(x, a, b, slot_list, y0):
        ref = y0.clone()
        for i, s in enumerate(slot_list):
            if s >= 0:
                ref[i] += b[s] @ (a[s] @ x[i])
        return ref

    def check(y, ref, y0, slots, what):
        assert torch.equal(y[slots < 0], y0[slots < 0]), what  # base rows untouched
        err = (y - ref).abs().max()
        assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), (what, err)

    # q/k/v-like: 3 slots + the zero slot, 3 parts of rank 6 (block 16: masked ranks), output
    # parts 150 / 40 / 40 (tails inside each part, tiles never straddle), K=600 (2 splits with a
    # tail), 70 rows (two expand row tiles, five shrink row tiles).
    slots_n, rank, k, sizes, m = 3, 6, 600, [150, 40, 40], 70
    a, b = make(slots_n, 3, rank, k, sizes, 0)
    x = torch.randn(m, k)
    slot_list = [(i * 7) % 4 - 1 for i in range(m)]
    slots = torch.tensor(slot_list, dtype=torch.int32)
    y0 = torch.randn(m, sum(sizes))
    assert K._splits(m, k, 3, K.MAX_SPLITS, K.SHRINK_BLOCK_K) == (2, 384)
    assert K._wide_slots(slots_n, rank) == 4

    part = lora_shrink(x, a[:slots_n], slots, rank)
    assert part.shape == (2, m, 3 * rank)
    got_h = part.sum(0)
    for i, s in enumerate(slot_list):
        if s >= 0:
            assert torch.allclose(got_h[i], a[s] @ x[i], atol=1e-4, rtol=1e-4), i
    y = y0.clone()
    lora_expand_(y, part, b[:slots_n], slots, sizes, rank)
    ref = reference(x, a, b, slot_list, y0)
    check(y, ref, y0, slots, "qkv")

    # The CPU path of LoraWeights (what the CPU tests compare with peft) gives the same delta.
    batch = LoraBatch(slots_n)
    parts, at = [], 0
    for p, size in enumerate(sizes):
        parts.append(LoraPart(f"p{p}", k, size, (0, k), (0, size), at))
        at += size
    w = LoraWeights(parts, batch, rank, torch.device("cpu"), torch.float32)
    w.a.copy_(a); w.b.copy_(b)
    batch.set_rows(slot_list, torch.device("cpu"))
    y_cpu = y0.clone()
    w.apply_(x, y_cpu)
    check(y_cpu, ref, y0, slots, "cpu path")

    # gate/up-like with SiLU-and-mul: 2 parts of 72 (a column tail), every row computed, base
    # rows as the plain silu(gate) * up; one adapter on every row of a small batch (8 splits).
    for slot_list in ([(i % 4) - 1 for i in range(9)], [1] * 9):
        a2, b2 = make(slots_n, 2, rank, 2048, [72, 72], 1)
        x2 = torch.randn(9, 2048)
        s2 = torch.tensor(slot_list, dtype=torch.int32)
        y2 = torch.randn(9, 144)
        part2 = lora_shrink(x2, a2[:slots_n], s2, rank, 8)
        assert part2.shape[0] == 8
        out = lora_expand_silu_mul(y2, part2, b2[:slots_n], s2, rank, 8)
        gu = reference(x2, a2, b2, slot_list, y2)
        ref2 = F.silu(gu[:, :72]) * gu[:, 72:]
        assert torch.allclose(out, ref2, atol=1e-4, rtol=1e-4), (out - ref2).abs().max()

    # Many slots at rank 32: the expand loops over the slots present (no one-dot form).
    slots_n, rank = 9, 32
    assert K._wide_slots(slots_n, rank) == 0
    a3, b3 = make(slots_n, 1, rank, 320, [96], 2)
    x3 = torch.randn(20, 320)
    slot_list = [(i * 5) % 10 - 1 for i in range(20)]
    s3 = torch.tensor(slot_list, dtype=torch.int32)
    y3 = torch.randn(20, 96)
    y = y3.clone()
    lora_expand_(y, lora_shrink(x3, a3[:slots_n], s3, rank), b3[:slots_n], s3, [96], rank)
    check(y, reference(x3, a3, b3, slot_list, y3), y3, s3, "slot loop")

    # bf16 activations and weights (the GPU dtype): fp32 accumulation, within bf16 rounding.
    slots_n, rank = 3, 6
    slot_list = [(i * 7) % 4 - 1 for i in range(m)]
    yb = y0.bfloat16()
    pb = lora_shrink(x.bfloat16(), a[:slots_n].bfloat16(), slots, rank)
    lora_expand_(yb, pb, b[:slots_n].bfloat16(), slots, sizes, rank)
    assert torch.equal(yb[slots < 0], y0.bfloat16()[slots < 0])
    err = float((yb.float() - ref).abs().max() / ref.abs().max())
    assert err < 2**-6, err
    print("ok")
    """
)


def test_lora_kernels_match_reference():
    run_interpreted(BF16_DOT_PRELUDE + _CHECK)


_FOLDED_CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F

    from shard.kernels import lora as K
    from shard.kernels.lora import lora_expand_folded, lora_expand_folded_silu_mul
    from shard.layers.lora import LoraBatch, LoraPart, LoraWeights

    def folded(slots_n, rank, k, sizes, seed, dtype=torch.float32):
        # a LoraWeights folded into a base weight [sum(sizes), k], random adapters in every slot
        g = torch.Generator().manual_seed(seed)
        batch = LoraBatch(slots_n)
        parts, at = [], 0
        for p, size in enumerate(sizes):
            parts.append(LoraPart(f"p{p}", k, size, (0, k), (0, size), at))
            at += size
        w = LoraWeights(parts, batch, rank, torch.device("cpu"), dtype)
        base = (torch.randn(at, k, generator=g) * 0.1).to(dtype)
        wide = w.fold_into(base)
        assert wide is not None and w.folded == at and torch.equal(wide[:at], base)
        assert w.a.shape == (slots_n, len(sizes) * rank, k)
        assert w.a.data_ptr() == wide[at:].data_ptr()  # a view of the extra rows
        for s in range(slots_n):
            w.write_slot(s, [((torch.randn(rank, k, generator=g) * 0.1).to(dtype),
                              (torch.randn(size, rank, generator=g) * 0.1).to(dtype))
                             for size in sizes])
        return w, wide, base, batch

    def reference(w, x, base, slot_list):
        y = (x.float() @ base.float().T)
        for i, s in enumerate(slot_list):
            if s >= 0:
                y[i] += w.b[s].float() @ (w.a[s].float() @ x[i].float())
        return y

    # q/k/v-like: 3 slots, 3 parts of rank 6 (block 16: masked ranks, extra rows padded to 16),
    # parts 150 / 40 / 40 (tails, tiles never straddle), 70 rows (two row tiles)
    slots_n, rank, k, sizes, m = 3, 6, 96, [150, 40, 40], 70
    w, wide, base, batch = folded(slots_n, rank, k, sizes, 0)
    assert wide.shape[0] == 230 + 64  # 3 slots x 18 ranks = 54 -> 64 rows
    x = torch.randn(m, k)
    slot_list = [(i * 7) % 4 - 1 for i in range(m)]
    slots = torch.tensor(slot_list, dtype=torch.int32)
    y_wide = x @ wide.T
    ref = reference(w, x, base, slot_list)
    out = lora_expand_folded(y_wide, 230, w.b[:slots_n], slots, sizes, rank)
    assert out.shape == (m, 230) and out.is_contiguous()
    assert torch.equal(out[slots < 0], y_wide[slots < 0, :230])  # base rows: the base output
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    for small in (True, False):  # the CPU folded path: gather (small steps) and groups
        rows = slot_list[:40] if small else slot_list
        xx, rr = (x[:40], ref[:40]) if small else (x, ref)
        batch.set_rows(rows, torch.device("cpu"))
        assert (batch.gather is not None) == small
        cpu = w.expand_folded(xx @ wide.T)
        assert torch.allclose(cpu, rr, atol=1e-4, rtol=1e-4), (small, (cpu - rr).abs().max())

    # gate/up with SiLU-and-mul: 2 parts of 72, a row tail, base rows = plain silu(gate) * up
    w2, wide2, base2, batch2 = folded(slots_n, rank, 64, [72, 72], 1)
    x2 = torch.randn(9, 64)
    s2l = [(i % 4) - 1 for i in range(9)]
    s2 = torch.tensor(s2l, dtype=torch.int32)
    yw2 = x2 @ wide2.T
    out2 = lora_expand_folded_silu_mul(yw2, 144, w2.b[:slots_n], s2, rank)
    gu = reference(w2, x2, base2, s2l)
    ref2 = F.silu(gu[:, :72]) * gu[:, 72:]
    assert torch.allclose(out2, ref2, atol=1e-4, rtol=1e-4), (out2 - ref2).abs().max()
    batch2.set_rows(s2l, torch.device("cpu"))
    assert torch.allclose(w2.silu_mul_folded(yw2), ref2, atol=1e-4, rtol=1e-4)

    # many slots at rank 32: the loop over the slots present
    w3, wide3, base3, _ = folded(9, 32, 64, [96], 2)
    assert K._wide_slots(9, 32) == 0
    x3 = torch.randn(20, 64)
    s3l = [(i * 5) % 10 - 1 for i in range(20)]
    s3 = torch.tensor(s3l, dtype=torch.int32)
    out3 = lora_expand_folded(x3 @ wide3.T, 96, w3.b[:9], s3, [96], 32)
    ref3 = reference(w3, x3, base3, s3l)
    assert torch.allclose(out3, ref3, atol=1e-4, rtol=1e-4), (out3 - ref3).abs().max()

    # bf16 (the GPU dtype): h rounded to bf16 by the GEMM, fp32 accumulation
    w4, wide4, base4, _ = folded(4, 16, 128, [256, 64, 64], 3, torch.bfloat16)
    x4 = torch.randn(64, 128).bfloat16()
    s4l = [(i % 5) - 1 for i in range(64)]
    s4 = torch.tensor(s4l, dtype=torch.int32)
    yw4 = (x4.float() @ wide4.float().T).bfloat16()
    out4 = lora_expand_folded(yw4, 384, w4.b[:4], s4, [256, 64, 64], 16)
    ref4 = reference(w4, x4, base4, s4l)
    assert torch.equal(out4[s4 < 0], yw4[s4 < 0, :384])
    err = float((out4.float() - ref4).abs().max() / ref4.abs().max())
    assert err < 2**-6, err
    print("ok")
    """
)


def test_folded_lora_kernels_match_reference():
    run_interpreted(BF16_DOT_PRELUDE + _FOLDED_CHECK)
