"""The W4A16 kernels' fast variants compiled for Hopper (sm_90) on the CPU, without a GPU: their K
loops must be software-pipelined, every tile streamed by cp.async, and no load left in the loop
that waits a full memory round trip each step.

Why: the first W4A16 kernels ran at 24 % of copy bandwidth (GEMV) and 0.15x bf16 (GEMM) on an
H100 (benchmarks/raw/round10/int4/): x's even / odd columns were read with stride-2 loads, too
narrow for cp.async, so every K step waited on synchronous global loads (38-80 ld.global in the
compiled loop). The "dq" GEMM and the "join" / "words" GEMV load x's tile contiguously and the
scales one step ahead; what is left as ld.global are those scale / zero loads (<= 8
instructions; the dq GEMM's counted in the loop's SASS, see its test).

Runs under whichever Triton is importable (CI: this checkout's); the GPU machine's 3.6 too:
PYTHONPATH=/tmp/t36:$PWD:$PWD/gen/python .venv/bin/python -m pytest tests/shard/test_int_kernels_sm90_ptx.py
(benchmarks/INT_KERNELS.md says how to install it there and what differs).

Compiled with the specialization a real launch gets (16-byte aligned pointers, sizes and
strides divisible by 16), with the ptxas Triton ships; skipped where Triton has no CUDA backend.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.sm90 import compile_sm90, cuda_backend_available
from tests.helpers.tools import needs

triton = pytest.importorskip("triton")


pytestmark = [needs(cuda_backend_available(), "triton without its CUDA backend (ptxas)"),
              pytest.mark.timeout(300)]


def _compile(fn, types: dict[str, str], consts: dict[str, object], warps: int, stages: int) -> str:
    """PTX of fn for sm_90 with a launch's specialization: pointers, N, K and strides / 16."""
    return _compile_kernel(fn, types, consts, warps, stages).asm["ptx"]


def _compile_kernel(fn, types: dict[str, str], consts: dict[str, object], warps: int,
                    stages: int):
    """fn compiled for sm_90 (PTX, cubin) with a launch's specialization."""
    return compile_sm90(fn, types, consts, warps, stages, divisible=("N", "K", "K_SPLIT"),
                        unaligned=("M", "count_ptr"))


_PTRS = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "b_ptr": "*fp16",
         "y_ptr": "*bf16"}
_SPLIT_PTRS = {"part_ptr": "*fp32", "count_ptr": "*i32"}
_GEMM_SCALARS = {n: "i32" for n in ("M", "N", "K", "K_SPLIT", "stride_xm", "stride_qn",
                                    "stride_sn", "stride_ym")}


def _loop_loads(body: list[str]) -> tuple[int, int]:
    """(synchronous global loads, cp.async copies) among a K loop's SASS instructions."""
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in body]
    sync = sum(o.startswith("LDG") and not o.startswith(("LDGSTS", "LDGDEPBAR")) for o in ops)
    return sync, sum(o.startswith("LDGSTS") for o in ops)


@pytest.mark.parametrize("words", [False, True])
def test_dq_gemm_k_loop_is_pipelined(tmp_path, words: bool) -> None:
    """The "dq" GEMM (the 32..128-row buckets): the weight and x tiles cp.async-pipelined, the
    accumulator in wgmma, and in the compiled K loop (SASS, after ptxas) only the scale / zero
    loads one step ahead as synchronous loads. Counted in SASS, not
    PTX: Triton 3.6 (the GPU machine's) loads the [BLOCK_N, 1] scales in the tile's replicated
    layout, 16-256 identical ld.global per thread in the PTX, which ptxas merges into the same
    2 LDG as 3.9's (benchmarks/int4_sm90_loads.py, benchmarks/INT_KERNELS.md)."""
    from shard.kernels import int_gemm

    types = {**_PTRS, **_SPLIT_PTRS, **_GEMM_SCALARS}
    consts = {"GROUP": 128, "NG": 1, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
              "STAGES": 3, "HAS_BIAS": False, "BITS": 4, "X_SPLIT": False, "W_FIRST": False,
              "X_KIND": 2, "OFFSET": True, "DQ": True, "WORDS": words, "SPLIT_K": 1}
    kernel = _compile_kernel(int_gemm._int_gemm_kernel, types, consts, warps=4, stages=3)
    ptx = kernel.asm["ptx"]
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx), "x / weight tiles not cp.async"
    assert "wgmma.mma_async" in ptx  # Hopper's asynchronous MMA, accumulator kept in it
    sync, copies = _loop_loads(_sass_k_loop(kernel.asm["cubin"], tmp_path))
    # per thread: x's 64 x 128 bf16 = 8 16-byte copies, the weights' 128 x 64 B in 4-8 copies
    assert copies >= 12, f"{copies} cp.async copies in the K loop"
    assert sync <= 2, f"{sync} synchronous global loads in the K loop"


