"""The W4A16 kernels' fast variants compiled for Hopper (sm_90) on the CPU, without a GPU: their K
loops must be software-pipelined, every tile streamed by cp.async, and no load left in the loop
that waits a full memory round trip each step.

Why: the first W4A16 kernels ran at 24 % of copy bandwidth (GEMV) and 0.15x bf16 (GEMM) on an
H100 (benchmarks/raw/round10/int4/): x's even / odd columns were read with stride-2 loads, too
narrow for cp.async, so every K step waited on synchronous global loads (38-80 ld.global in the
compiled loop). The "dq" GEMM and the "join" / "words" GEMV load x's tile contiguously and the
scales one step ahead; what is left as ld.global are those scale / zero loads (<= 8
instructions).

Compiled with the specialization a real launch gets (16-byte aligned pointers, sizes and
strides divisible by 16), with the ptxas Triton ships; skipped where Triton has no CUDA backend.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.tools import needs

triton = pytest.importorskip("triton")


def _backend_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: no CUDA backend here
        return False
    return True


pytestmark = [needs(_backend_available(), "triton without its CUDA backend (ptxas)"),
              pytest.mark.timeout(300)]


def _compile(fn, types: dict[str, str], consts: dict[str, object], warps: int, stages: int) -> str:
    """PTX of fn for sm_90 with a launch's specialization: pointers, N, K and strides / 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**types, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty != "constexpr" and name not in ("M", "count_ptr")
             and (ty.startswith("*") or name in ("N", "K", "K_SPLIT") or name.startswith("stride"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    return kernel.asm["ptx"]


_PTRS = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "b_ptr": "*fp16",
         "y_ptr": "*bf16"}


@pytest.mark.parametrize("words", [False, True])
def test_dq_gemm_k_loop_is_pipelined(words: bool) -> None:
    from shard.kernels import int_gemm

    types = {**_PTRS, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_qn": "i32",
             "stride_sn": "i32", "stride_ym": "i32"}
    consts = {"GROUP": 128, "NG": 1, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
              "STAGES": 3, "HAS_BIAS": False, "BITS": 4, "X_SPLIT": False, "W_FIRST": False,
              "X_KIND": 2, "OFFSET": True, "DQ": True, "WORDS": words}
    ptx = _compile(int_gemm._int_gemm_kernel, types, consts, warps=8, stages=3)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx), "x / weight tiles not cp.async"
    assert "wgmma.mma_async" in ptx  # Hopper's asynchronous MMA, accumulator kept in it
    loads = len(re.findall(r"ld\.global", ptx))
    assert loads <= 8, f"{loads} synchronous global loads (only scales / zeros expected)"


@pytest.mark.parametrize("form", ["join", "words"])
def test_gemv_k_loop_is_pipelined(form: str) -> None:
    from shard.kernels import int_gemv

    types = {**_PTRS, "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32",
             "K": "i32", "K_SPLIT": "i32", "stride_xm": "i32", "stride_qn": "i32",
             "stride_sn": "i32", "stride_ym": "i32"}
    consts = {"GROUP": 128, "NG": 1, "ROWS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1,
              "STAGES": 3, "HAS_BIAS": False, "USE_DOT": False, "BITS": 4, "INT_ZEROS": True,
              "X_KIND": 2, "OFFSET": True, "JOIN": form == "join", "WORDS": form == "words"}
    if form == "words":
        consts["BLOCK_N"] = 256
    ptx = _compile(int_gemv._int_gemv_kernel, types, consts, warps=8, stages=3)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx), "weight / x tiles not cp.async"
    loads = len(re.findall(r"ld\.global", ptx))
    assert loads <= 8, f"{loads} synchronous global loads (only scales / zeros expected)"
