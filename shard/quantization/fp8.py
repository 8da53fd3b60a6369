"""fp8 (float8_e4m3fn) weights with one float32 scale per output channel.

Storage: weight_fp8 [out, in] float8_e4m3fn and weight_scale [out] float32, with
weight ≈ weight_fp8.float() * weight_scale[:, None]; each row's scale is its absmax / 448 so the
row spans the whole e4m3 range.

Matmul:
- CUDA sm_89+ with at most GEMV_MAX_M (16) rows of bf16/fp16 activations (decode batches):
  weight-only, one Triton kernel (shard/kernels/fp8_gemv.py) that streams the fp8 weight, converts it in
  registers, accumulates x @ W.T in fp32 and applies the per-channel scale (and bias) once per
  output. A decode step is a pass over the weight bytes, so this is the path that can run it at
  up to 2x bf16's speed; the W8A8 path below is slower than bf16 there (its activation
  quantization is one more kernel, and _scaled_mm is a GEMM tiled for large M). The kernel is
  autotuned for every batch bucket at the module's first eager forward, whatever its batch
  (CUDA-graph capture forbids autotuning's host syncs and a kernel's first load); a capture
  that comes before any eager forward falls back to the paths below.
- CUDA with compute capability >= 8.9 (Ada, Hopper), larger batches: W8A8 through
  `torch._scaled_mm` (signature unchanged from torch 2.4 through 2.13: `_scaled_mm(a, b,
  scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False)`, a
  [M, K] row-major fp8, b [K, N] column-major fp8). Activations are quantized **dynamically per
  token** (one scale per row of x, absmax / 448, computed on the device each call: no host sync,
  CUDA-graph safe), weights per output channel, i.e. the "rowwise" scaling recipe: scale_a
  [M, 1], scale_b [1, N], bf16 out. Per-token scales keep one outlier token from crushing the
  precision of its batch mates, which a per-tensor activation scale would do.
- Anywhere else (CPU, older GPUs, K or N not a multiple of 16): weight-only, the weight is
  dequantized to the activation dtype and multiplied with `F.linear`. Correct everywhere, and what
  the CPU tests check against references.

Per-channel scales also make row blocks of several Fp8Linears stack exactly
(`Fp8Linear.merge_rows`): q/k/v or gate/up as one kernel instead of three or two.

Pre-quantized checkpoints (see methods.checkpoint_quantization) store per-tensor, per-channel or
block scales; `to_per_channel` converts any of them to this module's per-channel layout, exactly
for per-tensor and per-channel scales (a per-tensor scale is broadcast to every row, which also
makes fused q/k/v or gate/up projections with different per-tensor scales simply concatenate).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest scale, so that all-zero rows/tokens do not divide by zero.
_MIN_SCALE = 1e-12


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (weight_fp8 [out, in], scale [out] float32)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)  # [out]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (x_fp8, scale [] float32) with one scale for the whole tensor."""
    xf = x.float()
    scale = (xf.abs().amax() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, 1] float32), one scale per row (token)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)  # [M, 1]
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(
    weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """weight_fp8 [out, in], scale [out] (or [] per tensor) -> weight [out, in] in `dtype`."""
    s = scale.float()
    if s.dim() == 1:
        s = s[:, None]
    return (weight_fp8.float() * s).to(dtype)


def to_per_channel(
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Converts a checkpoint's fp8 weight and scale to (weight_fp8 [out, in], scale [out]).

    scale: [] or [1] per tensor; [out] or [out, 1] per channel; [ceil(out/bo), ceil(in/bi)]
    per block (then block_size=(bo, bi) is required). Per-tensor and per-channel are exact; blocks
    are dequantized to float32 and re-quantized per channel (the rows of one block row share
    nothing after that, so a little precision is lost where a row's blocks had different scales).
    """
    out_features, in_features = weight_fp8.shape
    scale = scale.float()
    if block_size is not None and scale.dim() == 2 and scale.shape[1] > 1:
        bo, bi = block_size
        # [out, in] float32: expand each block's multiplier over its (bo, bi) tile.
        expanded = scale.repeat_interleave(bo, dim=0)[:out_features]
        expanded = expanded.repeat_interleave(bi, dim=1)[:, :in_features]
        return quantize_fp8_per_channel(weight_fp8.float() * expanded)
    if scale.numel() == 1:
        return weight_fp8, scale.reshape(1).expand(out_features).contiguous()
    if scale.numel() == out_features:
        return weight_fp8, scale.reshape(out_features).contiguous()
    raise ValueError(
        f"fp8 weight_scale of shape {tuple(scale.shape)} does not fit a weight of shape "
        f"{tuple(weight_fp8.shape)} (expected per-tensor, per-channel or, with "
        "weight_block_size, per-block scales)"
    )


def scaled_mm_supported(device: torch.device) -> bool:
    """True where torch._scaled_mm runs fp8 matmuls in hardware (CUDA sm_89+)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """y = x @ W.T + b with W stored as float8_e4m3fn per output channel (see module docstring).

    use_scaled_mm: None picks by device (CUDA sm_89+ -> True); True forces torch._scaled_mm (which
    torch 2.13 also runs on CPU, handy for testing the W8A8 math); False forces dequantization.
    use_gemv: None picks by device (CUDA sm_89+ with Triton -> True); False turns the small-batch
    Triton kernel off (batches then take the path use_scaled_mm says). Ignored off CUDA.
    """

    def __init__(
        self,
        weight_fp8: torch.Tensor,  # [out, in] float8_e4m3fn
        weight_scale: torch.Tensor,  # [out] float32
        bias: torch.Tensor | None = None,  # [out]
        use_scaled_mm: bool | None = None,
        use_gemv: bool | None = None,
    ) -> None:
        super().__init__()
        if weight_fp8.dtype != FP8_DTYPE:
            raise TypeError(f"Fp8Linear: weight dtype {weight_fp8.dtype}, expected {FP8_DTYPE}")
        out_features, in_features = weight_fp8.shape
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", weight_fp8.contiguous(), persistent=False)
        self.register_buffer(
            "weight_scale",
            weight_scale.float().reshape(out_features).contiguous(),
            persistent=False,
        )
        self.register_buffer("bias", bias, persistent=False)
        device = weight_fp8.device
        if use_scaled_mm is None:
            use_scaled_mm = scaled_mm_supported(device)
        # The fp8 GEMMs want K and N multiples of 16; other shapes dequantize.
        self.use_scaled_mm = (
            bool(use_scaled_mm) and in_features % 16 == 0 and out_features % 16 == 0
        )
        # On CUDA, activations are quantized by one Triton kernel instead of ~5 torch ops.
        self._quantize_input = quantize_fp8_per_token
        if self.use_scaled_mm and device.type == "cuda":
            try:
                from shard.kernels.quant import quantize_fp8_per_token_triton
            except ImportError:
                pass
            else:
                self._quantize_input = quantize_fp8_per_token_triton
        # Small batches: the weight-only Triton GEMV (any K, N). The kernel converts e4m3 with
        # sm_89+ instructions, hence the same device test as _scaled_mm.
        self.use_gemv = False
        self.gemv_max_m = 0
        # (activation dtype, SiLU epilogue) -> {M bucket: the GEMV config tuned for it}
        self._gemv_configs: dict[tuple[torch.dtype, bool], dict[int, Any]] = {}
        if use_gemv is None:
            use_gemv = scaled_mm_supported(device)
        if use_gemv and device.type == "cuda":
            try:
                from shard.kernels.fp8_gemv import GEMV_MAX_M, fp8_gemv, tune_fp8_gemv
            except ImportError:
                pass
            else:
                self.use_gemv = True
                self.gemv_max_m = GEMV_MAX_M
                self._gemv = fp8_gemv
                self._tune_gemv = tune_fp8_gemv

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_scaled_mm: bool | None = None,
        use_gemv: bool | None = None,
    ) -> Fp8Linear:
        q, scale = quantize_fp8_per_channel(weight)
        return cls(q, scale, bias, use_scaled_mm, use_gemv)

    @classmethod
    def merge_rows(cls, *linears: Fp8Linear) -> Fp8Linear:
        """One Fp8Linear over the stacked output rows of `linears` (same in_features), e.g. q/k/v
        or gate/up as one kernel. Exact: each row keeps its own scale. The parts' buffers become
        views of the merged ones (no extra memory), so they keep working on their own."""
        if len({m.in_features for m in linears}) != 1:
            raise ValueError("Fp8Linear.merge_rows: the parts differ in in_features")
        with_bias = [m.bias is not None for m in linears]
        if any(with_bias) and not all(with_bias):
            raise ValueError("Fp8Linear.merge_rows: some parts have a bias and some not")
        first = linears[0]
        merged = cls(
            # [sum(out), in]; concatenated as bytes (cat has no fp8 kernels on some builds)
            torch.cat([m.weight.view(torch.uint8) for m in linears]).view(FP8_DTYPE),
            torch.cat([m.weight_scale for m in linears]),  # [sum(out)]
            torch.cat([m.bias for m in linears]) if all(with_bias) else None,
            use_scaled_mm=first.use_scaled_mm,
            use_gemv=first.use_gemv,
        )
        at = 0
        for m in linears:
            rows = slice(at, at + m.out_features)
            m.weight = merged.weight[rows]
            m.weight_scale = merged.weight_scale[rows]
            if m.bias is not None:
                m.bias = merged.bias[rows]
            at += m.out_features
        return merged

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def _gemv_ready(self, dtype: torch.dtype, silu_mul: bool = False) -> bool:
        """Tunes the GEMV for every batch bucket at the first eager call in `dtype`, whatever that
        call's batch: the shard warms up eagerly at large batches, then captures CUDA graphs for
        the small ones, where neither autotuning nor a kernel's first load may happen. False
        while a capture finds it untuned."""
        key = (dtype, silu_mul)
        if key in self._gemv_configs:
            return True
        if torch.cuda.is_current_stream_capturing():
            return False
        if silu_mul:
            from shard.kernels.gemv import tune_gemv

            configs = tune_gemv(self.weight, self.weight_scale, self.bias, dtype, silu_mul=True)
        else:
            configs = self._tune_gemv(self.weight, self.weight_scale, self.bias, dtype)
        self._gemv_configs[key] = configs
        return True

    def _gemv_config(self, x: torch.Tensor, silu_mul: bool) -> Any:
        """The tuned GEMV config for x's batch bucket (after _gemv_ready)."""
        from shard.kernels.gemv_buckets import m_bucket

        return self._gemv_configs[(x.dtype, silu_mul)][m_bucket(x.shape[0])]

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a merged gate/up weight (rows 0..I-1 gate, I..2I-1 up): silu(gate) * up,
        x [M, in] -> [M, out / 2]. Decode-sized batches on the GEMV path take one kernel with
        the SiLU-and-mul in its epilogue (same roundings as the two-step form); otherwise
        forward() then shard.kernels.elementwise.silu_mul."""
        if (
            self.use_gemv
            and x.dim() == 2
            and x.shape[0] <= self.gemv_max_m
            and x.dtype in (torch.bfloat16, torch.float16)
            and self._gemv_ready(x.dtype, silu_mul=True)
        ):
            from shard.kernels.gemv import gemv

            return gemv(x, self.weight, self.weight_scale, self.bias, silu_mul=True,
                        config=self._gemv_config(x, silu_mul=True))
        from shard.kernels.elementwise import silu_mul

        gate, up = self.forward(x).chunk(2, dim=-1)
        return silu_mul(gate, up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        lead = x.shape[:-1]
        if (
            self.use_gemv
            and x.dtype in (torch.bfloat16, torch.float16)
            and self._gemv_ready(x.dtype)
        ):
            x2 = x.reshape(-1, self.in_features)  # [M, K]
            if x2.shape[0] <= self.gemv_max_m:
                y = self._gemv(x2, self.weight, self.weight_scale, self.bias,
                               config=self._gemv_config(x2, silu_mul=False))  # [M, N]
                return y.reshape(*lead, self.out_features)
        if not self.use_scaled_mm:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        xq, x_scale = self._quantize_input(x2)  # [M, K] fp8, [M, 1] fp32
        out_dtype = (
            x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        )
        # Rowwise scaling wants a bf16 output; convert afterwards for other activation dtypes.
        y = torch._scaled_mm(
            xq,
            self.weight.t(),  # [K, N] column-major view of the [N, K] row-major weight
            scale_a=x_scale,
            scale_b=self.weight_scale.view(1, -1),  # [1, N]
            out_dtype=torch.bfloat16,
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out_dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scaled_mm={self.use_scaled_mm}, gemv={self.use_gemv}"
        )