@pytest.mark.parametrize("form", ["join", "words"])
def test_gemv_k_loop_is_pipelined(form: str) -> None:
    from shard.kernels import int_gemv

    types = {**_PTRS, **_SPLIT_PTRS, **_GEMM_SCALARS}
    consts = {"GROUP": 128, "NG": 1, "ROWS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1,
              "STAGES": 3, "HAS_BIAS": False, "USE_DOT": False, "BITS": 4, "INT_ZEROS": True,
              "X_KIND": 2, "OFFSET": True, "JOIN": form == "join", "WORDS": form == "words",
              "LOP3": False, "ASM": False, "EVEN": False}
    if form == "words":
        consts["BLOCK_N"] = 256
    ptx = _compile(int_gemv._int_gemv_kernel, types, consts, warps=8, stages=3)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx), "weight / x tiles not cp.async"
    loads = len(re.findall(r"ld\.global", ptx))
    assert loads <= 8, f"{loads} synchronous global loads (only scales / zeros expected)"


# ------------------------------------------------------------------ the lop3 GEMV (issue 40)


def _sass_k_loop(cubin: bytes, tmp_path) -> list[str]:
    """The instructions of the compiled kernel's largest loop (the pipelined K loop): from the
    target of the longest backward branch to the branch (nvdisasm, bundled with Triton)."""
    import subprocess
    from pathlib import Path

    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    text = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout
    instrs: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        label = re.match(r"^\.(L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if ins:
            addr = int(ins.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, ins.group(2)))
    best: list[str] = []
    for addr, ins in instrs:
        target = re.search(r"BRA\b.*`\(\.(L_x_\d+)\)", ins)
        if target and labels.get(target.group(1), addr) < addr:
            body = [i for a, i in instrs if labels[target.group(1)] <= a <= addr]
            best = max(best, body, key=len)
    return best


def _gemv_per_weight(tmp_path, form: str, x_dtype: str, block_n: int, warps: int,
                     rows: int = 16, stages: int = 3) -> tuple[float, str]:
    """SASS instructions per weight in the GEMV's K loop, and the PTX, for a 128-feature tile
    of group-128 int4 weights."""
    from shard.kernels import int_gemv

    types = {**_PTRS, "x_ptr": x_dtype, "y_ptr": x_dtype, **_SPLIT_PTRS, **_GEMM_SCALARS}
    lop3 = form == "lop3"
    consts = {"GROUP": 128, "NG": 1, "ROWS": rows if lop3 else 1, "BLOCK_N": block_n,
              "BLOCK_K": 128, "SPLIT_K": 1, "STAGES": stages, "HAS_BIAS": False,
              "USE_DOT": lop3,
              "BITS": 4, "INT_ZEROS": True, "X_KIND": 1 if x_dtype == "*fp16" else 2,
              "OFFSET": True, "JOIN": False, "WORDS": form == "words", "LOP3": lop3, "ASM": lop3,
              # Llama shapes: no N / K tail, unmasked loads (int4_gemv passes EVEN there)
              "EVEN": lop3}
    kernel = _compile_kernel(int_gemv._int_gemv_kernel, types, consts, warps, stages)
    body = _sass_k_loop(kernel.asm["cubin"], tmp_path)
    return len(body) * 32 * warps / (block_n * 128), kernel.asm["ptx"]


