"""CPU tests of shard/quantization: flags, fp8 weights, bitsandbytes linears, fp8 KV cache."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from shard.quantization import (
    KvCacheDtype,
    QuantizeMethod,
    checkpoint_quantization,
    kv_cache_bytes_per_token,
    kv_cache_torch_dtype,
    linear_weight_bytes,
    make_fp8_linear_from_checkpoint,
    make_linear_weights,
    parse_kv_cache_dtype,
    parse_quantize,
    read_blocks,
    write_kv,
)
from shard.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    dequantize_fp8,
    quantize_fp8_per_channel,
    to_per_channel,
)
from shard.quantization.kv_cache import KvScales, calibrate_scale, dequantize_kv, quantize_kv
from shard.quantization.methods import Fp8ScaleLayout
from tests.helpers.numerics import rel_err
from tests.helpers.tools import needs
from tests.helpers.triton_interpreter import (
    INTERPRETER_TIMEOUT_S,
    requires_interpreter,
    run_interpreted,
)

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- flags


def test_parse_quantize_values():
    assert parse_quantize(None) is None
    assert parse_quantize("") is None
    assert parse_quantize("bitsandbytes") is QuantizeMethod.BITSANDBYTES
    assert parse_quantize("bitsandbytes-nf4") is QuantizeMethod.BITSANDBYTES_NF4
    assert parse_quantize("bitsandbytes_nf4") is QuantizeMethod.BITSANDBYTES_NF4
    assert parse_quantize("FP8") is QuantizeMethod.FP8
    with pytest.raises(ValueError, match="--quantize"):
        parse_quantize("gptq")


def test_parse_kv_cache_dtype_values():
    assert parse_kv_cache_dtype(None) is KvCacheDtype.AUTO
    assert parse_kv_cache_dtype("auto") is KvCacheDtype.AUTO
    assert parse_kv_cache_dtype("fp8_e4m3fn") is KvCacheDtype.FP8_E4M3FN
    assert parse_kv_cache_dtype("fp8") is KvCacheDtype.FP8_E4M3FN
    assert parse_kv_cache_dtype("fp8_e5m2") is KvCacheDtype.FP8_E5M2
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        parse_kv_cache_dtype("int4")


def test_checkpoint_quantization_formats():
    assert checkpoint_quantization({}) is None
    q = checkpoint_quantization(
        {
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "static",
                "ignored_layers": ["lm_head"],
            }
        }
    )
    assert q.method is QuantizeMethod.FP8 and q.scale_layout is Fp8ScaleLayout.TENSOR
    assert q.is_ignored("lm_head") and not q.is_ignored("model.layers.0.mlp.up_proj")
    q = checkpoint_quantization(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert q.scale_layout is Fp8ScaleLayout.BLOCK and q.weight_block_size == (128, 128)
    q = checkpoint_quantization({"quantization_config": {"quant_method": "fbgemm_fp8"}})
    assert q.scale_layout is Fp8ScaleLayout.CHANNEL
    q = checkpoint_quantization(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"dynamic": True},
                    }
                },
            }
        }
    )
    assert q.scale_layout is Fp8ScaleLayout.CHANNEL and q.activation_scheme == "dynamic"
    with pytest.raises(ValueError, match="quant_method"):
        checkpoint_quantization({"quantization_config": {"quant_method": "hqq"}})


# ------------------------------------------------------------------------------------ fp8 weights


def test_fp8_round_trip_error_bound():
    torch.manual_seed(0)
    w = torch.randn(256, 512) * torch.logspace(-2, 1, 256)[:, None]  # rows of very different size
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (256,)
    back = dequantize_fp8(q, scale, torch.float32)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values; per-row scaling
    # keeps every row in the normal range, so the error relative to each row's absmax is tiny.
    row_err = (back - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert float(row_err.max()) <= 2**-4
    assert rel_err(back, w) < 0.03
    # Each row uses the full range.
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((256,), 448.0))


def test_fp8_zero_rows_are_safe():
    w = torch.zeros(32, 64)
    w[1] = 1.0
    q, scale = quantize_fp8_per_channel(w)
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(back).all() and torch.equal(back, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_reference(dtype, bias):
    torch.manual_seed(1)
    w = torch.randn(96, 128, dtype=dtype) * 0.05
    b = torch.randn(96, dtype=dtype) if bias else None
    x = torch.randn(5, 7, 128, dtype=dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    lin = make_linear_weights(w, b, QuantizeMethod.FP8)
    assert isinstance(lin, Fp8Linear) and not lin.use_scaled_mm  # CPU: dequantize path
    y = lin(x)
    assert y.shape == (5, 7, 96) and y.dtype == dtype
    # e4m3 keeps 3 mantissa bits: each weight is off by up to 2^-4 relative, ~2.5% rms, and with
    # independent random weights a dot product inherits that rms (no averaging out). So one
    # random matmul lands near 2.5%, whatever the scaling granularity.
    assert rel_err(y, ref) < 0.03
    assert lin.weight_bytes == 96 * 128 + 96 * 4


def test_fp8_linear_scaled_mm_math_on_cpu():
    """The W8A8 path (per-token activation scales, torch._scaled_mm) where this torch runs it on
    CPU; on CUDA sm_89+ the same code runs on the tensor cores."""
    torch.manual_seed(2)
    w = torch.randn(64, 128) * 0.05
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    x[3] *= 50  # one outlier token: per-token scales keep the others precise
    lin = Fp8Linear.from_float(w, None, use_scaled_mm=True)
    y = lin(x)  # the pinned CPU torch (Makefile TORCH_SPEC) runs torch._scaled_mm: no skip
    ref = x.float() @ w.t()
    assert y.dtype == torch.bfloat16
    # Weights and activations both rounded: ~sqrt(2) * 2.5% rms per token (noisy per row at
    # K=128, so rows get some slack).
    assert rel_err(y, ref) < 0.045
    for row in range(9):
        assert rel_err(y[row], ref[row]) < 0.07, row


def test_fp8_from_checkpoint_layouts():
    torch.manual_seed(3)
    w = torch.randn(64, 256) * 0.1
    x = torch.randn(4, 256)
    ref = x @ w.t()
    # Per tensor (AutoFP8 "fp8"): one scale.
    s = w.abs().amax() / 448.0
    q = (w / s).to(FP8_DTYPE)
    lin = make_fp8_linear_from_checkpoint(q, s.reshape(()), None)
    # One scale for all rows pushes small rows' values into the subnormals: a bit worse.
    assert rel_err(lin(x), ref) < 0.05
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8))  # no re-rounding
    # Per channel [out, 1] (fbgemm / compressed-tensors channel).
    qc, sc = quantize_fp8_per_channel(w)
    lin = make_fp8_linear_from_checkpoint(qc, sc[:, None], None)
    assert rel_err(lin(x), ref) < 0.03
    # Blocks of 32 x 128 with `weight_scale_inv` multipliers.
    blocks = w.reshape(2, 32, 2, 128).abs().amax(dim=(1, 3)) / 448.0  # [2, 2]
    expanded = blocks.repeat_interleave(32, 0).repeat_interleave(128, 1)
    qb = (w / expanded).to(FP8_DTYPE)
    lin = make_fp8_linear_from_checkpoint(qb, blocks, None, block_size=(32, 128))
    # Blocks are re-quantized per channel: rounded twice, ~sqrt(2) * 2.5%.
    assert rel_err(lin(x), ref) < 0.05
    with pytest.raises(ValueError, match="weight_scale"):
        to_per_channel(q, torch.ones(3))


def test_fused_per_tensor_scales_concatenate():
    """Per-tensor scales become per-channel, so q/k/v with different scales can be stacked."""
    torch.manual_seed(4)
    parts = [torch.randn(16, 64) * m for m in (0.01, 1.0, 10.0)]
    qs, ss = [], []
    for p in parts:
        s = p.abs().amax() / 448.0
        q8, sc = to_per_channel((p / s).to(FP8_DTYPE), s)
        qs.append(q8)
        ss.append(sc)
    fused = Fp8Linear(torch.cat(qs), torch.cat(ss))
    x = torch.randn(3, 64)
    assert rel_err(fused(x), x @ torch.cat(parts).t()) < 0.03


def test_dense_and_weight_bytes():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    dense = make_linear_weights(w, None, None)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(dense(x), torch.nn.functional.linear(x, w))
    fp8 = make_linear_weights(w, None, QuantizeMethod.FP8)
    model = torch.nn.ModuleList([dense, fp8])
    assert linear_weight_bytes(model) == 32 * 64 * 2 + 32 * 64 + 32 * 4


def test_fp8_merge_rows_is_exact_and_shares_memory():
    torch.manual_seed(10)
    parts = [
        Fp8Linear.from_float(torch.randn(n, 64) * m, torch.randn(n))
        for n, m in ((32, 0.01), (16, 1.0), (16, 5.0))
    ]
    x = torch.randn(3, 64)
    before = torch.cat([p(x) for p in parts], dim=-1)
    merged = Fp8Linear.merge_rows(*parts)
    assert merged.out_features == 64 and merged.bias is not None
    torch.testing.assert_close(merged(x), before, rtol=1e-6, atol=1e-6)
    # The parts now read the merged buffers (no second copy) and still compute the same.
    base = merged.weight.data_ptr()
    assert [p.weight.data_ptr() - base for p in parts] == [0, 32 * 64, 48 * 64]
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), before)
    with pytest.raises(ValueError, match="bias"):
        Fp8Linear.merge_rows(parts[0], Fp8Linear.from_float(torch.randn(8, 64)))


def test_fp8_gemv_is_cuda_only():
    lin = Fp8Linear.from_float(torch.randn(32, 64), use_gemv=True)
    assert not lin.use_gemv  # CPU: the Triton GEMV never runs, the dequantize path does
    assert "gemv=False" in repr(lin)


# The kernel under Triton's interpreter on CPU tensors (no GPU). Triton reads TRITON_INTERPRET
# when a kernel is defined, hence a fresh process. Interpreter limits (triton 3.6): its bf16
# tl.dot multiplies raw bits and its fp32 -> bf16 casts truncate, so bf16 runs the CUDA-core
# config only, to 2^-7; everything else (fp16) is checked to fp16 rounding. The interpreter's time
# goes per program: the even shape is N = 64 rather than 96 (both multiples of every fp8 BLOCK_N,
# 4..32) and shape x dtype x bias runs as a pairwise covering set (6 cases instead of 12: every
# pair of values meets, and every batch size and config runs in each).
_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from shard.quantization.fp8 import quantize_fp8_per_channel
    from shard.kernels.fp8_gemv import configs_for, fp8_gemv

    torch.manual_seed(0)
    for i, (n, k) in enumerate(((64, 256), (37, 200), (5, 1999))):  # even; N, K tails; N < BLOCK_N
        w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]
        q, s = quantize_fp8_per_channel(w)
        wd = q.float() * s[:, None]
        for j, (dtype, bound) in enumerate(((torch.float16, 2**-10), (torch.bfloat16, 2**-7))):
            # shape i meets both bias states (j = 0, 1), dtype j too (i = 0, 1)
            for bias in ((torch.randn(n).to(dtype),) if (i + j) % 2 else (None,)):
                for m in (1, 3, 16):
                    x = torch.randn(m, k).to(dtype)
                    ref = x.float() @ wd.t() + (0 if bias is None else bias.float())
                    for cfg in configs_for(m):
                        if dtype is torch.bfloat16 and cfg.kwargs["USE_DOT"]:
                            continue
                        y = fp8_gemv(x, q, s, bias, config=cfg)
                        assert y.shape == (m, n) and y.dtype == dtype
                        err = float((y.float() - ref).abs().max() / ref.abs().max())
                        assert err <= bound, (n, k, dtype, bias is not None, m, str(cfg), err)
    # Whole tiles (N, K multiples of every CUDA-core BLOCK_N, BLOCK_K): no masked tail.
    q, s = quantize_fp8_per_channel(torch.randn(32, 2048))
    wd = q.float() * s[:, None]
    for dtype, bound in ((torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
        x = torch.randn(1, 2048).to(dtype)
        ref = x.float() @ wd.t()
        for cfg in configs_for(1):
            if cfg.kwargs["USE_DOT"]:
                continue
            err = float((fp8_gemv(x, q, s, None, config=cfg).float() - ref).abs().max()
                        / ref.abs().max())
            assert err <= bound, (dtype, str(cfg), err)
    # Strided and misaligned activations are normalized before the launch.
    q, s = quantize_fp8_per_channel(torch.randn(40, 64))
    wd = q.float() * s[:, None]
    base = torch.randn(4, 192).half()
    for x in (base[:, 5:69], base[:, 8:72], base[:, :64].t().contiguous().t(), base[:1, 3:67]):
        ref = x.float() @ wd.t()
        for cfg in configs_for(x.shape[0]):
            y = fp8_gemv(x, q, s, None, config=cfg)
            assert float((y.float() - ref).abs().max() / ref.abs().max()) <= 2**-10
    """
)


