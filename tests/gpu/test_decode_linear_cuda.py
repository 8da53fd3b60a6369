"""shard/layers/decode_linear.py and the 16-bit Triton GEMV on CUDA: Llama-3-8B shapes at TP=1 and
TP=2 (per rank), both backends and the tuned choice, the fused SiLU-and-mul epilogue, and CUDA
graphs captured after tuning.

Run on a GPU machine: `pytest -m gpu tests/gpu/test_decode_linear_cuda.py`. Without CUDA every
test here is skipped, and nothing GPU-only is imported at collection time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPE = torch.bfloat16
# name -> ((N, K) at TP=1, (N, K) per rank at TP=2); gate_up is the merged [2I, K] weight.
SHAPES_8B = {
    "qkv": ((6144, 4096), (3072, 4096)),
    "o": ((4096, 4096), (4096, 2048)),
    "gate_up": ((28672, 4096), (14336, 4096)),
    "down": ((4096, 14336), (4096, 7168)),
    "lm_head": ((128256, 4096), (64128, 4096)),
}
CASES = [(name, tp, shapes[tp - 1]) for name, shapes in SHAPES_8B.items() for tp in (1, 2)]


@pytest.fixture(autouse=True)
def _fresh_records() -> Iterator[None]:
    pytest.importorskip("triton")
    from shard.layers import decode_linear

    decode_linear.clear()
    yield
    decode_linear.clear()


def _weights(n: int, k: int, seed: int, bias: bool = False):
    """weight [N, K] bf16 (rows of very different size), bias [N] | None."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.logspace(-2, 0, n, device="cuda")[:, None]
    w = (torch.randn(n, k, generator=g, device="cuda") * rows).to(DTYPE)
    b = torch.randn(n, generator=g, device="cuda").to(DTYPE) if bias else None
    return w, b


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(DTYPE)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 x @ w.T (+ b), [M, N]; by row blocks so the LM head needs no 2 GB fp32 copy."""
    out = torch.cat([x.float() @ blk.float().t() for blk in w.split(16384)], dim=1)
    return out if b is None else out + b.float()


def _assert_close(y: torch.Tensor, ref: torch.Tensor, what) -> None:
    # Same bf16 products as the reference; only the fp32 summation order and the final rounding
    # to bf16 (2^-9 relative) differ.
    assert y.dtype == DTYPE and y.shape == ref.shape, what
    atol = 1e-4 * float(ref.abs().max())
    bad = int(((y.float() - ref).abs() > 2**-8 * ref.abs() + atol).sum())
    assert bad == 0, (what, bad)


def _silu_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up in fp32 from gate and up rounded to bf16 (as a matmul output is)."""
    gate, up = _reference(x, w, b).to(DTYPE).float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize(("name", "tp", "shape"), CASES, ids=[f"{c[0]}-tp{c[1]}" for c in CASES])
def test_linear_8b_shapes_both_backends(name, tp, shape):
    from shard.layers import decode_linear as dl
    from shard.layers.decode_linear import Backend

    n, k = shape
    w, _ = _weights(n, k, seed=n + k)
    for m in (1, 2, 8):
        x = _x(m, k, seed=m)
        ref = _reference(x, w, None)
        for forced in (None, Backend.TRITON, Backend.CUBLAS):
            with dl.forced_backend(forced):
                _assert_close(dl.linear(x, w), ref, (name, tp, m, forced))
    record = dl.tuned(w, DTYPE)
    assert record is not None and sorted(record) == [1, 2, 4, 8, 16]
    assert all(c.triton_us > 0 and c.cublas_us > 0 for c in record.values())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_8b_shapes(tp, bias):
    from shard.layers import decode_linear as dl
    from shard.layers.decode_linear import Backend
    from shard.kernels.gemv_buckets import m_bucket
    from shard.kernels.gemv import gemv
    from shard.kernels.elementwise import silu_mul

    n, k = SHAPES_8B["gate_up"][tp - 1]
    inter = n // 2
    w, b = _weights(n, k, seed=tp, bias=bias)
    for m in (1, 2, 8):
        x = _x(m, k, seed=10 + m)
        ref = _silu_reference(x, w, b)
        for forced in (None, Backend.TRITON, Backend.CUBLAS):
            with dl.forced_backend(forced):
                y = dl.gate_up_silu(x, w, b)
            # The gate and up roundings move silu's product by up to ~3 bf16 ulps.
            assert y.shape == (m, inter) and y.dtype == DTYPE
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            assert err < 2**-6, (tp, m, forced, err)
        # Fused vs the unfused Triton path with the same config: the same sums in the same
        # order, rounded at the same points, so bit-equal.
        cfg = dl.tuned(w, DTYPE, b, silu_mul=True)[m_bucket(m)].config
        with dl.forced_backend(Backend.TRITON):
            fused = dl.gate_up_silu(x, w, b)
        bg, bu = (None, None) if b is None else b.chunk(2)
        unfused = silu_mul(
            gemv(x, w[:inter], None, bg, config=cfg), gemv(x, w[inter:], None, bu, config=cfg)
        )
        assert torch.equal(fused, unfused), (tp, m)


