"""shard/kernels/moe_decode.py's persistent gate/up launch (DecodeConfig.up_stream) compiled for
Hopper (sm_90) on the CPU, without a GPU, as benchmarks/moe_b1_bench.py's `old:up-stream`
variants launch it at batch 1 (programmatic dependent launch on, routing statistics on,
Qwen3-30B-A3B's shape: top-8, hidden 2048, intermediate 768):

- the flattened (item, K tile) loop, its epilogue inside, is software-pipelined: the weight
  tiles (and x chunks) go global -> shared memory by cp.async (16 bytes each) into STAGES - 1
  buffers, the prologue issues STAGES - 1 tiles, each iteration waits for one and issues the
  next, and the epilogue's stores run inside the loop (Triton 3.6, the GPU machines', and 3.9
  compile it alike);
- the launch triggers its dependents, then waits (griddepcontrol.wait) before its first load
  (the ids: the routing launch's output) and before any weight copy.

Compiled with the specialization a real launch gets (16-byte aligned pointers, sizes and strides
divisible by 16), with the ptxas Triton ships; skipped where Triton has no CUDA backend.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

from tests.helpers.sm90 import compile_sm90, cuda_backend_available
from tests.helpers.tools import needs

triton = pytest.importorskip("triton")

pytestmark = [needs(cuda_backend_available(), "triton without its CUDA backend (ptxas)"),
              pytest.mark.timeout(300)]

THREADS_PER_WARP = 32


@functools.cache
def _compiled(fp8: bool, variant: str) -> tuple[Any, Any]:
    """(the bench variant's DecodeConfig, its stream kernel compiled for sm_90): once a module."""
    from benchmarks.moe_b1_bench import up_stream_configs
    from shard.kernels import moe_decode

    cfg = dict(up_stream_configs(8, fp8))[variant]
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32",
             "inter_ptr": "*bf16", "ids_ptr": "*i32", "counts_ptr": "*i64", "valid_ptr": "*i64",
             "S": "i32", "I": "i32", "H": "i32", "E": "i32", "stride_xm": "i32",
             "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32"}
    consts = {"TOP_K": 8, "SLOTS_POW2": moe_decode.DECODE_MAX_SLOTS, "COUNT": True,
              "HAS_SCALE": fp8, "BLOCK_N": cfg.up_block_n, "BLOCK_K": cfg.up_block_k,
              "STAGES": cfg.stages, "SLOTS_FIRST": cfg.slots_first, "PDL": True}
    kernel = compile_sm90(moe_decode._gate_up_stream_kernel, types, consts, cfg.up_warps,
                          cfg.stages, divisible=("I", "H"))
    return cfg, kernel


@pytest.mark.parametrize(("fp8", "variant"), [
    (False, "old:up-stream"), (True, "old:up-stream"), (False, "old:up-stream-8x2048-st4"),
])
def test_stream_pipelines_its_weight_tiles_through_shared_memory(fp8: bool, variant: str) -> None:
    cfg, kernel = _compiled(fp8, variant)
    stages, dtype = cfg.stages, "f8E4M3FN" if fp8 else "bf16"
    buffers = re.findall(r"ttg\.local_alloc .*memdesc<(\d+)x(\d+)x(\d+)x" + dtype,
                         kernel.asm["ttgir"])
    assert buffers == [(str(stages - 1), str(cfg.up_block_n), str(cfg.up_block_k))], buffers
    lines = kernel.asm["ptx"].splitlines()
    loop = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
    # A thread's 16-byte copies a K tile: the weight tile [BLOCK_N, BLOCK_K] and the bf16 x
    # chunk [BLOCK_K] over the program's threads (Triton 3.9 gives the weights' the evict_first
    # L2 hint, 3.6 none).
    threads = cfg.up_warps * THREADS_PER_WARP
    per_tile = (cfg.up_block_n * cfg.up_block_k * (1 if fp8 else 2) + cfg.up_block_k * 2) \
        // threads // 16
    copies = [i for i, line in enumerate(lines)
              if re.search(r"cp\.async\.cg\.shared\.global(\.L2::cache_hint)? .*0x10", line)]
    assert sum(i < loop for i in copies) == (stages - 1) * per_tile  # the prologue's tiles
    assert sum(i > loop for i in copies) == per_tile  # each iteration: the next tile
    assert any("cp.async.wait_group" in line for line in lines[loop:])
    assert any("st.global" in line for line in lines[loop:])  # the items' epilogues


def test_stream_waits_for_the_routing_before_its_first_load() -> None:
    _, kernel = _compiled(False, "old:up-stream")
    lines = kernel.asm["ptx"].splitlines()
    trigger = next(i for i, line in enumerate(lines)
                   if "griddepcontrol.launch_dependents" in line)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    first = next(i for i, line in enumerate(lines)
                 if re.search(r"\b(ld\.global|cp\.async\.c[ag]|atom)\.", line))
    assert trigger < wait < first
    assert re.search(r"ld\.global(\.[a-z0-9:_]+)*\.b32 ", lines[first]), lines[first]  # an id