@pytest.mark.parametrize("x_dtype", ["*bf16", "*fp16"])
def test_lop3_gemv_unpacks_with_prmt_lop3_and_streams(tmp_path, x_dtype: str) -> None:
    """The lop3 GEMV (1..16 rows on the tensor cores, weights unpacked by inline PTX) compiles for
    sm_90 with the unpack as PRMT + LOP3, its tiles streamed by cp.async, and fewer SASS
    instructions per weight than the batch-1 word tile (~5.0 with 4 warps; the lop3 tile ~3.6,
    ~1 of them the unpack): at ~4.9 instructions per weight an H100's issue rate equals its
    HBM rate for int4 bytes, so the word tile is ALU-bound and this one need not be."""
    per_weight, ptx = _gemv_per_weight(tmp_path, "lop3", x_dtype, 128, 4)
    assert ptx.count("prmt.b32") >= 16 and ptx.count("lop3.b32") >= 16, "no inline PTX unpack"
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx), "weight / x tiles not cp.async"
    assert len(re.findall(r"ld\.global", ptx)) <= 8
    assert per_weight <= 4.0, f"{per_weight:.2f} SASS instructions per weight in the K loop"
    if x_dtype == "*bf16":
        words, _ = _gemv_per_weight(tmp_path, "words", x_dtype, 256, 4)
        assert per_weight < 0.8 * words, (per_weight, words)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b, a}."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    return sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of the truth table
    lut (the PTX convention: a = 0xF0, b = 0xCC, c = 0xAA, so (a & b) | c = 0xEA)."""
    out = 0
    for i in range(32):
        idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


@pytest.mark.parametrize("magic", [0x43004300, 0x64006400])
def test_lop3_unpack_asm_equals_the_interpreter_form(magic: int) -> None:
    """The inline PTX (int_tiles.unpack_asm), executed instruction by instruction in Python,
    gives what the interpreter's form computes (which the interpreter tests check against the
    dequantized weight): output j's low half = OFF + (element a's byte j & 0xF), high half the
    same of element b. The GPU run checks the compiled kernel itself (benchmarks/int4_kernels.py)."""
    import random

    from shard.kernels.int_tiles import unpack_asm

    asm = unpack_asm(magic)
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.getrandbits(32), rng.getrandbits(32)
        regs = {"$4": a, "$5": b}
        for line in asm.splitlines():
            op = re.match(r"(prmt|lop3)\.b32 (\S+), (\S+), (\S+), (\S+)(?:, (\S+))?;", line)
            if not op:
                continue
            args = [regs[x] if x in regs else int(x, 0) for x in op.group(3, 4, 5)]
            regs[op.group(2)] = (_prmt(*args) if op.group(1) == "prmt"
                                 else _lop3(*args, int(op.group(6), 0)))
        for j in range(4):
            lo = ((a >> (8 * j)) & 0xF) | (magic & 0xFFFF)
            hi = ((b >> (8 * j)) & 0xF) | (magic & 0xFFFF)
            assert regs[f"${j}"] == lo | (hi << 16), (hex(a), hex(b), j)


def test_lop3_gemm_tile_at_64_rows(tmp_path) -> None:
    """int_gemm's "lop3" path (the same tile with x padded to the 64-row bucket): pipelined, and
    within the issue budget per weight (~4.9 on an H100 at HBM rate) where the per-group fp32
    rescale of 64 rows weighs most."""
    per_weight, ptx = _gemv_per_weight(tmp_path, "lop3", "*bf16", 256, 8, rows=64)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx)
    assert len(re.findall(r"ld\.global", ptx)) <= 8
    assert per_weight <= 4.6, f"{per_weight:.2f} SASS instructions per weight in the K loop"


def test_lop3_gemv_register_prefetch_form(tmp_path) -> None:
    """Stages 1: the next tile's words and x loaded into registers one step ahead (no shared-
    memory round trip of the weights): 16-byte vector loads, and fewer instructions per weight
    than the cp.async form (~2.5 against ~2.8 at 256 x 128 / 8 warps)."""
    per_weight, ptx = _gemv_per_weight(tmp_path, "lop3", "*bf16", 256, 8, stages=1)
    piped, _ = _gemv_per_weight(tmp_path, "lop3", "*bf16", 256, 8, stages=3)
    assert re.search(r"ld\.global[.\w:]*\.v4\.b32", ptx), "weights not read in 16-byte vectors"
    assert per_weight < piped, (per_weight, piped)


# --------------------------------------------- the multi-group tiles (int_gemv_wide.py, issue 40)


def _wide_compile(tmp_path, diag: bool, block_n: int, block_k: int, warps: int,
                  stages: int = 1, persist: bool = False,
                  ptx: int = 0) -> tuple[float, str, list[str]]:
    """SASS instructions per weight in the K loop, the PTX and the loop's SASS, of a wide / diag tile of
    group-128 int4 weights at batch 1, launched as a programmatic dependent."""
    from shard.kernels import int_gemv_wide

    types = {**_PTRS, **_SPLIT_PTRS, **_GEMM_SCALARS}
    consts = {"GROUP": 128, "BLOCK_N": block_n, "BLOCK_K": block_k,
              "ROWS": int_gemv_wide.diag_rows(1, block_k, 128) if diag else 1, "SPLIT_K": 1,
              "STAGES": stages, "HAS_BIAS": False, "X_KIND": 2, "DIAG": diag,
              "ASM": diag or bool(ptx), "EVEN": True, "PDL": True, "PERSIST": persist,
              "TILES": 4, "XPTX": ptx}
    kernel = _compile_kernel(int_gemv_wide._wide_gemv_kernel, types, consts, warps, stages)
    body = _sass_k_loop(kernel.asm["cubin"], tmp_path)
    return len(body) * 32 * warps / (block_n * block_k), kernel.asm["ptx"], body


@pytest.mark.parametrize(("diag", "block_n", "block_k", "warps", "persist"),
                         [(False, 16, 1024, 4, False), (True, 128, 256, 8, False),
                          (False, 16, 1024, 4, True), (True, 128, 256, 8, True)])
def test_multi_group_tiles_load_wide_rows_before_the_pdl_wait(tmp_path, diag: bool,
                                                              block_n: int, block_k: int,
                                                              warps: int, persist: bool) -> None:
    """The wide (CUDA cores) and diag (tensor cores) tiles read 512 B / 128 B of each row per K
    step in 16-byte vectors, issue the first tile's weight loads before waiting on the previous
    kernel (PDL: the ramp overlaps its tail), and stay within the issue budget per weight
    (~4.9 SASS instructions per int4 weight at an H100's HBM rate; measured when written, Triton
    3.9 / 3.6: wide 16 x 1024 ~4.7 / 5.1, diag 128 x 256 ~2.9 / 2.9). The persistent form's
    loop also holds each unit's finish (run once per unit, of 4 tiles here): wide ~5.7 / 6.0."""
    per_weight, ptx, body = _wide_compile(tmp_path, diag, block_n, block_k, warps,
                                          persist=persist)
    vectors = [mo.start() for mo in re.finditer(r"ld\.global[.\w:]*\.v4\.b32", ptx)]
    # the weights (evict-first) in 16-byte loads in the K loop: Triton 3.6 read them as 4-byte
    # scalars when the word offsets' contiguity was not stated (~5.6 instead of ~3.6 per weight)
    weight_loads = [i for i in body if "LDG.E.EF" in i]
    assert weight_loads and all(".128" in i for i in weight_loads), weight_loads
    wait = ptx.find("griddepcontrol.wait")
    assert ptx.find("griddepcontrol.launch_dependents") >= 0 and wait >= 0, "not a PDL kernel"
    assert vectors[0] < wait, "the first weight tile is loaded only after the PDL wait"
    if diag:
        assert ptx.count("prmt.b32") >= 16 and ptx.count("lop3.b32") >= 16, "no PRMT/LOP3 unpack"
        assert "wgmma.mma_async" in ptx or "mma.sync" in ptx
    bound = 3.6 if diag else 6.5 if persist else 5.5
    assert per_weight <= bound, f"{per_weight:.2f} SASS per weight"


