"""Compiling a Triton kernel for Hopper (sm_90) on the CPU, without a GPU, with the specialization
a real launch gets (16-byte aligned pointers, sizes and strides divisible by 16), with the ptxas
Triton ships: the sm_90 PTX / SASS tests share it."""

from __future__ import annotations

from collections.abc import Container
from typing import Any


def cuda_backend_available() -> bool:
    """Whether this Triton has its CUDA backend (ptxas): the sm_90 tests skip without it."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: no CUDA backend here
        return False
    return True


def compile_sm90(fn: Any, types: dict[str, str], consts: dict[str, object], warps: int,
                 stages: int, divisible: Container[str], unaligned: Container[str] = ()) -> Any:
    """fn compiled for sm_90 (.asm["ptx"], .asm["cubin"]): every pointer, every stride_* and
    the scalars named in `divisible` marked divisible by 16, except those named in `unaligned`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**types, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty != "constexpr" and name not in unaligned
             and (ty.startswith("*") or name in divisible or name.startswith("stride"))}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})
