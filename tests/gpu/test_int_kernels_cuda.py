"""The W4A16 / W8A16 kernels on CUDA through IntLinear (shard/quantization/int_weights.py): the
configs tuned at the first eager call (shard/kernels/int_tuning.py), then every batch bucket's
GEMV / GEMM captured in one CUDA graph and replayed with fresh inputs, against x @ W.T in fp32
over the same dequantized weight; split-K counters back at zero after the replays.

Run on a GPU machine: `pytest -m gpu tests/gpu/test_int_kernels_cuda.py`. Without CUDA every test
here is skipped.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Batches across the GEMV buckets (1, 2..16) and the GEMM's (17..): what decode graphs capture.
BATCHES = (1, 3, 16, 17, 48, 200)
# bf16 output rounding is < 2^-8 of a value; the weights are exact (tiles inside a group) or
# rounded to bf16 as the dequantizing path rounds them (several groups per tile).
BOUND = 2**-7


def _linear(n: int, k: int, group: int, bits: int, fractional: bool, bias: bool, seed: int):
    from shard.quantization.int_weights import IntLinear, PackedInt, UnpackedInt

    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 2**bits, (n, k), generator=g, device="cuda", dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g, device="cuda") * 0.02 + 0.001).half()
    if fractional:  # GGUF Q4_1 / Q4_K minimums
        zeros = torch.rand(n, groups, generator=g, device="cuda") * 30 - 15
    else:
        zeros = torch.randint(0, 2**bits, (n, groups), generator=g, device="cuda").half()
    packed = PackedInt.pack(UnpackedInt(q, scales, zeros,
                                        torch.arange(k, device="cuda") // group, bits))
    b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
    return IntLinear(packed, b)


@pytest.mark.parametrize(
    ("n", "k", "group", "bits", "fractional", "bias", "timed"),
    [
        (4096, 4096, 128, 4, False, False, True),  # Llama-3-8B o_proj, W4A16 group 128
        (2048, 4096, 32, 4, True, True, False),  # GGUF Q4_1-like: group 32, fractional zeros
        (1536, 2048, 128, 8, False, False, False),  # W8A16
    ],
)
def test_int_linear_graphs(n: int, k: int, group: int, bits: int, fractional: bool,
                           bias: bool, timed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """timed: every candidate timed (the real tuning); otherwise each bucket's first candidate,
    so that the other layouts' checks do not compile every candidate again."""
    pytest.importorskip("triton")
    from shard.kernels import int_tuning

    if not timed:
        monkeypatch.setattr(int_tuning, "_tune", lambda w, dtype: int_tuning._defaults(w))
    linear = _linear(n, k, group, bits, fractional, bias, seed=n + k + group)
    assert linear.use_gemv
    w = linear.dequantized_weight(torch.float32)  # [N, K]
    b = 0 if linear.bias is None else linear.bias.float()
    linear(torch.zeros(1, k, device="cuda", dtype=torch.bfloat16))  # tunes and loads, eagerly
    statics = {m: torch.zeros(m, k, device="cuda", dtype=torch.bfloat16) for m in BATCHES}
    outs: dict[int, torch.Tensor] = {}

    def step() -> None:
        for m, x in statics.items():
            outs[m] = linear(x)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(2):  # fresh inputs each replay
        for x in statics.values():
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for m, x in statics.items():
            ref = x.float() @ w.t() + b
            err = float((outs[m].float() - ref).abs().max() / ref.abs().max())
            assert err <= BOUND, (m, err)
            eager = linear(x)
            assert torch.equal(eager, outs[m]), m  # the graph ran the same kernels
    assert int(linear.splitk_counters.abs().sum()) == 0