# ------------------------------------ the 32 / 64-row buckets: lop3z and split-K dq (issue 40)


def _lop3z_compile(tmp_path, block_n: int, warps: int, split_k: int = 4, rows: int = 64):
    """int_gemm_lop3's kernel for sm_90 (bf16 x, group-128 int4, whole tiles): (SASS of the K
    loop, PTX)."""
    from shard.kernels import int_gemm_lop3

    consts = {"GROUP": 128, "ROWS": rows, "BLOCK_N": block_n, "BLOCK_K": 128,
              "SPLIT_K": split_k, "STAGES": 3, "HAS_BIAS": False, "X_KIND": 2, "ASM": True,
              "EVEN": True}
    kernel = _compile_kernel(int_gemm_lop3._lop3z_kernel, {**_PTRS, **_SPLIT_PTRS,
                                                           **_GEMM_SCALARS}, consts, warps, 3)
    return _sass_k_loop(kernel.asm["cubin"], tmp_path), kernel.asm["ptx"]


def test_lop3z_tile_has_no_row_sums_and_fewer_instructions(tmp_path) -> None:
    """The lop3z tile (int_gemm path "lop3z", 32 / 64 rows): the zero point subtracted from each
    unpacked pair by one packed bf16 FMA in the inline PTX (ptxas: HADD2.BF16_V2), no row sums
    of x in the K loop (the lop3 tile's shuffle reduction: ~32 SHFL and ~90 FADD a warp-step at
    64 x 64), wgmma with the unpacked tile from registers, everything streamed by cp.async, and
    under ~65 % of the lop3 tile's instructions a warp-step (Triton 3.6: 302 vs 508; 3.9 about
    the same), the 2-byte scale / zero loads one step ahead the only synchronous ones."""
    body, ptx = _lop3z_compile(tmp_path, 64, 4)
    lop3_per_weight, _ = _gemv_per_weight(tmp_path, "lop3", "*bf16", 64, 4, rows=64)
    lop3_steps = lop3_per_weight * 64 * 128 / (32 * 4)  # instructions a warp issues per K step
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in body]
    assert ptx.count("fma.rn.bf16x2") >= 4 and ptx.count("lop3.b32") >= 4, "no fused unpack"
    assert "wgmma.mma_async" in ptx
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx)
    assert not any(o.startswith("SHFL") for o in ops), "x's row sums are back in the loop"
    assert sum(o.startswith(("HADD2.BF16", "HFMA2.BF16")) for o in ops) >= 16
    sync, copies = _loop_loads(body)
    assert copies >= 8 and sync <= 4, (sync, copies)
    assert len(body) < 0.65 * lop3_steps, (len(body), lop3_steps)


