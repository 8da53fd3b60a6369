"""`python benchmarks/wheel_trim.py OUT_DIR WHEEL...`: copies wheels into OUT_DIR without the files
benchmarks/vllm_pack.sh leaves out (DROP), re-zipped STORED so that xz sees the raw bytes (members
already deflated barely compress further), RECORD without the dropped files' lines so pip's
record of the install stays true.

Dropped: vLLM's FA2 library (Hopper runs FA3), its Rust front end, its MoE kernel library
(`_moe_C_stable_libtorch`, 47 MB, ~40 MB compressed: the platform imports it under
`contextlib.suppress(ImportError)` and a dense Llama never calls it), the Blackwell-only
fmha_sm100 sources, deep_gemm's extensions for Pythons other than 3.12 (the device's);
xgrammar's static C++ library (lib/*.a: for linking C++ programs, never loaded by Python).
What stays of vLLM's CUDA code (FA3, `_C_stable_libtorch`) barely compresses (its kernels are
compressed fatbins already), hence the pieces.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

DROP = re.compile(
    r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so|vllm/vllm-rs"
    r"|vllm/_moe_C_stable_libtorch\.abi3\.so"
    r"|vllm/third_party/fmha_sm100/.*"
    r"|vllm/third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-.*\.so"
    r"|xgrammar/lib/.*\.a")


def trim(src: Path, out_dir: Path) -> list[str]:
    """Writes out_dir/src.name without the DROP members; returns the dropped names."""
    with zipfile.ZipFile(src) as zin, \
            zipfile.ZipFile(out_dir / src.name, "w", zipfile.ZIP_STORED) as zout:
        dropped = {i.filename for i in zin.infolist() if DROP.fullmatch(i.filename)}
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if line.split(",")[0] not in dropped).encode()
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
    return sorted(dropped)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for wheel in map(Path, sys.argv[2:]):
        gone = trim(wheel, out)
        print(f"{wheel.name}: dropped {len(gone)} files")
