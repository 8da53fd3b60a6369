"""CPU tests of shard/layers/decode_linear.py (the Triton-GEMV-or-cuBLAS dispatcher): what it decides,
what it rejects, and that off CUDA it is the plain torch path. The kernels themselves are tested
under Triton's interpreter (test_triton_gemv_interpreter.py) and on CUDA (tests/gpu)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shard.kernels.gemv_buckets import GEMV_MAX_M, M_BUCKETS, m_bucket
from shard.layers import decode_linear as dl
from shard.layers.decode_linear import Backend, BucketChoice

REPO_ROOT = Path(__file__).resolve().parents[2]


def _record(*backends: Backend) -> dict[int, BucketChoice]:
    """A tuning record with the given winner per bucket (1, 2, 4, 8, 16); no real configs."""
    return {b: BucketChoice(w, None, 1.0, 1.0) for b, w in zip(M_BUCKETS, backends, strict=True)}


def test_import_needs_no_triton():
    code = "import sys, shard.layers.decode_linear; assert 'triton' not in sys.modules"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_m_bucket_is_next_power_of_two():
    assert [m_bucket(m) for m in range(1, GEMV_MAX_M + 1)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        8,
        8,
        16,
        16,
        16,
        16,
        16,
        16,
        16,
        16,
    ]
    assert set(map(m_bucket, range(1, GEMV_MAX_M + 1))) == set(M_BUCKETS)


def test_select_backend_follows_the_record_per_bucket():
    t, c = Backend.TRITON, Backend.CUBLAS
    record = _record(t, c, t, c, t)
    got = [dl.select_backend(m, record, None) for m in range(GEMV_MAX_M + 2)]
    # m = 0 and m > GEMV_MAX_M never take the GEMV; 3 -> bucket 4, 5..8 -> 8, 9..16 -> 16.
    assert got == [c, t, c, t, t, c, c, c, c] + [t] * 8 + [c]


def test_select_backend_untuned_and_forced():
    t, c = Backend.TRITON, Backend.CUBLAS
    record = _record(c, c, c, c, c)
    assert dl.select_backend(1, None, None) is c  # untuned (met while capturing): cuBLAS
    assert dl.select_backend(1, None, t) is c  # forcing cannot conjure a tuned config
    assert dl.select_backend(4, record, t) is t
    assert dl.select_backend(GEMV_MAX_M + 1, record, t) is c  # past the GEMV's 16-row tile
    assert dl.select_backend(1, _record(t, t, t, t, t), c) is c


def test_winner_needs_the_margin():
    assert dl.winner(9.0, 10.0) is Backend.TRITON
    assert dl.winner(10.0 * (1 - dl.WIN_MARGIN) + 1e-6, 10.0) is Backend.CUBLAS
    assert dl.winner(10.0, 10.0) is Backend.CUBLAS
    assert dl.winner(11.0, 10.0) is Backend.CUBLAS


def test_forced_backend_nests_and_restores():
    assert dl._FORCED.value is None
    with dl.forced_backend(Backend.TRITON):
        assert dl._FORCED.value is Backend.TRITON
        with pytest.raises(RuntimeError), dl.forced_backend(Backend.CUBLAS):
            assert dl._FORCED.value is Backend.CUBLAS
            raise RuntimeError
        assert dl._FORCED.value is Backend.TRITON
    assert dl._FORCED.value is None


def test_shape_key_fields():
    w = torch.zeros(48, 64, dtype=torch.bfloat16)
    key = dl.shape_key(w, torch.bfloat16, torch.zeros(48), True)
    assert key == dl.ShapeKey(-1, torch.bfloat16, 48, 64, True, True)  # CPU: device -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_is_f_linear(dtype, bias):
    torch.manual_seed(0)
    x, w = torch.randn(3, 64).to(dtype), torch.randn(40, 64).to(dtype)
    b = torch.randn(40).to(dtype) if bias else None
    with dl.forced_backend(Backend.TRITON):  # off CUDA the GEMV is never eligible
        y = dl.linear(x, w, b)
    assert torch.equal(y, F.linear(x, w, b))
    assert dl.tuned(w, dtype, b) is None  # nothing tuned off CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_gate_up_silu_rounds_like_the_unfused_form(dtype):
    torch.manual_seed(1)
    x, w = torch.randn(5, 64).to(dtype), torch.randn(2 * 24, 64).to(dtype)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    y = dl.gate_up_silu(x, w)
    assert y.shape == (5, 24)
    assert torch.equal(y, F.silu(gate) * up)  # each op rounds to dtype, as the model's MLP


def test_shape_errors_name_the_field():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"linear: x must be \[M, K\]"):
        dl.linear(torch.zeros(16), w)
    with pytest.raises(ValueError, match="K = x's 12"):
        dl.linear(torch.zeros(2, 12), w)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        dl.linear(torch.zeros(2, 16), w, torch.zeros(7))
    with pytest.raises(ValueError, match=r"gate_up_silu: weight has 7 rows; expected 2\*I"):
        dl.gate_up_silu(torch.zeros(2, 16), torch.zeros(7, 16))


def test_tune_rejects_what_the_gemv_cannot_run():
    with pytest.raises(ValueError, match=r"dtype torch.float32.*one of"):
        dl.tune(torch.zeros(8, 16), torch.float32)
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16, weight torch.float16"):
        dl.tune(torch.zeros(8, 16, dtype=torch.float16), torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA-only"):
        dl.tune(torch.zeros(8, 16, dtype=torch.bfloat16), torch.bfloat16)