def test_dq_split_k_compiles_with_the_finish_outside_the_loop(tmp_path) -> None:
    """The split-K dq tile (64 x 64 x 128, 8 warps): still pipelined
    (cp.async tiles, wgmma, <= 2 synchronous loads in the loop: the scales), the finish's
    acq_rel counter after the loop, and 8 warps halve the per-warp chain of a K step
    (Triton 3.6: 294 SASS instructions a warp-step against 472 at 4 warps)."""
    from shard.kernels import int_gemm

    def compile_dq(warps: int, split_k: int):
        consts = {"GROUP": 128, "NG": 1, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128,
                  "GROUP_M": 8, "STAGES": 3, "HAS_BIAS": False, "BITS": 4, "X_SPLIT": False,
                  "W_FIRST": False, "X_KIND": 2, "OFFSET": True, "DQ": True, "WORDS": True,
                  "SPLIT_K": split_k}
        return _compile_kernel(int_gemm._int_gemm_kernel, {**_PTRS, **_SPLIT_PTRS,
                                                           **_GEMM_SCALARS}, consts, warps, 3)

    split = compile_dq(8, 4)
    ptx = split.asm["ptx"]
    body = _sass_k_loop(split.asm["cubin"], tmp_path)
    assert "wgmma.mma_async" in ptx and re.search(r"atom\.[\w.]*acq_rel[\w.]*\.add", ptx)
    sync, copies = _loop_loads(body)
    assert copies >= 4 and sync <= 2, (sync, copies)
    assert not any("ATOM" in i or "RED" in i.split()[0] for i in body), "finish inside the loop"
    four = _sass_k_loop(compile_dq(4, 1).asm["cubin"], tmp_path)
    assert len(body) < 0.75 * len(four), (len(body), len(four))


def _fma_x2(a: int, b: int, c: int, dtype) -> int:
    """PTX fma.rn.{bf16x2,f16x2}: per 16-bit half, a * b + c rounded once to the dtype."""
    import torch

    def halves(v: int) -> torch.Tensor:
        raw = torch.tensor([v & 0xFFFF, (v >> 16) & 0xFFFF], dtype=torch.int32).to(torch.int16)
        return raw.view(dtype).double()

    d = (halves(a) * halves(b) + halves(c)).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(d[0]) | int(d[1]) << 16


