"""shard/kernels/lora.py's batched LoRA shrink/expand under Triton's interpreter on CPU tensors:
rows of several adapters, base rows (slot -1) left untouched, K split over programs, row tails,
and the result equal to the CPU path of shard/layers/lora.py (per-slot grouped matmuls)."""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import BF16_DOT_PRELUDE, INTERPRETER_MARKS, run_interpreted

pytestmark = INTERPRETER_MARKS

_CHECK = textwrap.dedent(
    """
    import torch

    from shard.kernels.lora import lora_expand_, lora_shrink
    from shard.layers.lora import LoraBatch, LoraPart, LoraWeights

    torch.manual_seed(0)
    # 3 slots + the zero slot; rank 24 (3 parts of 8: a merged q/k/v group), K=600 (two shrink
    # programs along K with a tail), N=80 (a column tail), 21 rows (a row tail).
    slots_n, R, K, N, M = 3, 24, 600, 80, 21
    a = torch.randn(slots_n + 1, R, K) * 0.1
    b = torch.randn(slots_n + 1, N, R) * 0.1
    a[-1].zero_(); b[-1].zero_()
    x = torch.randn(M, K)
    slot_list = [0, 2, -1, 1, 1, 0, -1, 2, 2, 2, 0, 1, -1, -1, 0, 1, 2, 0, -1, 1, 2]
    slots = torch.tensor(slot_list, dtype=torch.int32)
    y0 = torch.randn(M, N)

    h = lora_shrink(x, a, slots)
    ref_h = torch.zeros(M, R)
    for i, s in enumerate(slot_list):
        if s >= 0:
            ref_h[i] = a[s] @ x[i]
    assert torch.allclose(h, ref_h, atol=1e-4, rtol=1e-4), (h - ref_h).abs().max()

    y = y0.clone()
    lora_expand_(y, h, b, slots)
    ref = y0.clone()
    for i, s in enumerate(slot_list):
        if s >= 0:
            ref[i] += b[s] @ ref_h[i]
    assert torch.equal(y[slots < 0], y0[slots < 0])  # base rows untouched
    assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), (y - ref).abs().max()

    # The CPU path of LoraWeights gives the same delta.
    batch = LoraBatch(slots_n)
    part = LoraPart("p", K, N, (0, K), (0, N), 0)
    w = LoraWeights([part], batch, R, torch.device("cpu"), torch.float32)
    w.a.copy_(a); w.b.copy_(b)
    batch.set_rows(slot_list, torch.device("cpu"))
    y_cpu = y0.clone()
    w.apply_(x, y_cpu)
    assert torch.allclose(y_cpu, ref, atol=1e-4, rtol=1e-4), (y_cpu - ref).abs().max()

    # bf16 activations and weights (the GPU dtype): fp32 accumulation, within bf16 rounding.
    yb = y0.bfloat16()
    hb = lora_shrink(x.bfloat16(), a.bfloat16(), slots)
    lora_expand_(yb, hb, b.bfloat16(), slots)
    err = float((yb.float() - ref).abs().max() / ref.abs().max())
    assert err < 2**-6, err
    print("ok")
    """
)


def test_lora_kernels_match_reference():
    run_interpreted(BF16_DOT_PRELUDE + _CHECK)
