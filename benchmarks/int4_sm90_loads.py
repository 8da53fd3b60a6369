"""Compile the W4A16 GEMM candidates of the 32..128-row buckets for sm_90 on a CPU (no GPU) and
count, per candidate, the global loads left in the K loop (whether the loop is pipelined), the
loop's instructions a warp issues per K step, registers, shared memory and how many programs fit
an SM, under the Triton that is importable (this checkout's, or the GPU machine's 3.6 through
PYTHONPATH).

    PYTHONPATH=$PWD:$PWD/gen/python .venv/bin/python benchmarks/int4_sm90_loads.py
    PYTHONPATH=/tmp/t36:$PWD:$PWD/gen/python .venv/bin/python benchmarks/int4_sm90_loads.py

(/tmp/t36: `pip install --no-deps --target /tmp/t36 triton==3.6.0`, the device image's version.)

`--b1`: the batch-1 wide tiles instead (int_gemv_wide.py, Triton and inline-PTX forms,
GemvConfig.ptx): per candidate the K loop's SASS per weight, the INT-pipe share of it (LOP3 / SHF
/ PRMT / IADD3 / LEA / ISETP...: half the FP32 rate on Hopper, the first pipe to fill), barriers
and shared-memory ops in the loop (layout conversions), registers and local-memory bytes.

Columns: `ptx ld.global` (every synchronous global load in the PTX, outside the loop too; one
element of a replicated layout is one instruction here, which ptxas may merge), and in the SASS
of the K loop (the largest loop, nvdisasm): `LDG` synchronous loads, `LDGSTS` cp.async copies
(the pipelined tiles), `BAR` barriers, `SASS / weight` the loop's instructions x threads /
weights of a K step. A pipelined loop has only LDGSTS for the weight and x tiles; the scales and
zeros (2-byte values, one per row) are LDGs loaded one K step ahead into registers. `warp-step`
the loop's instructions (what one warp issues per K step: at 1-2 warps per scheduler a step's
time is about this chain's latency), `regs` ptxas's registers per thread, `smem` the kernel's
shared memory, `/SM` the programs that fit an SM by both (65536 registers, 228 KB), `mma`
wgmma or mma.sync. Split-K variants are listed apart (their loop is the split-1 tile's).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.kernels import int_gemm, int_gemm_lop3, int_gemv, int_gemv_wide
from shard.kernels.int_gemm import GemmConfig
from shard.kernels.int_gemv import GemvConfig
from tests.shard.test_int_kernels_sm90_ptx import _sass_k_loop

_PTRS = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "b_ptr": "*fp16",
         "y_ptr": "*bf16"}
_SCALARS = ("M", "N", "K", "K_SPLIT", "stride_xm", "stride_qn", "stride_sn", "stride_ym")


def compile_sm90(fn, types: dict[str, str], consts: dict[str, object], warps: int,
                 stages: int):
    """The kernel for sm_90 with a launch's specialization: pointers, N, K and strides / 16."""
    sig = {**types, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty != "constexpr" and name not in ("M", "count_ptr")
             and (ty.startswith("*") or name in ("N", "K", "K_SPLIT") or name.startswith("stride"))}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def compile_gemm(c: GemmConfig, group: int = 128):
    """int_gemm's kernel for one "dq" / "offset" candidate, bf16 x, group-128 int4."""
    types = {**_PTRS, "part_ptr": "*fp32", "count_ptr": "*i32",
             **{n: "i32" for n in _SCALARS}}
    consts = {"GROUP": group, "NG": max(c.block_k // group, 1), "BLOCK_M": c.block_m,
              "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m,
              "STAGES": c.stages, "HAS_BIAS": False, "BITS": 4, "X_SPLIT": c.x_split,
              "W_FIRST": c.w_first, "X_KIND": 2, "OFFSET": True, "DQ": c.path == "dq",
              "WORDS": c.words, "SPLIT_K": c.split_k}
    return compile_sm90(int_gemm._int_gemm_kernel, types, consts, c.warps, c.stages)


def compile_lop3z(c: GemmConfig):
    """int_gemm's "lop3z" candidate (shard/kernels/int_gemm_lop3.py), whole tiles."""
    types = {**_PTRS, "part_ptr": "*fp32", "count_ptr": "*i32",
             **{n: "i32" for n in _SCALARS}}
    consts = {"GROUP": 128, "ROWS": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
              "SPLIT_K": c.split_k, "STAGES": c.stages, "HAS_BIAS": False, "X_KIND": 2,
              "ASM": True, "EVEN": True}
    return compile_sm90(int_gemm_lop3._lop3z_kernel, types, consts, c.warps, c.stages)


def compile_lop3(c: GemmConfig):
    """int_gemm's "lop3" candidate: int_gemv's kernel with x padded to the bucket's rows."""
    types = {**_PTRS, "part_ptr": "*fp32", "count_ptr": "*i32",
             **{n: "i32" for n in _SCALARS}}
    consts = {"GROUP": 128, "NG": 1, "ROWS": c.block_m, "BLOCK_N": c.block_n,
              "BLOCK_K": c.block_k, "SPLIT_K": c.split_k, "STAGES": c.stages,
              "HAS_BIAS": False, "USE_DOT": True, "BITS": 4, "INT_ZEROS": True, "X_KIND": 2,
              "OFFSET": True, "JOIN": False, "WORDS": False, "LOP3": True, "ASM": True,
              "EVEN": True}
    return compile_sm90(int_gemv._int_gemv_kernel, types, consts, c.warps, c.stages)


def registers(ptx: str, tmp: Path) -> int:
    """ptxas -v's registers per thread for sm_90a (Triton's ptxas)."""
    path = tmp / "k.ptx"
    path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    err = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(tmp / "k.o")],
                         capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", err).group(1))