@pytest.mark.parametrize("x_kind", [1, 2])
def test_lop3z_unpack_asm_gives_q_minus_z(x_kind: int) -> None:
    """int_gemm_lop3's inline PTX, executed instruction by instruction in Python (PRMT, LOP3, MOV,
    the packed FMA): output j's low half = q - z of element a's byte j (its zero from $6's low
    half), the high half the same of element b ($7), exactly, in bf16 / fp16. The interpreter
    tests cover the kernel's Triton form; the GPU run checks the compiled kernel."""
    import random

    import torch

    from shard.kernels.int_gemm_lop3 import unpack_sub_asm

    dtype, magic, one, fma, off = ((torch.float16, 0x64006400, 0x3C003C00, "fma.rn.f16x2", 1024)
                                   if x_kind == 1 else
                                   (torch.bfloat16, 0x43004300, 0x3F803F80, "fma.rn.bf16x2", 128))
    asm = unpack_sub_asm(magic, one, fma)

    def bits(v: float) -> int:  # a 16-bit pattern in an int32 register, as the kernel passes nz
        return int(torch.tensor([v], dtype=dtype).view(torch.int16).to(torch.int32)[0])

    rng = random.Random(0)
    for _ in range(100):
        a, b = rng.getrandbits(32), rng.getrandbits(32)
        za, zb = rng.randrange(16), rng.randrange(16)
        regs = {"$4": a, "$5": b, "$6": bits(-(off + za)) & 0xFFFFFFFF,
                "$7": bits(-(off + zb)) & 0xFFFFFFFF}
        for line in asm.splitlines():
            op = re.match(r"(prmt|lop3|mov|fma)\.\S+ (\S+), (\S+)(?:, (\S+))?(?:, (\S+))?(?:, (\S+))?;",
                          line)
            if not op:
                continue
            args = [regs[x] if x in regs else int(x, 0) for x in op.groups()[2:] if x is not None]
            name = op.group(1)
            regs[op.group(2)] = (_prmt(*args[:3]) if name == "prmt"
                                 else _lop3(*args) if name == "lop3" else args[0] if name == "mov"
                                 else _fma_x2(*args, dtype))
        for j in range(4):
            lo = torch.tensor([regs[f"${j}"] & 0xFFFF], dtype=torch.int32).to(torch.int16)
            hi = torch.tensor([regs[f"${j}"] >> 16], dtype=torch.int32).to(torch.int16)
            assert float(lo.view(dtype)[0]) == ((a >> (8 * j)) & 0xF) - za, (hex(a), j)
            assert float(hi.view(dtype)[0]) == ((b >> (8 * j)) & 0xF) - zb, (hex(b), j)


@pytest.mark.parametrize(("block_n", "block_k", "warps", "stages"),
                         [(16, 1024, 4, 0), (8, 2048, 4, 0), (16, 1024, 4, 1)])
def test_ptx_wide_tile_has_no_layout_conversion_in_its_k_loop(tmp_path, block_n: int,
                                                             block_k: int, warps: int,
                                                             stages: int) -> None:
    """The wide tile's inline-PTX form (GemvConfig.ptx): x's planes and the scales are loaded in
    the words' layout, so its K loop has no barrier and no shared-memory traffic (the Triton
    form converts them through shared memory: 22-28 barriers a K step under Triton 3.6), x is
    one 16-byte load per word column, each nibble one LOP3, and the loop stays under ~4.2 SASS
    per weight (measured when written, Triton 3.9 / 3.6: 16 x 1024 and 8 x 2048 3.56 / 3.61,
    with the next tile prefetched, stages 1, 16 x 1024 3.79 / 3.88; the Triton form 4.7 / 4.8
    and 4.8 / 5.2). The first tile's weights are loaded before the PDL wait, which sits in the
    same asm statement as the first x load."""
    per_weight, ptx, body = _wide_compile(tmp_path, False, block_n, block_k, warps,
                                          stages=stages, ptx=1)
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in body]
    assert not [o for o in ops if o.startswith(("BAR", "STS", "LDS"))], "layout conversion"
    weight_loads = [i for i in body if "LDG.E.EF" in i]
    assert weight_loads and all(".128" in i for i in weight_loads), weight_loads
    # x: one 16-byte load per word column a thread holds, shared by its rows (>= 2 here): at
    # most half a load per word a thread holds (4 per weight load)
    x_loads = [i for i in body if "LDG.E.128" in i]
    assert x_loads and len(x_loads) <= 2 * len(weight_loads), (x_loads, weight_loads)
    lop3 = sum(o.startswith("LOP3") for o in ops)
    assert lop3 * 32 * warps <= 1.2 * block_n * block_k, f"{lop3} LOP3: unpack not fused"
    wait = ptx.find("griddepcontrol.wait")
    first = re.search(r"ld\.global\.L1::evict_first[.\w:]*\.v4\.b32", ptx)
    assert first and first.start() < wait, "the first weight tile is loaded only after the PDL wait"
    assert per_weight <= 4.2 + 0.2 * stages, f"{per_weight:.2f} SASS per weight"


