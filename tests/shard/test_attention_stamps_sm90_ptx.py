"""The decode attention's stamps (shard/kernels/stamps.py) compiled for Hopper (sm_90) on the CPU:
with STAMPS one `%globaltimer` read per point a program passes, in STAMP_POINTS' order around the
PDL wait and the split-merge ticket; without it none at all (the diagnosis costs the serving
kernel nothing). Skipped where Triton has no CUDA backend."""

from __future__ import annotations

import pytest

from tests.helpers.sm90 import compile_sm90, cuda_backend_available
from tests.helpers.tools import needs

triton = pytest.importorskip("triton")

pytestmark = [needs(cuda_backend_available(), "triton without its CUDA backend (ptxas)"),
              pytest.mark.timeout(300)]


def _compile_split_kernel(stamps: bool, one_split: bool, merge_by_split: bool = False):
    from shard.kernels import attention_decode as ad

    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*fp32",
                "lse_ptr": "*fp32", "final_ptr": "*bf16", "ticket_ptr": "*i32",
                "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
                "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}
    ints = ["stride_q_seq", "stride_q_head", "stride_k_seq", "stride_k_head", "stride_v_seq",
            "stride_v_head", "stride_cos", "stride_bt", "stride_slot", "stride_out_seq",
            "stride_out_head", "stride_out_split", "stride_final_seq", "stride_final_head"]
    types = {**pointers, **dict.fromkeys(ints, "i32"), "sm_scale_log2": "fp32", "window": "i32",
             "warm_ptr": "*i8", "warm_bytes": "i32", "qn_w_ptr": "*bf16", "kn_w_ptr": "*bf16",
             "norm_eps": "fp32", "stamps_ptr": "*i64", "NUM_SPLITS": "i32"}
    assert list(types) == list(ad._decode_split_kernel.arg_names)[:len(types)]
    # Qwen3-30B-A3B's batch-1 launch: GQA group 8, head_dim 128, fused rotary + q/k norms
    consts = {"GROUP": 8, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64,
              "PAGE": 16, "ONE_SPLIT": one_split, "SCALED": False, "FUSED_ROTARY": True,
              "HALF": 64, "HALF_PAD": 64, "FP8_MAX": 0.0, "PDL": True, "EARLY_TILE": True,
              "Q_IN_REGISTERS": True, "GROUP_P2": 8, "SPLITS_PAD": 1 if one_split else 16,
              "SOFTCAP": 0.0, "WARM": False, "QK_NORM": True, "NORM_OFFSET": 0.0,
              "STAMPS": stamps, "MERGE_BY_SPLIT": merge_by_split}
    return compile_sm90(ad._decode_split_kernel, types, consts, 4, 3, divisible=())


@pytest.mark.parametrize(("one_split", "merge_by_split"), [(False, False), (False, True),
                                                          (True, False)],
                         ids=["splits", "splits-merge-by-split", "one-split"])
def test_stamps_in_point_order_around_the_wait_and_ticket(one_split: bool,
                                                          merge_by_split: bool) -> None:
    lines = _compile_split_kernel(True, one_split, merge_by_split).asm["ptx"].splitlines()
    reads = [i for i, line in enumerate(lines) if "%globaltimer" in line]
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    atomics = [i for i, line in enumerate(lines) if "atom." in line]
    # start, after the wait, q ready, tiles attended, then partials stored, ticket taken,
    # merged (several splits) or the output stored (one split)
    assert len(reads) == (5 if one_split else 7), len(reads)
    assert reads[0] < wait < reads[1]
    if not one_split:
        assert len(atomics) == 1 and reads[4] < atomics[0] < reads[5]


def test_no_stamps_no_timer() -> None:
    ptx = _compile_split_kernel(False, False).asm["ptx"]
    assert "%globaltimer" not in ptx

