"""Linears of a tokenwire GGUF snapshot kept packed (shard/tools/gguf_repack.py writes them):
read back into int_weights.UnpackedInt, so slicing and the kernels are the GPTQ / AWQ ones.

Per linear (N output features, K input features, G = K / group groups):
- `gguf_type` int32 [1]: the GGML type the file stored it in (its bits and group size below);
- `qweight` uint8: 4-bit types [N, K/2] (column 2j in the low nibble of byte j, 2j+1 in the
  high one: the internal layout of int_weights.PackedInt), 8-bit storage [N, K];
- `scales`, `zeros` [N, G] float16 where that is exact, else float32:
  w[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group].
Zero points need not be integers: Q4_1 / Q4_K store a per-block minimum m, w = d * q + m, i.e.
zero = -m / d.
"""

from __future__ import annotations

import torch

from shard.quantization.int_weights import UnpackedInt

# GGML type number -> (name, storage bits, input features per scale). Q6_K's 6-bit values are
# stored one per byte; its sub-blocks of 16 carry their own scales.
GGUF_PACKED: dict[int, tuple[str, int, int]] = {
    8: ("Q8_0", 8, 32),
    2: ("Q4_0", 4, 32),
    3: ("Q4_1", 4, 32),
    12: ("Q4_K", 4, 32),
    14: ("Q6_K", 8, 16),
}


def read_gguf_linear(prefix: str, get: dict[str, torch.Tensor]) -> UnpackedInt:
    """The snapshot's tensors of one linear (suffix -> tensor as stored) -> UnpackedInt."""
    for suffix in ("gguf_type", "qweight", "scales", "zeros"):
        if suffix not in get:
            raise ValueError(f"{prefix}.{suffix}: missing from the GGUF snapshot")
    gtype = int(get["gguf_type"].reshape(-1)[0])
    if gtype not in GGUF_PACKED:
        raise ValueError(f"{prefix}.gguf_type: {gtype} is not a GGML type kept packed "
                         f"(supported: {', '.join(n for n, _, _ in GGUF_PACKED.values())})")
    _, bits, group = GGUF_PACKED[gtype]
    packed = get["qweight"]
    if bits == 4:
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    else:
        q = packed
    n, k = q.shape
    scales, zeros = get["scales"], get["zeros"]
    for suffix, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, k // group) or k % group:
            raise ValueError(f"{prefix}.{suffix}: shape {tuple(t.shape)}, expected "
                             f"({n}, {k // group}) for a [{n}, {k}] {GGUF_PACKED[gtype][0]} weight")
    g_idx = torch.arange(k, device=q.device) // group
    return UnpackedInt(q.contiguous(), scales, zeros, g_idx, bits)
