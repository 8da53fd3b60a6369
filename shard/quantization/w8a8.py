"""W8A8-int8 linears from compressed-tensors `int-quantized` checkpoints: int8 weights with one
scale per output channel, activations quantized to int8 per token at run time.

y[m, n] = (sum_k xq[m, k] * wq[n, k]) * a_scale[m] * w_scale[n] (+ bias[n]), where
a_scale[m] = max_k |x[m, k]| / 127 and xq = round(x / a_scale) in [-127, 127] (symmetric,
dynamic: nothing calibrated is needed, and per-token scales follow each row's own range).

CPU (the reference): quantize_per_token in torch ops, the int32 accumulation in `torch._int_mm`
(exact integer sums), the rescale in float32. CUDA with bf16 / fp16 activations: two Triton
launches, the per-token quantization (shard/kernels/int8_quant.py, bit-equal to
quantize_per_token) and an int8 GEMM whose epilogue applies both scales and the bias and writes
the activations' dtype (shard/kernels/int8_gemm.py: exact int32 sums, the same float32 rescale
order, so CUDA and CPU differ by the output's rounding at most). Through torch ops and
torch._int_mm the layer was 8-10x slower than bf16 on an H100 (benchmarks/raw/round10/w8a8). The
GEMM's tiles per batch bucket are measured at the layer's first eager call in a dtype (the
shard's warm-up, before any CUDA-graph capture). Otherwise (fp32 activations, no Triton, or a
capture that finds the kernels untuned) the torch form runs on CUDA too: torch._int_mm, which
wants more than 16 rows and K, N multiples of 8: smaller batches are padded to 17 rows, other
shapes multiply the int8 values as float32 (exact while K * 127 * 127 < 2^24, i.e. K <= 1040).

Rounding convention: compressed-tensors' own loader scales activations by absmax / 127.5
(values clamped to [-128, 127]); tokenwire follows vLLM's int8 kernels (absmax / 127, symmetric).
On llm-compressor's tiny W8A8 fixture the logits differ by 1.1 % (relative norm) between the two,
and agree to 2e-4 with the tool's rounding substituted (tests/shard/test_llmcompressor_fixtures.py).

Tensor parallelism: the weight is read through int_weights.UnpackedInt (int8 + 128 as its unsigned
values, zero 128, one group per row), so column- and row-parallel slices reuse tp_slice. A
row-parallel rank quantizes its own slice of each token (its own per-token scale): at least as
accurate as one scale over the whole row, and no extra collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shard.quantization.int_weights import UnpackedInt

QMAX = 127  # symmetric int8: -128 is never produced, so -x quantizes to -q exactly
CUBLAS_MIN_ROWS = 17  # torch._int_mm on CUDA: more than 16 rows


def read_w8a8(prefix: str, get: dict[str, torch.Tensor]) -> UnpackedInt:
    """`weight` int8 [N, K] and `weight_scale` ([N, 1], [N] or one per tensor) -> UnpackedInt
    (values int8 + 128 as uint8, zeros 128, scales [N, 1] float32)."""
    for suffix in ("weight", "weight_scale"):
        if suffix not in get:
            raise ValueError(f"{prefix}.{suffix}: missing from the int-quantized checkpoint")
    w, scale = get["weight"], get["weight_scale"]
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"{prefix}.weight: {w.dtype} {tuple(w.shape)}, expected int8 [out, in]")
    n, k = w.shape
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n)
    if scale.numel() != n:
        raise ValueError(f"{prefix}.weight_scale: {scale.numel()} scales for {n} output channels")
    zero = get.get("weight_zero_point")
    if zero is not None and bool((zero != 0).any()):
        raise ValueError(f"{prefix}.weight_zero_point: nonzero zero points in a symmetric "
                         "int-quantized checkpoint")
    q = (w.to(torch.int16) + 128).to(torch.uint8)  # [N, K]
    scales = scale.reshape(n, 1).contiguous()
    return UnpackedInt(q, scales, torch.full_like(scales, 128.0),
                       torch.zeros(k, dtype=torch.int64, device=w.device), 8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], scale [M] float32), symmetric per row."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / QMAX  # [M]
    q = torch.round(x.float() / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [M, K] int8 @ wq [N, K].T int8 -> [M, N] int32 (float32 where no int8 GEMM fits)."""
    m, k = xq.shape
    n = wq.shape[0]
    if not xq.is_cuda:
        return torch._int_mm(xq, wq.t())
    if k % 8 or n % 8:
        return xq.float() @ wq.float().t()
    if m < CUBLAS_MIN_ROWS:
        padded = xq.new_zeros(CUBLAS_MIN_ROWS, k)
        padded[:m] = xq
        return torch._int_mm(padded, wq.t())[:m]
    return torch._int_mm(xq, wq.t())


