"""Programmatic dependent launch (shard/kernels/pdl.py) on CUDA: a decode-like chain of dependent kernels
(add + RMSNorm -> gate/up GEMV with SiLU -> down GEMV, repeated) gives bit-identical results with
PDL on and off, eagerly and replayed from a CUDA graph. A kernel that read its input before
`griddepcontrol.wait`, or a dependent that missed a write, would show up as a difference: every
kernel here is deterministic.

Run on a GPU machine (sm_90 for PDL itself): `pytest -m gpu tests/gpu/test_pdl.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPE = torch.bfloat16
HIDDEN, INTER, STEPS = 4096, 7168, 12


def _needs_pdl() -> None:
    pytest.importorskip("triton")
    from shard.kernels import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or later")


def _chain(gate_up: torch.Tensor, down: torch.Tensor, norm_w: torch.Tensor, configs: dict,
           x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS layers of residual add + norm -> gate/up + SiLU -> down, [1, HIDDEN] in and out."""
    from shard.kernels.gemv import gemv
    from shard.kernels.elementwise import add_rms_norm, rms_norm

    for _ in range(STEPS):
        h, x = add_rms_norm(delta, x, norm_w, 1e-5)
        a = gemv(h, gate_up, silu_mul=True, config=configs["gate_up"])  # [1, INTER]
        delta = gemv(a, down, config=configs["down"])  # [1, HIDDEN]
    return rms_norm(x, norm_w, 1e-5), delta


def test_pdl_chain_equals_plain_launches_eager_and_graph():
    _needs_pdl()
    from shard.kernels import pdl
    from shard.kernels.gemv import tune_gemv

    g = torch.Generator(device="cuda").manual_seed(7)
    gate_up = (torch.randn(2 * INTER, HIDDEN, generator=g, device="cuda") * 0.02).to(DTYPE)
    down = (torch.randn(HIDDEN, INTER, generator=g, device="cuda") * 0.02).to(DTYPE)
    norm_w = (torch.rand(HIDDEN, generator=g, device="cuda") + 0.5).to(DTYPE)
    x0 = torch.randn(1, HIDDEN, generator=g, device="cuda").to(DTYPE)
    d0 = torch.randn(1, HIDDEN, generator=g, device="cuda").to(DTYPE)
    configs = {
        "gate_up": tune_gemv(gate_up, None, None, DTYPE, silu_mul=True)[1],
        "down": tune_gemv(down, None, None, DTYPE)[1],
    }

    with pdl.override(False):
        want = _chain(gate_up, down, norm_w, configs, x0, d0)
    with pdl.override(True):
        got = _chain(gate_up, down, norm_w, configs, x0, d0)  # eager (also compiles)
        assert all(torch.equal(a, b) for a, b in zip(got, want))

        x_in, d_in = x0.clone(), d0.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _chain(gate_up, down, norm_w, configs, x_in, d_in)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            outs = _chain(gate_up, down, norm_w, configs, x_in, d_in)
        for seed in range(4):  # new inputs each replay: stale reads would differ
            gs = torch.Generator(device="cuda").manual_seed(100 + seed)
            x_in.copy_(torch.randn(1, HIDDEN, generator=gs, device="cuda").to(DTYPE))
            d_in.copy_(torch.randn(1, HIDDEN, generator=gs, device="cuda").to(DTYPE))
            graph.replay()
            with pdl.override(False):
                ref = _chain(gate_up, down, norm_w, configs, x_in.clone(), d_in.clone())
            assert all(torch.equal(a, b) for a, b in zip(outs, ref)), seed