@pytest.mark.parametrize(("n", "k", "bias"), [(4096, 4096, False), (1037, 1999, True)])
def test_16bit_gemv_every_config(n, k, bias):
    from shard.kernels.gemv import configs_for, gemv

    w, b = _weights(n, k, seed=3, bias=bias)
    # The SiLU epilogue wants an even number of rows ([2I, K]): drop the odd shape's last row.
    even = n - n % 2
    w_gu, b_gu = w[:even], None if b is None else b[:even]
    for m in (1, 3, 16):
        x = _x(m, k, seed=20 + m)
        ref, silu_ref = _reference(x, w, b), _silu_reference(x, w_gu, b_gu)
        for cfg in configs_for(m, DTYPE):
            _assert_close(gemv(x, w, None, b, config=cfg), ref, (n, k, m, str(cfg)))
            y = gemv(x, w_gu, None, b_gu, silu_mul=True, config=cfg)
            err = float((y.float() - silu_ref).abs().max() / silu_ref.abs().max())
            assert err < 2**-6, (n, k, m, str(cfg), err)


def test_strided_activations():
    from shard.layers import decode_linear as dl
    from shard.layers.decode_linear import Backend

    w, _ = _weights(4096, 4096, seed=5)
    x = _x(4, 4096, seed=5)
    wide = torch.zeros(4, 4096 + 64, device="cuda", dtype=DTYPE)
    wide[:, 3 : 3 + 4096] = x
    ref = _reference(x, w, None)
    with dl.forced_backend(Backend.TRITON):
        for view, r in (
            (wide[:, 3 : 3 + 4096], ref),
            (x.t().contiguous().t(), ref),
            (wide[:1, 3 : 3 + 4096], ref[:1]),
        ):
            _assert_close(dl.linear(view, w), r, view.stride())


@pytest.mark.parametrize("forced", ["auto", "triton"])
def test_cuda_graph_after_tune_replays_eager_result(forced):
    from shard.layers import decode_linear as dl
    from shard.layers.decode_linear import Backend

    w, _ = _weights(4096, 2048, seed=6)  # o at TP=2
    w_gu, _ = _weights(14336, 4096, seed=7)  # gate_up at TP=2
    dl.tune(w, DTYPE)
    dl.tune(w_gu, DTYPE, silu_mul=True)
    backend = Backend.TRITON if forced == "triton" else None
    for m in (1, 4, 16):
        x_o, x_gu = _x(m, 2048, seed=30 + m), _x(m, 4096, seed=40 + m)
        graph = torch.cuda.CUDAGraph()
        with dl.forced_backend(backend):
            with torch.cuda.graph(graph):
                y_o = dl.linear(x_o, w)
                y_gu = dl.gate_up_silu(x_gu, w_gu)
            for _ in range(2):
                new_o, new_gu = _x(m, 2048, seed=50 + m), _x(m, 4096, seed=60 + m)
                x_o.copy_(new_o)
                x_gu.copy_(new_gu)
                graph.replay()
                torch.cuda.synchronize()
                # same kernels, same configs: bit-equal to eager calls
                assert torch.equal(y_o, dl.linear(new_o, w)), m
                assert torch.equal(y_gu, dl.gate_up_silu(new_gu, w_gu)), m


