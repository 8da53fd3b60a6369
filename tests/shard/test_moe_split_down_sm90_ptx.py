"""shard/kernels/moe_decode.py's split down launch (DecodeConfig.down_split, the fp8 table's
batch-1 entry) compiled for Hopper (sm_90) on the CPU, without a GPU, as a batch-1 step launches
it (programmatic dependent launch on, Qwen3-30B-A3B's shape: top-8, hidden 2048, intermediate
768): the launch loads its slot's expert id and the first [32, 256] fp8 K tile of its slice
BEFORE `griddepcontrol.wait` (its point: those bytes stream during the gate/up launch's tail),
triggers its dependents before the wait (pdl.py's protocol), and takes its ticket with an acq_rel
atomic at gpu scope after it; the partials the last program sums are read past the L1 (.cg).

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


# The launches' runtime parameters, as their kernels declare them (STAMPS off: stamps_ptr unread)
SPLIT_TYPES = {"inter_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16",
               "part_ptr": "*fp32", "ticket_ptr": "*i32", "topw_ptr": "*fp32", "ids_ptr": "*i32",
               "H": "i32", "I": "i32", "E": "i32", "stride_we": "i32", "stride_wn": "i32",
               "stride_se": "i32", "stride_om": "i32", "stamps_ptr": "*i64"}
ROUTE_TYPES = {"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i32", "E": "i32",
               "stride_l": "i32", "stamps_ptr": "*i64"}
SUM_TYPES = {"inter_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "out_ptr": "*bf16",
             "topw_ptr": "*fp32", "ids_ptr": "*i32", "H": "i32", "I": "i32", "E": "i32",
             "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_om": "i32",
             "stamps_ptr": "*i64"}
UP_TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "inter_ptr": "*bf16",
            "logits_ptr": "*bf16", "topw_ptr": "*fp32", "ids_ptr": "*i32", "counts_ptr": "*i64",
            "valid_ptr": "*i64", "I": "i32", "H": "i32", "E": "i32", "stride_xm": "i32",
            "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_l": "i32",
            "stamps_ptr": "*i64"}


def _split_ptx(stamps: bool = False) -> list[str]:
    from shard.kernels import moe_decode

    cfg = moe_decode.decode_config_for(8, fp8=True)
    assert cfg is not None and cfg.down_split
    stages = cfg.down_stages or cfg.stages
    consts = {"TOP_K": 8, "HAS_SCALE": True, "BLOCK_N": cfg.down_split,
              "BLOCK_K": cfg.down_block_k, "STAGES": stages, "PDL": True, "STAMPS": stamps}
    kernel = compile_sm90(moe_decode._down_split_kernel, SPLIT_TYPES, consts, cfg.down_warps, stages,
                          divisible=("H", "I"))
    return kernel.asm["ptx"].splitlines()


def test_split_down_streams_its_first_tile_before_the_wait() -> None:
    lines = _split_ptx()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    trigger = next(i for i, line in enumerate(lines)
                   if "griddepcontrol.launch_dependents" in line)
    assert trigger < wait
    before = [line for line in lines[:wait] if "ld.global" in line]
    # [32, 256] fp8 over 128 threads: 64 bytes a thread, in vectors; the id: one b32 load
    assert sum(1 for line in before if re.search(r"\.v[24]\.", line)) >= 32 * 256 // 128 // 16
    assert sum(1 for line in before if re.search(r"ld\.global[.a-z:_0-9]*\.b32 ", line)) == 1
    atom = [line for line in lines[wait:] if "atom." in line]
    assert atom and all(".gpu.acq_rel" in line for line in atom), atom
    assert any("ld.global.cg" in line for line in lines[wait:])


def test_decode_routing_launch_reduces_inside_one_warp() -> None:
    """The decode table's routing launch (DecodeConfig.route_warps, one warp): its softmax and
    top-k reductions compile to warp shuffles with no CTA barrier (43 with four warps) in the
    loop form (route_sorted off; the sorted form's layout change goes through shared memory,
    test_sorted_routing_top_k_takes_fewer_shuffles); the fp8 entry's route_trigger lets the
    gate/up launch go as it starts, the bf16 one's does not."""
    from shard.kernels import moe_decode, moe_route

    for fp8 in (True, False):
        cfg = moe_decode.decode_config_for(8, fp8=fp8)
        assert cfg is not None and not cfg.route_inside and cfg.route_trigger == fp8
        consts = {"TOP_K": 8, "K_POW2": 8, "SOFTMAX_FIRST": True, "RENORMALIZE": True,
                  "BLOCK_E": 128, "TRIGGER": cfg.route_trigger, "PDL": cfg.route_dependent,
                  "STAMPS": False, "SORTED": False}
        ptx = compile_sm90(moe_route._route_kernel, ROUTE_TYPES, consts, cfg.route_warps, 1,
                           divisible=()).asm["ptx"]
        assert cfg.route_warps == 1 and "bar.sync" not in ptx and "shfl.sync" in ptx
        assert ("griddepcontrol.launch_dependents" in ptx) == fp8