@pytest.mark.timeout(INTERPRETER_TIMEOUT_S)
@requires_interpreter
def test_fp8_gemv_kernel_in_triton_interpreter():
    run_interpreted(_INTERPRETER_CHECK)



# ----------------------------------------------------------------------------------- bitsandbytes


@needs(HAS_BNB, "bitsandbytes not installed (a dev dependency on x86_64)")
@pytest.mark.parametrize(
    ("method", "bound", "ratio"),
    [(QuantizeMethod.BITSANDBYTES, 0.03, 1.9), (QuantizeMethod.BITSANDBYTES_NF4, 0.12, 3.0)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bnb_linear_on_cpu(method, bound, ratio, dtype):
    torch.manual_seed(5)
    w = (torch.randn(128, 256) * 0.05).to(dtype)
    b = torch.randn(128).to(dtype)
    x = torch.randn(6, 256).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    lin = make_linear_weights(w, b, method)
    y = lin(x)
    assert y.shape == (6, 128)
    # nf4 keeps 16 levels per block of 64: ~9% error on one Gaussian matmul; int8 ~1%.
    assert rel_err(y, ref) < bound
    dense_bytes = w.numel() * 2  # against bf16
    assert dense_bytes / lin.weight_bytes >= ratio


def test_bnb_missing_names_the_flag(monkeypatch):
    import builtins

    from shard.quantization.bnb import import_bitsandbytes

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("no bitsandbytes")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError, match="--quantize bitsandbytes-nf4"):
        import_bitsandbytes(QuantizeMethod.BITSANDBYTES_NF4)


# ------------------------------------------------------------------------------------ fp8 KV cache


def test_kv_cache_bytes_per_token_halves():
    bf16 = kv_cache_bytes_per_token(32, 8, 128, torch.bfloat16)
    fp8 = kv_cache_bytes_per_token(
        32, 8, 128, kv_cache_torch_dtype(KvCacheDtype.FP8_E4M3FN, torch.bfloat16)
    )
    assert bf16 == 2 * 32 * 8 * 128 * 2 == 131072
    assert fp8 * 2 == bf16
    assert kv_cache_torch_dtype(KvCacheDtype.AUTO, torch.float16) is torch.float16


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_fp8_kv_write_read_round_trip(scale):
    torch.manual_seed(6)
    num_blocks, block_size, heads, head_dim = 6, 4, 2, 16
    shape = (num_blocks, block_size, heads, head_dim)
    kc = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    vc = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    n = 7
    k = torch.randn(n, heads, head_dim, dtype=torch.bfloat16) * 3
    v = torch.randn(n, heads, head_dim, dtype=torch.bfloat16)
    # Sequence in blocks [4, 1]: slots 16..19 then 4..6.
    slots = torch.tensor([16, 17, 18, 19, 4, 5, 6])
    scales = KvScales(k_scale=scale, v_scale=scale)
    write_kv(k, v, kc, vc, slots, scales)
    k_back = read_blocks(kc, torch.tensor([4, 1]), scale, torch.bfloat16)[:n]
    v_back = read_blocks(vc, torch.tensor([4, 1]), scale, torch.bfloat16)[:n]
    assert k_back.dtype == torch.bfloat16
    assert rel_err(k_back, k) < 0.04 and rel_err(v_back, v) < 0.04
    # Untouched slots stay zero.
    assert float(read_blocks(kc, torch.tensor([0]), scale, torch.float32).abs().max()) == 0.0


def test_kv_write_model_dtype_cache_is_exact():
    kc = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 1, 8, dtype=torch.bfloat16)
    write_kv(k, k, kc, vc, torch.tensor([0, 5, 7]))
    assert torch.equal(read_blocks(kc, torch.tensor([0, 1]), 1.0, torch.bfloat16)[[0, 5, 7]], k)


