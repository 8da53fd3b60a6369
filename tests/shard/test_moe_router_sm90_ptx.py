"""shard/kernels/moe_router.py's fused add + RMSNorm + router + routing launch compiled for Hopper
(sm_90) on the CPU, without a GPU, as a batch-1 step launches it (programmatic dependent launch
on, Qwen3-30B-A3B's shape): its router-weight slice is loaded BEFORE the wait on the previous
kernel (that overlap is the point of the design: the weights are no kernel's output), everything
the previous kernels wrote after it, and the per-token ticket is a GPU-scope acq_rel atomic (the
last program reads the other programs' logits). Without the routing (ROUTE False,
add_rms_norm_logits) the weights still stream before the wait and there is no atomic at all.

Compiled with the specialization a real launch gets (16-byte aligned pointers, sizes and strides
divisible by 16), with the ptxas Triton ships; skipped where Triton has no CUDA backend.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.sm90 import compile_sm90, cuda_backend_available
from tests.helpers.tools import needs

triton = pytest.importorskip("triton")


pytestmark = [needs(cuda_backend_available(), "triton without its CUDA backend (ptxas)"),
              pytest.mark.timeout(300)]


@pytest.mark.parametrize("route", [True, False], ids=["route", "logits-only"])
def test_router_weights_stream_before_the_wait_and_the_ticket_is_acq_rel(route: bool) -> None:
    from shard.kernels import moe_router

    hidden, experts, warps = 2048, 128, 4
    cfg = moe_router.default_config(hidden, experts)
    assert (cfg.rows, cfg.num_warps) == (4, warps)
    types = {"d_ptr": "*bf16", "x_ptr": "*bf16", "nw_ptr": "*bf16", "rw_ptr": "*bf16",
             "h_ptr": "*bf16", "res_ptr": "*bf16", "logits_ptr": "*bf16", "topw_ptr": "*fp32",
             "ids_ptr": "*i32", "ticket_ptr": "*i32", "H": "i32", "E": "i32", "stride_d": "i32",
             "stride_x": "i32", "stride_rw": "i32", "eps": "fp32"}
    consts = {"TOP_K": 8, "K_POW2": 8, "SOFTMAX_FIRST": True, "RENORMALIZE": True,
              "BLOCK_E": experts, "BLOCK_H": hidden, "ROWS": cfg.rows, "PDL": True,
              "OFFSET": 0.0, "ROUTE": route}
    kernel = compile_sm90(moe_router._add_norm_route_kernel, types, consts, warps, 1,
                          divisible=("H", "E"))
    lines = kernel.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    loads = [i for i, line in enumerate(lines) if re.search(r"ld\.global", line)]
    # the [ROWS, H] bf16 slice over 32 * warps threads in 16-byte vectors, all before the wait
    slice_vectors = cfg.rows * hidden * 2 // (32 * warps) // 16
    assert launch < wait
    assert sum(1 for i in loads if i < wait) >= slice_vectors, "router weights after the wait"
    # after it: delta, residual, the norm weight and (routing) the logits row read back
    # (nothing else)
    assert 0 < sum(1 for i in loads if i > wait) <= (8 if route else 6)
    atomics = [line for line in lines if "atom." in line]
    if route:
        assert len(atomics) == 1 and "atom.global.gpu.acq_rel.add" in atomics[0], atomics
    else:
        assert not atomics, atomics
    assert all(i > wait for i, line in enumerate(lines) if "st.global" in line)