def test_fused_sum_down_loads_its_ids_before_the_wait() -> None:
    """The bf16 table's fused-sum down launch (DecodeConfig.down_early_ids): the slots' expert
    ids are loaded before `griddepcontrol.wait` (so its weight stream starts right after it) and
    again after it (the check); nothing else is read before the wait."""
    from shard.kernels import moe_decode

    cfg = moe_decode.decode_config_for(8, fp8=False)
    assert cfg is not None and not cfg.down_split and cfg.down_early_ids
    consts = {"TOP_K": 8, "K_POW2": 8, "HAS_SCALE": False, "BLOCK_N": cfg.down_block_n,
              "BLOCK_K": cfg.down_block_k, "STAGES": cfg.stages, "SLOTS_FIRST": cfg.slots_first,
              "PDL": True, "EARLY_IDS": cfg.down_early_ids, "STAMPS": False}
    lines = compile_sm90(moe_decode._down_sum_kernel, SUM_TYPES, consts, cfg.down_warps, cfg.stages,
                         divisible=("H", "I")).asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    before = [i for i in loads if i < wait]
    assert before, "no ids load before the wait"
    assert all(".b32" in lines[i] or ".u32" in lines[i] for i in before), \
        [lines[i] for i in before]
    assert any(i > wait for i in loads)


@pytest.mark.parametrize("late", [False, True])
def test_gate_up_lets_down_launch_before_or_after_its_wait(late: bool) -> None:
    """The gridded gate/up launch triggers its dependent (the down launch) at its start, or,
    with DecodeConfig.up_late_trigger, only after `griddepcontrol.wait` (the routing has
    completed by then), once either way."""
    import dataclasses

    from shard.kernels import moe_decode

    cfg = dataclasses.replace(moe_decode.decode_config_for(8, fp8=False), up_late_trigger=late)
    consts = {"TOP_K": 8, "K_POW2": 8, "ROUTE": False, "SOFTMAX_FIRST": True,
              "RENORMALIZE": True, "BLOCK_E": 128, "COUNT": True, "HAS_SCALE": False,
              "BLOCK_N": cfg.up_block_n, "BLOCK_K": cfg.up_block_k, "STAGES": cfg.stages,
              "SLOTS_FIRST": cfg.slots_first, "PDL": True,
              "TRIGGER_FIRST": not cfg.up_late_trigger, "TRIGGER_LATE": cfg.up_late_trigger,
              "STAMPS": False}
    lines = compile_sm90(moe_decode._gate_up_kernel, UP_TYPES, consts, cfg.up_warps, cfg.stages,
                         divisible=("H", "I")).asm["ptx"].splitlines()
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    assert len(wait) == 1 and len(trigger) == 1
    assert (trigger[0] > wait[0]) == late


def _stamp_order(lines: list[str], points: tuple[str, ...]) -> None:
    """One %globaltimer read per point, the first before `griddepcontrol.wait`, the second
    after it; an atomic (the split launch's ticket) between "partial stored" and "ticket taken"."""
    reads = [i for i, line in enumerate(lines) if "%globaltimer" in line]
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert len(reads) == len(points), (len(reads), points)
    assert reads[0] < wait < reads[1]
    if "ticket taken" in points:
        atom = next(i for i, line in enumerate(lines) if "atom." in line)
        at = points.index("ticket taken")
        assert reads[at - 1] < atom < reads[at]


