"""shard/kernels/lora.py's batched LoRA shrink / expand / expand + SiLU-and-mul under Triton's
interpreter on CPU tensors, against a per-row torch reference and the CPU path of
shard/layers/lora.py: rows of several adapters and base rows (slot -1, left untouched), three
parts of uneven sizes (q/k/v: column tiles laid out per part, a part's tail), a rank below the
block (masked ranks), K split over programs with a tail and the partials summed in the expand,
row tails in both kernels, the one-dot expand over all slots and the per-slot loop (many slots
at a large rank), and bf16."""

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
