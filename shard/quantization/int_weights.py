"""Packed int4 / int8 weight-only linears (W4A16 / W8A16) from GPTQ, AWQ and compressed-tensors
pack-quantized checkpoints.

Every checkpoint format is unpacked once at load into `UnpackedInt` (plain integers, original
input order), sliced for tensor parallelism there, and repacked into the one internal layout the
kernels read (`PackedInt`):

- qweight uint8: int4 [N, K/2], storage column 2j in the low nibble of byte j and 2j+1 in the
  high nibble; int8 [N, K]. Unsigned values q in [0, 2^bits).
- scales [N, G] and zeros [N, G], in the checkpoint's scale dtype (usually fp16; zero points
  are small integers, exact in any float dtype; GGUF snapshots keep float32 where float16 is not
  exact, and their Q4_1 / Q4_K zero points are fractional: gguf_blocks.py):
  w[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)].
- g(k) = k // group_size for storage column k, or g_idx[k] where groups are contiguous runs of
  unequal length (a row-parallel slice that cuts a group, or of an act-order checkpoint).
- perm [K] int32 or None: storage column k holds input feature perm[k]. Act-order (GPTQ desc_act)
  checkpoints map input features to groups in any order; sorting the columns by group makes every
  group one contiguous run, so kernels load each group's scale once per tile. The forward pass
  gathers x[..., perm] (M x K elements, cheap beside the N x K weight).

Tensor parallelism keeps groups intact by construction: a column-parallel slice takes whole
output rows (their scales and zeros with them); a row-parallel slice takes its input features
with their group ids, keeps the scales of the groups it references and re-numbers them, so a
slice that starts or ends inside a group (or an act-order slice, whose features belong to groups
all over the layer) is exact too.

Checkpoint layouts (from the formats' published descriptions):
- GPTQ v1 (AutoGPTQ / GPTQModel `checkpoint_format: gptq`): qweight int32 [K * bits / 32, N]
  packed along the input dimension, value i of a word in bits [i*bits, (i+1)*bits); qzeros int32
  [G, N * bits / 32] packed along the output dimension alike, each holding zero - 1 (the v1
  off-by-one); scales fp16 [G, N]; g_idx int32 [K] (group of each input feature).
- AWQ GEMM: qweight int32 [K, N / 8] packed along the output dimension, word c holding columns
  8c + (0, 2, 4, 6, 1, 3, 5, 7) in nibbles 0..7; qzeros int32 [G, N / 8] the same way (zero points
  stored as they are); scales fp16 [G, N]; group g(k) = k // group_size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shard.quantization.methods import IntLayout, IntWeightFormat

# AWQ's GEMM packing puts output column 8c + AWQ_ORDER[i] in nibble i of word c; reading the
# nibbles back, column 8c + j is nibble AWQ_NIBBLE_OF_COLUMN[j].
log = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass
class UnpackedInt:
    """A linear's integer weight as plain tensors, input features in their original order."""

    q: torch.Tensor  # [N, K] uint8, values in [0, 2^bits)
    scales: torch.Tensor  # [N, G] float (checkpoint dtype)
    zeros: torch.Tensor  # [N, G] same dtype as scales, integer values
    g_idx: torch.Tensor  # [K] int64, group of each input feature
    bits: int

    def rows(self, start: int, stop: int) -> UnpackedInt:
        """Output rows [start, stop): a column-parallel slice."""
        return replace(self, q=self.q[start:stop], scales=self.scales[start:stop],
                       zeros=self.zeros[start:stop])

    def columns(self, start: int, stop: int) -> UnpackedInt:
        """Input features [start, stop): a row-parallel slice, with the scales of the groups it
        references (re-numbered 0..G'-1 in their original order)."""
        g = self.g_idx[start:stop]
        used = torch.unique(g)  # sorted
        return replace(self, q=self.q[:, start:stop], scales=self.scales[:, used],
                       zeros=self.zeros[:, used], g_idx=torch.searchsorted(used, g))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32 (exact for fp16 scales)."""
        g = self.g_idx
        w = (self.q.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits values each (value i in bits [i*bits, (i+1)*bits)) expanded
    along `dim`: [R, C] -> [R * 32/bits, C] (dim 0) or [R, C * 32/bits] (dim 1), uint8."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    mask = (1 << bits) - 1
    p = packed.to(torch.int32)
    if dim == 0:
        v = (p[:, None, :] >> shifts[None, :, None]) & mask  # [R, per, C]
        return v.reshape(p.shape[0] * per, p.shape[1]).to(torch.uint8)
    v = (p[:, :, None] >> shifts[None, None, :]) & mask  # [R, C, per]
    return v.reshape(p.shape[0], p.shape[1] * per).to(torch.uint8)


def _check_groups(name: str, g_idx: torch.Tensor, groups: int) -> None:
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"{name}: group ids outside [0, {groups}) (the scales have {groups} groups)")


def unpack_gptq(prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, fmt: IntWeightFormat) -> UnpackedInt:
    """GPTQ v1 tensors of one linear (see module docstring) -> UnpackedInt."""
    q = unpack_int32(qweight, fmt.bits, 0)  # [K, N]
    k, n = q.shape
    if scales.dim() != 2 or scales.shape[1] != n:
        raise ValueError(f"{prefix}.scales: shape {tuple(scales.shape)} does not fit qweight's "
                         f"{n} output features")
    groups = scales.shape[0]
    # v1 stores zero - 1; the +1 is applied to the stored value as GPTQ v1 kernels do.
    zeros = unpack_int32(qzeros, fmt.bits, 1)[:, :n].to(scales.dtype) + 1  # [G, N]
    if g_idx is None:
        size = k if fmt.group_size == -1 else fmt.group_size
        g_idx = torch.arange(k, device=q.device) // size
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,):
        raise ValueError(f"{prefix}.g_idx: shape {tuple(g_idx.shape)}, expected ({k},)")
    _check_groups(f"{prefix}.g_idx", g_idx, groups)
    return UnpackedInt(q.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(),
                       g_idx, fmt.bits)


def unpack_awq(prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               fmt: IntWeightFormat) -> UnpackedInt:
    """AWQ GEMM tensors of one linear (see module docstring) -> UnpackedInt."""
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN, device=qweight.device)

    def columns_in_order(nibbles: torch.Tensor) -> torch.Tensor:  # [R, C*8] nibble order
        r = nibbles.shape[0]
        return nibbles.view(r, -1, 8)[:, :, order].reshape(r, -1)

    q = columns_in_order(unpack_int32(qweight, 4, 1))  # [K, N]
    k, n = q.shape
    if scales.dim() != 2 or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"{prefix}.scales: shape {tuple(scales.shape)} does not fit a "
                         f"[{k}, {n}] weight")
    zeros = columns_in_order(unpack_int32(qzeros, 4, 1)).to(scales.dtype)  # [G, N]
    g_idx = torch.arange(k, device=q.device) // (k // scales.shape[0])
    return UnpackedInt(q.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(),
                       g_idx, 4)


@dataclass
class PackedInt:
    """The internal layout (module docstring) of one linear on its device."""

    qweight: torch.Tensor  # int4: [N, K/2] uint8; int8: [N, K] uint8
    scales: torch.Tensor  # [N, G]
    zeros: torch.Tensor  # [N, G]
    bits: int
    in_features: int  # K
    group_size: int  # storage columns per group where g_idx is None
    perm: torch.Tensor | None  # [K] int32: input feature of each storage column
    g_idx: torch.Tensor | None  # [K] int32: group of each storage column (unequal groups)

    @classmethod
    def pack(cls, w: UnpackedInt) -> PackedInt:
        k = w.q.shape[1]
        g = w.g_idx
        perm = None
        if bool((g[1:] < g[:-1]).any()):  # act-order: sort the columns by group (stable)
            perm = torch.argsort(g, stable=True)
            g = g[perm]
        q = w.q if perm is None else w.q[:, perm]
        counts = torch.bincount(g, minlength=w.scales.shape[1])
        uniform = bool((counts == counts[0]).all()) and int(counts[0]) > 0
        group_size = int(counts[0]) if uniform else k
        if w.bits == 4:
            if k % 2:
                raise ValueError(f"int4 weights need an even number of input features, not {k}")
            qweight = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K/2]
        else:
            qweight = q
        return cls(
            qweight=qweight.contiguous(),
            scales=w.scales.contiguous(),
            zeros=w.zeros.contiguous(),
            bits=w.bits,
            in_features=k,
            group_size=group_size,
            perm=None if perm is None else perm.to(torch.int32),
            g_idx=None if uniform else g.to(torch.int32),
        )

    def unpacked_q(self) -> torch.Tensor:
        """[N, K] uint8 values in storage order."""
        if self.bits == 8:
            return self.qweight
        lo, hi = self.qweight & 0xF, self.qweight >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.qweight.shape[0], self.in_features)

    def group_ids(self) -> torch.Tensor:
        """[K] int64: the group of each storage column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in storage order, in `dtype` (computed in float32)."""
        g = self.group_ids()
        w = (self.unpacked_q().float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)


class IntLinear(nn.Module):
    """y = x @ W.T + b with W stored as PackedInt.

    CUDA, int4 or int8, groups of equal length that K tiles line up with: Triton kernels that
    dequantize in registers, a GEMV up to GEMV_MAX_M rows (shard/kernels/int_gemv.py) and a
    dequant-fused GEMM above (shard/kernels/int_gemm.py), each launched with the config tuned for
    the batch's bucket (shard/kernels/int_tuning.py, at the first eager call). Anywhere else (CPU;
    unequal groups of an act-order row-parallel slice): the weight is dequantized to the
    activation dtype and multiplied with F.linear; what the CPU tests check."""

    def __init__(self, packed: PackedInt, bias: torch.Tensor | None = None,
                 use_gemv: bool | None = None) -> None:
        super().__init__()
        self.bits = packed.bits
        self.in_features = packed.in_features
        self.out_features = packed.qweight.shape[0]
        self.group_size = packed.group_size
        self.register_buffer("qweight", packed.qweight, persistent=False)
        self.register_buffer("scales", packed.scales, persistent=False)
        self.register_buffer("zeros", packed.zeros, persistent=False)
        self.register_buffer("perm", packed.perm, persistent=False)
        self.register_buffer("g_idx", packed.g_idx, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        device = packed.qweight.device
        if use_gemv is None:
            use_gemv = device.type == "cuda"
        # The GEMV's tensor-core path multiplies x by (q - zero) in x's dtype, exact for integer
        # zero points; GGUF Q4_1 / Q4_K minimums make fractional ones (gguf_blocks.py), whose
        # zero term the kernel then applies separately.
        self.int_zeros = bool(torch.equal(packed.zeros, torch.round(packed.zeros)))
        # use_gemv: the Triton kernels (GEMV and GEMM) serve this linear.
        self.use_gemv = bool(use_gemv) and packed.g_idx is None
        self.gemv_max_m = 0
        self._tuned: dict[torch.dtype, Any] = {}  # activation dtype -> int_tuning.IntTuning
        if self.use_gemv:
            try:
                from shard.kernels.int_gemv import GEMV_MAX_M, pick_block_k
            except ImportError:
                self.use_gemv = False
            else:
                self.use_gemv = pick_block_k(packed.group_size, packed.in_features) is not None
                self.gemv_max_m = GEMV_MAX_M
        # Split-K GEMV configs count arriving K splits per block of >= 8 rows here; each launch
        # leaves the counters at zero again (shard/kernels/int_gemv.py).
        self.register_buffer(
            "splitk_counters",
            torch.zeros(-(-self.out_features // 8), dtype=torch.int32, device=device)
            if self.use_gemv else None,
            persistent=False,
        )

    @classmethod
    def merge_rows(cls, *linears: IntLinear) -> IntLinear | None:
        """One IntLinear over the stacked output rows of `linears` (q/k/v or gate/up: one decode
        kernel instead of two or three), or None where they cannot stack: different bits, group
        layout or act-order permutation (GPTQ quantizes q/k/v, and gate/up, against the same
        inputs, so their act-order permutations are normally equal). Exact: rows keep their own
        scales and zeros. The parts' buffers become views of the merged ones."""
        first = linears[0]

        def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            return (a is None and b is None) or (
                a is not None and b is not None and torch.equal(a, b))

        if any(m.bits != first.bits or m.in_features != first.in_features
               or m.group_size != first.group_size or m.scales.dtype != first.scales.dtype
               or m.zeros.dtype != first.zeros.dtype
               or not same(m.perm, first.perm) or not same(m.g_idx, first.g_idx)
               or (m.bias is None) != (first.bias is None) for m in linears):
            return None
        merged = cls(
            PackedInt(
                torch.cat([m.qweight for m in linears]),
                torch.cat([m.scales for m in linears]),
                torch.cat([m.zeros for m in linears]),
                first.bits, first.in_features, first.group_size, first.perm, first.g_idx,
            ),
            torch.cat([m.bias for m in linears]) if first.bias is not None else None,
            use_gemv=first.use_gemv,
        )
        at = 0
        for m in linears:
            rows = slice(at, at + m.out_features)
            m.qweight, m.scales, m.zeros = (merged.qweight[rows], merged.scales[rows],
                                            merged.zeros[rows])
            if m.bias is not None:
                m.bias = merged.bias[rows]
            at += m.out_features
        return merged

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a merged gate/up weight (rows 0..I-1 gate, I..2I-1 up): silu(gate) * up,
        x [M, in] -> [M, out / 2] (the SiLU-and-mul is one kernel on CUDA; not yet fused into
        the GEMV's epilogue as the 16-bit / fp8 GEMV does)."""
        gate, up = self.forward(x).chunk(2, dim=-1)
        if x.is_cuda:
            from shard.kernels.elementwise import silu_mul

            return silu_mul(gate, up)
        return F.silu(gate) * up

    @property
    def packed(self) -> PackedInt:
        return PackedInt(self.qweight, self.scales, self.zeros, self.bits, self.in_features,
                         self.group_size, self.perm, self.g_idx)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.zeros, self.perm, self.g_idx)
                   if t is not None)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in the input features' own order (perm undone), in `dtype`."""
        w = self.packed.dequantize(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm.long()] = w
        return out

    def _weight_view(self) -> Any:
        from shard.kernels.int_tuning import IntWeightView

        return IntWeightView(self.qweight, self.scales, self.zeros, self.group_size, self.bits,
                             self.int_zeros, self.bias, self.splitk_counters)

    def _kernels_ready(self, dtype: torch.dtype) -> bool:
        """Tunes (or reads the tuned choice of this shape) and loads every batch bucket's GEMV
        and GEMM config at the first eager call in `dtype`, whatever that call's batch: the shard
        warms up eagerly at prefill sizes, then captures CUDA graphs of decode batches, where
        neither timing nor a kernel's first load may happen. False while a capture finds it not
        ready (that capture then records the dequantizing path)."""
        if dtype in self._tuned:
            return True
        if self.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        from shard.kernels.int_tuning import tune_int_linear

        try:
            self._tuned[dtype] = tune_int_linear(self._weight_view(), dtype)
        except Exception as exc:  # noqa: BLE001 - no kernel ran: serve through the dequantizing path
            log.warning("int%d linear %dx%d: no Triton kernel config ran (%s: %s); dequantizing "
                        "per call instead", self.bits, self.out_features, self.in_features,
                        type(exc).__name__, str(exc)[:300])
            self.use_gemv = False
            return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        xs = x if self.perm is None else x.index_select(-1, self.perm)
        lead = x.shape[:-1]
        if (self.use_gemv and x.dtype in (torch.bfloat16, torch.float16)
                and self._kernels_ready(x.dtype)):
            x2 = xs.reshape(-1, self.in_features)  # [M, K]
            m = x2.shape[0]
            if m == 0:
                return xs.new_empty(*lead, self.out_features)
            tuned = self._tuned[x.dtype]
            w = self._weight_view()
            if m <= self.gemv_max_m:
                from shard.kernels.gemv_buckets import m_bucket

                y = w.gemv(x2, tuned.gemv[m_bucket(m)])
            else:
                from shard.kernels.int_gemm import gemm_bucket

                y = w.gemm(x2, tuned.gemm[gemm_bucket(m)])
            return y.reshape(*lead, self.out_features)
        return F.linear(xs, self.packed.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, act_order={self.perm is not None}")


def unpack_pack_quantized(prefix: str, packed: torch.Tensor, scales: torch.Tensor,
                          zero_point: torch.Tensor | None, shape: torch.Tensor | None,
                          g_idx: torch.Tensor | None, fmt: IntWeightFormat) -> UnpackedInt:
    """compressed-tensors pack-quantized tensors of one linear -> UnpackedInt. The stored values
    are the signed integers plus 2^(bits-1), and so are the packed zero points, so
    w = (stored q - stored zero) * scale; symmetric weights have no zero point (signed zero 0,
    stored 2^(bits-1))."""
    q = unpack_int32(packed, fmt.bits, 1)  # [N, K padded to the word]
    n = q.shape[0]
    k = int(shape.reshape(-1)[1]) if shape is not None else q.shape[1]
    if (shape is not None and int(shape.reshape(-1)[0]) != n) or k > q.shape[1]:
        raise ValueError(f"{prefix}.weight_shape: {shape.tolist()} does not fit weight_packed "
                         f"{tuple(packed.shape)}")
    q = q[:, :k]
    if scales.dim() == 1:
        scales = scales[:, None]
    if scales.shape[0] != n:
        raise ValueError(f"{prefix}.weight_scale: shape {tuple(scales.shape)} does not fit "
                         f"{n} output features")
    groups = scales.shape[1]
    if zero_point is None:
        zeros = torch.full_like(scales, 2 ** (fmt.bits - 1))
    else:  # packed along the output rows: [N * bits / 32, G]
        zeros = unpack_int32(zero_point, fmt.bits, 0)[:n].to(scales.dtype)
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // (k // groups if groups > 1 else k)
    g_idx = g_idx.to(torch.int64)
    _check_groups(f"{prefix}.weight_g_idx", g_idx, groups)
    return UnpackedInt(q.contiguous(), scales.contiguous(), zeros.contiguous(), g_idx, fmt.bits)


def read_unpacked(fmt: IntWeightFormat, prefix: str, get: dict[str, torch.Tensor]) -> UnpackedInt:
    """The layer's checkpoint tensors (name suffix -> tensor as stored) -> UnpackedInt."""
    if fmt.layout is IntLayout.PACK_QUANTIZED:
        for suffix in ("weight_packed", "weight_scale"):
            if suffix not in get:
                raise ValueError(f"{prefix}.{suffix}: missing from the pack-quantized checkpoint")
        if not fmt.symmetric and "weight_zero_point" not in get:
            raise ValueError(f"{prefix}.weight_zero_point: missing (the checkpoint is asymmetric)")
        return unpack_pack_quantized(prefix, get["weight_packed"], get["weight_scale"],
                                     get.get("weight_zero_point"), get.get("weight_shape"),
                                     get.get("weight_g_idx"), fmt)
    for suffix in ("qweight", "qzeros", "scales"):
        if suffix not in get:
            raise ValueError(f"{prefix}.{suffix}: missing from the {fmt.layout.value} checkpoint")
    if fmt.layout is IntLayout.GPTQ:
        return unpack_gptq(prefix, get["qweight"], get["qzeros"], get["scales"],
                           get.get("g_idx"), fmt)
    return unpack_awq(prefix, get["qweight"], get["qzeros"], get["scales"], fmt)


def tp_slice(w: UnpackedInt, shard_dim: int, rank: int, world: int, prefix: str) -> UnpackedInt:
    """This rank's part: output rows (shard_dim 0) or input features (1), contiguous blocks."""
    size = w.q.shape[shard_dim]
    if size % world:
        raise ValueError(f"{prefix}: {size} {'output' if shard_dim == 0 else 'input'} features "
                         f"not divisible by {world} ranks")
    block = size // world
    start, stop = rank * block, (rank + 1) * block
    return w.rows(start, stop) if shard_dim == 0 else w.columns(start, stop)