@pytest.mark.parametrize(("block_n", "block_k", "stages"), [(16, 1024, 0), (16, 1024, 1)])
def test_ptx_wide_tile_scaled_per_four_words(tmp_path, block_n: int, block_k: int,
                                             stages: int) -> None:
    """ptx 2: the 4 words a thread holds (one group) summed before the scaling: fewer FFMA per
    weight than ptx 1 (2 per 4 words instead of per word: ~1.1 against ~1.27), the sum in
    registers (Triton 3.6: no barrier; 3.9 sums x's 4-word runs with a shuffle: at most 2
    barriers a K step), under ~4 SASS per weight (when written, 3.9 / 3.6: 3.6 / 3.5 at
    stages 0, 3.9 / 3.7 at stages 1)."""
    per_word = {}
    for ptx_form in (1, 2):
        per_weight, _, body = _wide_compile(tmp_path, False, block_n, block_k, 4, stages=stages,
                                            ptx=ptx_form)
        ops = [(i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0]
               for i in body]
        per_word[ptx_form] = ops.count("FFMA") * 32 * 4 / (block_n * block_k)
    assert per_word[2] <= per_word[1] - 0.1, per_word
    assert ops.count("BAR") <= 2 and ops.count("LOP3") * 32 * 4 <= 1.2 * block_n * block_k
    assert per_weight <= 4.0 + 0.1 * stages, f"{per_weight:.2f} SASS per weight"


def test_nibble_unpack_asm_equals_the_interpreter_form() -> None:
    """int_gemv_wide.nibble_asm executed instruction by instruction in Python gives the bits of
    the interpreter's form (_hi / _lo of the word shifted by 16, 8, 0, -8, -16), which the
    interpreter tests check against the dequantized weight: OFF_i + nibble i as fp32 bits."""
    import random

    from shard.kernels.int_gemv_wide import nibble_asm

    rng = random.Random(0)
    m32 = 0xFFFFFFFF
    for _ in range(300):
        w = rng.getrandbits(32)
        regs: dict[str, int] = {"$8": w}
        for line in nibble_asm().splitlines():
            op = re.match(r"(mul\.lo\.u32|mul\.hi\.u32|lop3\.b32|prmt\.b32) (\S+), (\S+), "
                          r"(\S+)(?:, (\S+))?(?:, (\S+))?;", line)
            if not op:
                continue
            a, b = (regs[v] if v in regs else int(v, 0) for v in op.group(3, 4))
            if op.group(1) == "prmt.b32":
                regs[op.group(2)] = _prmt(a, b, int(op.group(5), 0))
            elif op.group(1) == "mul.lo.u32":
                regs[op.group(2)] = (a * b) & m32
            elif op.group(1) == "mul.hi.u32":
                regs[op.group(2)] = (a * b) >> 32
            else:
                regs[op.group(2)] = _lop3(a, b, int(op.group(5), 0), int(op.group(6), 0))
        for i in range(8):
            q = (w >> (4 * i)) & 0xF
            want = (q << 16) | 0x43000000 if i % 2 == 0 else (q << 12) | 0x45000000
            assert regs[f"${i}"] == want, (hex(w), i)