def test_kv_quantize_saturates_and_calibrates():
    x = torch.tensor([1000.0, -1000.0, 1.0])
    q = quantize_kv(x, 1.0, torch.float8_e4m3fn)
    assert torch.equal(dequantize_kv(q, 1.0, torch.float32), torch.tensor([448.0, -448.0, 1.0]))
    s = calibrate_scale(x)
    assert s == pytest.approx(2000.0 / 448.0)
    back = dequantize_kv(quantize_kv(x, s, torch.float8_e4m3fn), s, torch.float32)
    assert rel_err(back, x) < 0.07
    assert calibrate_scale(torch.ones(4)) == 1.0


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_linear_scaled_mm_cuda():
    from shard.quantization.fp8 import scaled_mm_supported

    device = torch.device("cuda")
    if not scaled_mm_supported(device):
        pytest.skip("fp8 matmuls need compute capability 8.9+")
    torch.manual_seed(7)
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) * 0.02
    for m in (1, 3, 64, 257):
        x = torch.randn(m, 4096, device=device, dtype=torch.bfloat16)
        lin = make_linear_weights(w, None, QuantizeMethod.FP8)
        assert lin.use_scaled_mm
        ref = x.float() @ w.float().t()
        assert rel_err(lin(x), ref) < 0.045, m  # W8A8: see test_fp8_linear_scaled_mm_math_on_cpu


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_triton_per_token_quant_matches_torch():
    from shard.quantization.fp8 import quantize_fp8_per_token
    from shard.kernels.quant import quantize_fp8_per_token_triton

    torch.manual_seed(9)
    for m, k in ((1, 4096), (7, 14336), (300, 1000)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        x[0, :5] = 0
        q_ref, s_ref = quantize_fp8_per_token(x)
        q, s = quantize_fp8_per_token_triton(x)
        assert s.shape == (m, 1) and q.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        mismatch = (q.float() != q_ref.float()).float().mean().item()
        assert mismatch < 1e-3, (m, k, mismatch)  # rounding-mode ties at most


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_BNB), reason="needs CUDA and bitsandbytes")
@pytest.mark.parametrize(
    ("method", "bound"),
    [(QuantizeMethod.BITSANDBYTES, 0.03), (QuantizeMethod.BITSANDBYTES_NF4, 0.12)],
)
def test_bnb_linear_cuda(method, bound):
    device = torch.device("cuda")
    torch.manual_seed(8)
    w = torch.randn(1024, 2048, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(8, 2048, device=device, dtype=torch.bfloat16)
    lin = make_linear_weights(w, None, method)
    assert lin.inner.weight.device.type == "cuda"
    assert rel_err(lin(x), x.float() @ w.float().t()) < bound


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_kv_round_trip_cuda():
    device = torch.device("cuda")
    kc = torch.zeros(8, 16, 8, 128, dtype=torch.float8_e4m3fn, device=device)
    vc = torch.zeros_like(kc)
    k = torch.randn(20, 8, 128, device=device, dtype=torch.bfloat16)
    slots = torch.arange(16, 36, device=device)
    write_kv(k, k, kc, vc, slots)
    back = read_blocks(kc, torch.tensor([1, 2], device=device), 1.0, torch.bfloat16)[:20]
    assert rel_err(back, k) < 0.04


# ------------------------------------------------------------------ fp8 GEMV (Triton, decode batches)

# (N, K): fused q/k/v, o, fused gate/up, down of Llama-3-8B, and one with K and N off every block.
GEMV_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1037, 1999))