def loads(kernel, block_n: int, block_k: int, warps: int, tmp: Path) -> dict[str, float]:
    ptx = kernel.asm["ptx"]
    body = _sass_k_loop(kernel.asm["cubin"], tmp)
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in body]
    regs = registers(ptx, tmp)
    smem = kernel.metadata.shared
    return {"regs": regs, "smem_kb": smem / 1024,
            "per_sm": min(65536 // (regs * 32 * warps), 228 * 1024 // max(smem, 1)),
            "mma": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-",
            "warp_step": len(body),
            "ptx_ld_global": len(re.findall(r"ld\.global", ptx)),
            "loop_ldg": sum(o.startswith("LDG") and not o.startswith(("LDGSTS", "LDGDEPBAR"))
                            for o in ops),
            "loop_ldgsts": sum(o.startswith("LDGSTS") for o in ops),
            "loop_bar": sum(o.startswith("BAR") for o in ops),
            "per_weight": len(body) * 32 * warps / (block_n * block_k)}


def label(c: GemmConfig) -> str:
    extra = "".join(f" {f}" for f, on in (("words", c.words), ("w_first", c.w_first),
                                           ("x_split", c.x_split)) if on)
    sk = f" split-K {c.split_k}" if c.split_k > 1 else ""
    return (f"{c.path} {c.block_m}x{c.block_n}x{c.block_k} w{c.warps} st{c.stages}{extra}{sk}")


_INT_PIPE = ("LOP3", "SHF", "PRMT", "IADD3", "LEA", "ISETP", "SEL", "VIADD", "PLOP3", "IABS")


def compile_wide(c: GemvConfig, group: int = 128):
    """int_gemv_wide's kernel for one batch-1 wide candidate: bf16 x, fp16 scales, no N tail."""
    types = {**_PTRS, "part_ptr": "*fp32", "count_ptr": "*i32",
             **{n: "i32" for n in _SCALARS}}
    consts = {"GROUP": group, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "ROWS": 1,
              "SPLIT_K": c.split_k, "STAGES": c.stages, "HAS_BIAS": False, "X_KIND": 2,
              "DIAG": False, "ASM": bool(c.ptx), "EVEN": True, "PDL": c.pdl,
              "PERSIST": bool(c.persist), "TILES": 4 if c.persist else 1, "XPTX": int(c.ptx)}
    sig = {**types, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty != "constexpr" and name not in ("M", "count_ptr")
             and (ty.startswith("*") or name in ("N", "K", "K_SPLIT")
                  or name.startswith("stride"))}
    options: dict[str, int] = {"num_warps": c.warps, "num_stages": max(1, c.stages)}
    if c.maxnreg:
        options["maxnreg"] = c.maxnreg
    return triton.compile(ASTSource(fn=int_gemv_wide._wide_gemv_kernel, signature=sig,
                                    constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def resources(cubin: bytes, tmp: Path) -> tuple[int, int]:
    """(registers, local-memory stack bytes) per thread, from cuobjdump."""
    path = tmp / "r.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True,
                         text=True, check=True).stdout
    reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return int(reg.group(1)) if reg else -1, int(stack.group(1)) if stack else -1


def wide_b1(k: int) -> None:
    """Every batch-1 wide candidate for a K of k: the K loop's instruction mix."""
    from benchmarks.int4_b1_sweep import short

    tmp = Path(tempfile.mkdtemp())
    print(f"triton {triton.__version__}, sm_90, bf16 x, int4 group 128, K {k}")
    print(f"{'candidate':44s} {'SASS/w':>6s} {'INT/w':>5s} {'FFMA/w':>6s} {'BAR':>3s} "
          f"{'LDS+STS':>7s} {'regs':>4s} {'stack':>5s}")
    for c in int_gemv.candidates(1, 128, k):
        if not c.wide:
            continue
        try:
            kernel = compile_wide(c)
            body = _sass_k_loop(kernel.asm["cubin"], tmp)
            regs, stack = resources(kernel.asm["cubin"], tmp)
        except Exception as e:  # noqa: BLE001 - report and go on: a survey, not a test
            print(f"{short(c):44s} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        ops = [(i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in body]
        per = 32 * c.warps / (c.block_n * c.block_k)
        print(f"{short(c):44s} {len(body) * per:6.2f} "
              f"{sum(o in _INT_PIPE for o in ops) * per:5.2f} "
              f"{sum(o == 'FFMA' for o in ops) * per:6.2f} {ops.count('BAR'):3d} "
              f"{sum(o in ('LDS', 'STS', 'STSM') for o in ops):7d} {regs:4d} {stack:5d}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", default="32,64,128")
    ap.add_argument("--b1", type=int, default=0, metavar="K",
                    help="survey the batch-1 wide tiles for this K instead (e.g. 4096)")
    args = ap.parse_args()
    if args.b1:
        wide_b1(args.b1)
        return
    seen: dict[str, GemmConfig] = {}
    for m in (int(b) for b in args.buckets.split(",")):
        for c in int_gemm.candidates(m, 128, 4096):
            if c.path != "cublas":
                seen.setdefault(label(c), c)
    tmp = Path(tempfile.mkdtemp())
    print(f"triton {triton.__version__}, sm_90, bf16 x, int4 group 128")
    print(f"{'candidate':48s} {'ptx ld.global':>13s} {'loop LDG':>8s} {'LDGSTS':>6s} "
          f"{'BAR':>3s} {'SASS/weight':>11s} {'warp-step':>9s} {'regs':>4s} {'smem':>6s} "
          f"{'/SM':>3s} mma")
    for name, c in seen.items():
        try:
            k = (compile_lop3(c) if c.path == "lop3" else compile_lop3z(c)
                 if c.path == "lop3z" else compile_gemm(c))
            r = loads(k, c.block_n, c.block_k, c.warps, tmp)
        except Exception as e:  # noqa: BLE001 - report and go on: a survey, not a test
            print(f"{name:48s} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"{name:48s} {r['ptx_ld_global']:13d} {r['loop_ldg']:8d} {r['loop_ldgsts']:6d} "
              f"{r['loop_bar']:3d} {r['per_weight']:11.2f} {r['warp_step']:9d} {r['regs']:4d} "
              f"{r['smem_kb']:5.0f}K {r['per_sm']:3d} {r['mma']}", flush=True)


if __name__ == "__main__":
    main()