@pytest.mark.parametrize("stamps", [True, False], ids=["stamps", "off"])
def test_expert_and_routing_launches_stamp_their_points(stamps: bool) -> None:
    """The expert and routing launches with STAMPS (shard/kernels/stamps.py, the step recorder
    of moe_b1_bench --stamps): each point a %globaltimer read, in order; without it none."""
    from shard.kernels import moe_decode, moe_route

    bf16 = moe_decode.decode_config_for(8, fp8=False)
    route = compile_sm90(moe_route._route_kernel, ROUTE_TYPES,
                         {"TOP_K": 8, "K_POW2": 8, "SOFTMAX_FIRST": True, "RENORMALIZE": True,
                          "BLOCK_E": 128, "TRIGGER": True, "PDL": True, "STAMPS": stamps,
                          "SORTED": False},
                         1, 1, divisible=()).asm["ptx"].splitlines()
    up = compile_sm90(moe_decode._gate_up_kernel, UP_TYPES,
                      {"TOP_K": 8, "K_POW2": 8, "ROUTE": False, "SOFTMAX_FIRST": True,
                       "RENORMALIZE": True, "BLOCK_E": 128, "COUNT": True, "HAS_SCALE": False,
                       "BLOCK_N": bf16.up_block_n, "BLOCK_K": bf16.up_block_k,
                       "STAGES": bf16.stages, "SLOTS_FIRST": bf16.slots_first, "PDL": True,
                       "TRIGGER_FIRST": True, "TRIGGER_LATE": False, "STAMPS": stamps},
                      bf16.up_warps, bf16.stages, divisible=("H", "I")).asm["ptx"].splitlines()
    down = compile_sm90(moe_decode._down_sum_kernel, SUM_TYPES,
                        {"TOP_K": 8, "K_POW2": 8, "HAS_SCALE": False, "BLOCK_N": bf16.down_block_n,
                         "BLOCK_K": bf16.down_block_k, "STAGES": bf16.stages,
                         "SLOTS_FIRST": bf16.slots_first, "PDL": True, "EARLY_IDS": True,
                         "STAMPS": stamps},
                        bf16.down_warps, bf16.stages, divisible=("H", "I")).asm["ptx"].splitlines()
    split = _split_ptx(stamps)
    cases = ((route, moe_route.ROUTE_STAMP_POINTS), (up, moe_decode.GATE_UP_STAMP_POINTS),
             (down, moe_decode.DOWN_SUM_STAMP_POINTS), (split, moe_decode.DOWN_SPLIT_STAMP_POINTS))
    for lines, points in cases:
        if stamps:
            _stamp_order(lines, points)
        else:
            assert not any("%globaltimer" in line for line in lines)


def test_sorted_routing_top_k_takes_fewer_shuffles() -> None:
    """DecodeConfig.route_sorted's top-k (one bitonic top-k of packed keys) compiles for the
    one-warp routing launch with fewer warp shuffles than the max / argmax rounds (133 against
    83 measured at 128 experts, top-8: 64-bit keys take two shuffles an exchange); the decode
    table's batch-1 entries use it (round 19's step A/B, benchmarks/MOE_B1.md)."""
    from shard.kernels import moe_decode, moe_route

    assert all(moe_decode.decode_config_for(8, fp8).route_sorted for fp8 in (False, True))

    counts = {}
    for sort in (False, True):
        consts = {"TOP_K": 8, "K_POW2": 8, "SOFTMAX_FIRST": True, "RENORMALIZE": True,
                  "BLOCK_E": 128, "TRIGGER": False, "PDL": False, "STAMPS": False,
                  "SORTED": sort}
        ptx = compile_sm90(moe_route._route_kernel, ROUTE_TYPES, consts, 1, 1,
                           divisible=()).asm["ptx"]
        counts[sort] = ptx.count("shfl.sync")
    assert 0 < counts[True] < counts[False], counts