def _fp8_gemv_device() -> torch.device:
    from shard.quantization.fp8 import scaled_mm_supported

    device = torch.device("cuda")
    if not scaled_mm_supported(device):
        pytest.skip("the fp8 GEMV needs compute capability 8.9+")
    pytest.importorskip("triton")
    return device


def _gemv_case(n: int, k: int, m: int, dtype: torch.dtype, bias: bool, seed: int):
    """x [m, k], fp8 weight [n, k], scale [n], bias [n] | None, fp32 reference [m, n]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.logspace(-2, 0, n, device="cuda")[:, None]  # rows of very different size
    w = torch.randn(n, k, generator=g, device="cuda") * rows
    q, s = quantize_fp8_per_channel(w)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    ref = x.float() @ (q.float() * s[:, None]).t()
    if b is not None:
        ref += b.float()
    return x, q, s, b, ref


def _assert_gemv_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what) -> None:
    # Same products as the reference; only the fp32 summation order and the final rounding to
    # the output dtype differ (2^-9 relative for bf16, 2^-12 for fp16).
    assert y.dtype == dtype and y.shape == ref.shape, what
    rtol = 2**-8 if dtype is torch.bfloat16 else 2**-10
    atol = 1e-4 * float(ref.abs().max())
    bad = ((y.float() - ref).abs() > rtol * ref.abs() + atol).sum().item()
    assert bad == 0, (what, bad, rel_err(y, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_reference(dtype, bias):
    _fp8_gemv_device()
    from shard.kernels.fp8_gemv import configs_for, fp8_gemv

    # bf16 without bias (Llama) runs the autotuned configs; the other combinations one fixed
    # config per path (each combination and config is another compile; every config is run by
    # test_fp8_gemv_every_config).
    tuned = dtype is torch.bfloat16 and not bias
    for i, (n, k) in enumerate(GEMV_SHAPES):
        for m in (1, 3, 8, 16):
            x, q, s, b, ref = _gemv_case(n, k, m, dtype, bias, seed=100 * i + m)
            y = fp8_gemv(x, q, s, b, config=None if tuned else configs_for(m)[0])
            _assert_gemv_close(y, ref, dtype, (n, k, m))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_gemv_every_config():
    _fp8_gemv_device()
    from shard.kernels.fp8_gemv import configs_for, fp8_gemv

    for n, k in ((4096, 4096), (1037, 1999)):
        for m in (1, 3, 16):
            x, q, s, b, ref = _gemv_case(n, k, m, torch.bfloat16, True, seed=7 + m)
            for cfg in configs_for(m):
                _assert_gemv_close(
                    fp8_gemv(x, q, s, b, config=cfg), ref, torch.bfloat16, (n, k, m, str(cfg))
                )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_gemv_strided_activations():
    _fp8_gemv_device()
    from shard.kernels.fp8_gemv import fp8_gemv

    x, q, s, _, ref = _gemv_case(4096, 4096, 4, torch.bfloat16, False, seed=11)
    wide = torch.zeros(4, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, 3 : 3 + 4096] = x
    views = (wide[:, 3 : 3 + 4096], x.t().contiguous().t(), wide[:1, 3 : 3 + 4096])
    for view, r in zip(views, (ref, ref, ref[:1]), strict=True):
        _assert_gemv_close(fp8_gemv(view, q, s), r, torch.bfloat16, view.stride())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_gemv_matches_dequant_path(bias):
    device = _fp8_gemv_device()
    torch.manual_seed(12)
    w = torch.randn(6144, 4096, device=device, dtype=torch.bfloat16) * 0.02
    b = torch.randn(6144, device=device, dtype=torch.bfloat16) if bias else None
    gemv = Fp8Linear.from_float(w, b)
    dequant = Fp8Linear(gemv.weight, gemv.weight_scale, b, use_scaled_mm=False, use_gemv=False)
    assert gemv.use_gemv and gemv.gemv_max_m == 16 and not dequant.use_gemv
    for lead in ((1,), (3,), (2, 8), (16,)):
        x = torch.randn(*lead, 4096, device=device, dtype=torch.bfloat16)
        y = gemv(x)
        assert y.shape == (*lead, 6144) and y.dtype == torch.bfloat16
        # Same fp8 weights; the dequantize path rounds W * scale to bf16 first (2^-9 relative
        # per weight), the GEMV scales the fp32 sum: far inside fp8's own ~2.5% error.
        assert rel_err(y, dequant(x)) < 0.01, lead
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert rel_err(y, ref) < 0.035, lead  # fp8 weights, ~2.5%: see the CPU test above
    assert (torch.bfloat16, False) in gemv._gemv_configs
    # Past the cutoff the W8A8 path runs, unchanged.
    x = torch.randn(17, 4096, device=device, dtype=torch.bfloat16)
    assert rel_err(gemv(x), x.float() @ w.float().t() + (0 if b is None else b.float())) < 0.045


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_gemv_cuda_graph_replay():
    device = _fp8_gemv_device()
    torch.manual_seed(13)
    w = torch.randn(4096, 14336, device=device, dtype=torch.bfloat16) * 0.02
    lin = Fp8Linear.from_float(w)
    # One eager call (any batch) tunes and loads every bucket, as the shard's warm-up does.
    lin(torch.randn(64, 14336, device=device, dtype=torch.bfloat16))
    for m in (1, 4, 16):
        x_static = torch.randn(m, 14336, device=device, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = lin(x_static)
        for _ in range(2):
            x_new = torch.randn(m, 14336, device=device, dtype=torch.bfloat16)
            x_static.copy_(x_new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_static, lin(x_new)), m  # same kernel, same config: bit-equal


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_linear_captured_before_any_eager_call_falls_back():
    device = _fp8_gemv_device()
    torch.manual_seed(14)
    w = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16) * 0.02
    # Loads the activation-quantization kernel of the W8A8 path (K = 4096) before capture.
    Fp8Linear.from_float(w, use_gemv=False)(
        torch.randn(32, 4096, device=device, dtype=torch.bfloat16)
    )
    lin = Fp8Linear.from_float(w)
    x = torch.randn(4, 4096, device=device, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lin(x)  # untuned while capturing: no autotuning, no first kernel load; W8A8 instead
    graph.replay()
    torch.cuda.synchronize()
    assert not lin._gemv_configs
    assert rel_err(y, x.float() @ w.float().t()) < 0.045
