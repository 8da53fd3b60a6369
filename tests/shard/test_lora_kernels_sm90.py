"""shard/kernels/lora.py's kernels compile for an H100 (sm_90) without a GPU, with the block
sizes and flags the shard launches them with (bf16, PDL on, 4 slots of rank 16), and keep every
value in registers: ptxas (bundled with Triton) reports no stack / local memory, i.e. no spills,
which a change of block constants could otherwise bring in unnoticed until a GPU run. The folded
expands (h read from the base GEMM's wide output) likewise."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.tools import needs

triton = pytest.importorskip("triton")
BIN = Path(os.path.dirname(triton.__file__)) / "backends" / "nvidia" / "bin"
pytestmark = [needs((BIN / "cuobjdump").is_file(), f"no cuobjdump in {BIN}"),
              pytest.mark.timeout(300)]


def _compile(fn, types: dict[str, str], constexprs: dict, num_warps: int, tmp: Path) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    cubin = tmp / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                         capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if "REG:" in line)


@pytest.mark.parametrize(("rank", "slots"), [(16, 4), (16, 9), (64, 2), (128, 4)])
def test_kernels_compile_for_sm90_without_spills(tmp_path, rank, slots):
    """Rank 16 with 4 slots: the decode target (one dot over all slots); 9 slots: the loop over
    the slots present; ranks 64 and 128: fewer splits and smaller blocks."""
    from shard.kernels import lora as k

    bf = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
          "out_ptr": "*bf16", "slots_ptr": "*i32", "part_ptr": "*fp32"}
    common = {"BLOCK_R": k._block_r(rank), "PRECISION": "tf32", "PDL": True,
              "WIDE_SLOTS": k._wide_slots(slots, rank)}
    if (rank, slots) == (16, 4):
        assert common["WIDE_SLOTS"] == 4
    splits = triton.next_power_of_2(k._max_splits(k.MAX_SPLITS, rank))
    silu_splits = triton.next_power_of_2(k._max_splits(k.SILU_MAX_SPLITS, rank))
    shrink = {key: common[key] for key in ("BLOCK_R", "PRECISION", "PDL")}
    usage = {
        "shrink": _compile(k._lora_shrink_kernel, bf, {
            **shrink, "BLOCK_M": k.SHRINK_BLOCK_M,
            "BLOCK_K": k._wide_rank_scaled(k.SHRINK_BLOCK_K, rank)},
            k.SHRINK_NUM_WARPS, tmp_path),
        "expand": _compile(k._lora_expand_kernel, bf, {
            **common, "BLOCK_M": k.EXPAND_BLOCK_M,
            "BLOCK_N": k._wide_rank_scaled(k.EXPAND_BLOCK_N, rank), "MAX_SPLITS": splits},
            k.EXPAND_NUM_WARPS, tmp_path),
        "expand_silu": _compile(k._lora_expand_silu_kernel, bf, {
            **common, "BLOCK_M": k.EXPAND_BLOCK_M,
            "BLOCK_N": k._wide_rank_scaled(k.SILU_BLOCK_N, rank), "MAX_SPLITS": silu_splits},
            k.EXPAND_NUM_WARPS, tmp_path),
        "expand_folded": _compile(k._lora_expand_folded_kernel, bf, {
            **common, "BLOCK_M": k._fold_block_m(rank),
            "BLOCK_N": k._wide_rank_scaled(k.FOLD_BLOCK_N, rank)},
            k.FOLD_NUM_WARPS, tmp_path),
        "expand_folded_silu": _compile(k._lora_expand_folded_silu_kernel, bf, {
            **common, "BLOCK_M": k._fold_block_m(rank),
            "BLOCK_N": k._wide_rank_scaled(k.FOLD_SILU_BLOCK_N, rank)},
            k.FOLD_NUM_WARPS, tmp_path),
    }  # fmt: skip
    for name, line in usage.items():
        fields = dict(f.split(":") for f in line.split() if ":" in f)
        assert fields["STACK"] == "0" and fields["LOCAL"] == "0", (name, line)