def test_untuned_capture_falls_back_to_cublas():
    from shard.layers import decode_linear as dl

    w, _ = _weights(1024, 4096, seed=8)
    x = _x(2, 4096, seed=8)
    F.linear(x, w)  # cuBLAS handle and workspace exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dl.linear(x, w)  # untuned while capturing: no tuning, cuBLAS, a warning
    graph.replay()
    torch.cuda.synchronize()
    assert dl.tuned(w, DTYPE) is None
    assert torch.equal(y, F.linear(x, w))


def test_batch1_config_is_the_in_graph_fastest_candidate():
    """tune_gemv re-chooses batch 1 by timing every candidate back to back in a CUDA graph over
    weight-shaped views that overflow the L2 twice; the pick is the fastest of those timings."""
    from shard.kernels import gemv as gemv_kernel
    from shard.kernels.gemv import fastest_in_graph
    from shard.kernels.graph_timing import weight_views

    w, _ = _weights(4096, 2048, seed=11)  # [4096, 2048]: 16 MB, below the L2
    views = weight_views(w)
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    assert sum(v.numel() * v.element_size() for v in views) >= 2 * l2
    assert all(v.shape == w.shape and v.dtype == w.dtype for v in views)
    candidates = gemv_kernel.configs_for(1, DTYPE)
    best, timings = fastest_in_graph(w, None, None, DTYPE, False, candidates)
    assert set(timings) == {str(c) for c in candidates}
    assert all(0 < us < 1e3 for us in timings.values())
    assert timings[str(best)] == min(timings.values())
    picked = gemv_kernel.tune_gemv(w, None, None, DTYPE)[1]
    assert str(picked) in timings
    x = _x(1, 2048, seed=12)
    ref = _reference(x, w, None)
    got = gemv_kernel.gemv(x, w, config=picked)
    assert float((got.float() - ref).abs().max() / ref.abs().max()) < 2**-7


def test_tuning_cache_round_trip_serves_graph_capture(tmp_path):
    """A record measured and stored by one process (here: before clear()) is read by the next
    without measuring, with the same choices, and its kernels are loaded by then: a CUDA graph
    captured right after the read (Triton forced, so the GEMV runs in it) replays the eager
    result. The fp8 path's tune_gemv configs take the same route."""
    from shard.kernels import gemv as gemv_kernel
    from shard.kernels import tuning_cache
    from shard.layers import decode_linear as dl
    from shard.layers.decode_linear import Backend

    w, _ = _weights(4096, 2048, seed=13)
    tuning_cache.configure(tuning_cache.TuningCache(tmp_path / "tuning"))
    tuning_cache.reset_stats()
    try:
        measured = dict(dl.tune(w, DTYPE))
        assert (tuning_cache.stats().tuned, tuning_cache.stats().read) == (1, 0)
        dl.clear()  # as a new process: no record in memory
        read = dict(dl.tune(w, DTYPE))
        assert (tuning_cache.stats().tuned, tuning_cache.stats().read) == (1, 1)
        assert read == measured
        x = _x(1, 2048, seed=14)
        graph = torch.cuda.CUDAGraph()
        with dl.forced_backend(Backend.TRITON):
            with torch.cuda.graph(graph):
                y = dl.linear(x, w)
            new = _x(1, 2048, seed=15)
            x.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, dl.linear(new, w))
        gemv_kernel._CACHED_CONFIGS.clear()  # (an earlier test may have tuned this shape)
        configs = gemv_kernel.tune_gemv(w, None, None, DTYPE)
        gemv_kernel._CACHED_CONFIGS.clear()
        assert gemv_kernel.tune_gemv(w, None, None, DTYPE) == configs
        assert (tuning_cache.stats().tuned, tuning_cache.stats().read) == (2, 2)
    finally:
        tuning_cache.configure(None)
        tuning_cache.reset_stats()