class W8A8Linear(nn.Module):
    """y = x @ W.T + b with W int8 per channel and x quantized per token (module docstring)."""

    def __init__(self, w: UnpackedInt, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if w.bits != 8 or w.scales.shape[1] != 1:
            raise ValueError("W8A8Linear: int8 weights with one scale per output channel")
        self.out_features, self.in_features = w.q.shape
        qweight = (w.q.to(torch.int16) - w.zeros.to(torch.int16)).to(torch.int8)  # [N, K]
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.register_buffer("weight_scale", w.scales.reshape(-1).float().contiguous(),
                             persistent=False)  # [N]
        self.register_buffer("bias", bias, persistent=False)
        self._init_kernels()

    def _init_kernels(self) -> None:
        # (activation dtype, SiLU epilogue) -> {batch bucket: the int8 GEMM config tuned for it}
        self._gemm_configs: dict[tuple[torch.dtype, bool], dict[int | None, Any]] = {}
        self._triton_missing = False

    @classmethod
    def merge_rows(cls, *linears: W8A8Linear) -> W8A8Linear | None:
        """One W8A8Linear over the stacked output rows of `linears` (q/k/v or gate/up: one
        activation quantization and one int8 GEMM instead of two or three), or None where their
        inputs or biases differ. Exact: every row keeps its own scale, and the parts quantize
        the same input the same way. The parts' buffers become views of the merged ones."""
        first = linears[0]
        if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
               for m in linears):
            return None
        merged = cls.__new__(cls)
        nn.Module.__init__(merged)
        merged.in_features = first.in_features
        merged.out_features = sum(m.out_features for m in linears)
        merged.register_buffer("qweight", torch.cat([m.qweight for m in linears]),
                               persistent=False)
        merged.register_buffer("weight_scale", torch.cat([m.weight_scale for m in linears]),
                               persistent=False)
        merged.register_buffer("bias", None if first.bias is None else
                               torch.cat([m.bias for m in linears]), persistent=False)
        merged._init_kernels()
        at = 0
        for m in linears:
            rows = slice(at, at + m.out_features)
            m.qweight, m.weight_scale = merged.qweight[rows], merged.weight_scale[rows]
            if m.bias is not None:
                m.bias = merged.bias[rows]
            at += m.out_features
        return merged

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a merged gate/up weight (rows 0..I-1 gate, I..2I-1 up): silu(gate) * up,
        x [M, in] -> [M, out / 2]. On the Triton path one GEMM with SiLU-and-mul in its epilogue
        (the unfused form's roundings)."""
        if self._kernels_ready(x, silu_mul=True):
            lead = x.shape[:-1]
            y = self._triton_forward(x.reshape(-1, self.in_features), silu_mul=True)
            return y.reshape(*lead, self.out_features // 2)
        gate, up = self.forward(x).chunk(2, dim=-1)
        if x.is_cuda:
            from shard.kernels.elementwise import silu_mul

            return silu_mul(gate, up)
        return F.silu(gate) * up

    @property
    def weight_bytes(self) -> int:
        return (self.qweight.numel() * self.qweight.element_size()
                + self.weight_scale.numel() * self.weight_scale.element_size())

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`."""
        return (self.qweight.float() * self.weight_scale[:, None]).to(dtype)

    def _kernels_ready(self, x: torch.Tensor, silu_mul: bool = False) -> bool:
        """Whether x takes the Triton path: CUDA, bf16 / fp16, and the GEMM tuned for x's dtype
        (tuned here at the first eager call in that dtype, whatever its batch: every bucket at
        once, and the quantize kernel loaded; a CUDA-graph capture that finds it untuned records
        the torch form instead)."""
        if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
            return False
        key = (x.dtype, silu_mul)
        if key in self._gemm_configs:
            return True
        if self._triton_missing or torch.cuda.is_current_stream_capturing():
            return False
        try:
            from shard.kernels.int8_gemm import tune_int8_gemm
            from shard.kernels.int8_quant import quantize_int8_per_token
        except ImportError:  # no Triton on this install
            self._triton_missing = True
            return False
        quantize_int8_per_token(torch.zeros(2, self.in_features, dtype=x.dtype, device=x.device))
        self._gemm_configs[key] = tune_int8_gemm(self.qweight, self.weight_scale, self.bias,
                                                 x.dtype, silu_mul)
        return True

    def _triton_forward(self, x2: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """x2 [M, K] -> [M, N] (silu_mul: [M, N / 2]) through the two Triton launches (after
        _kernels_ready)."""
        from shard.kernels.int8_gemm import int8_gemm, m_bucket
        from shard.kernels.int8_quant import quantize_int8_per_token

        xq, a_scale = quantize_int8_per_token(x2)  # [M, K] int8, [M] float32
        config = self._gemm_configs[(x2.dtype, silu_mul)][m_bucket(x2.shape[0])]
        return int8_gemm(xq, a_scale, self.qweight, self.weight_scale, self.bias, x2.dtype,
                         config, silu_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self._kernels_ready(x2):
            return self._triton_forward(x2).reshape(*lead, self.out_features)
        xq, a_scale = quantize_per_token(x2)
        acc = int8_matmul(xq, self.qweight)  # [M, N]
        y = acc.float() * a_scale[:, None] * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8=int8"
