"""bitsandbytes int8 (LLM.int8()) and nf4 linears.

`bitsandbytes` is an optional dependency (the `gpu` extra); it is imported only when a
bitsandbytes method is asked for, and its absence is reported naming the flag. bitsandbytes 0.50
runs both paths on CPU too (int8 through its vectorwise kernels, nf4 through a dequantizing
fallback), so CI exercises them there.

Both modules quantize when the weight moves to its device: bitsandbytes' Int8Params/Params4bit
quantize on `.to(device)` from a CPU tensor, so the (already TP-sliced) weight passes through host
memory one layer at a time; peak extra memory is one layer's weight.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from shard.quantization.methods import QuantizeMethod

# LLM.int8() outlier threshold: activation columns with a magnitude above it run in 16-bit.
INT8_THRESHOLD = 6.0
NF4_BLOCKSIZE = 64


def import_bitsandbytes(method: QuantizeMethod) -> types.ModuleType:
    """Imports bitsandbytes or raises a RuntimeError naming the flag that needed it."""
    try:
        import bitsandbytes
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            f"{method.flag} needs the `bitsandbytes` package, which is not installed: "
            "pip install 'tokenwire[gpu]' (or pip install bitsandbytes)"
        ) from exc
    return bitsandbytes


class BnbLinear(nn.Module):
    """Wraps a bitsandbytes Linear8bitLt / Linear4bit built from a float weight."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out, in]
        bias: torch.Tensor | None,
        method: QuantizeMethod,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        bnb = import_bitsandbytes(method)
        out_features, in_features = weight.shape
        device = weight.device
        dtype = compute_dtype or (weight.dtype if weight.dtype.is_floating_point else torch.float16)
        self.method = method
        self.in_features = in_features
        self.out_features = out_features
        host = weight.detach().to("cpu", dtype)
        if method is QuantizeMethod.BITSANDBYTES:
            inner = bnb.nn.Linear8bitLt(
                in_features,
                out_features,
                bias=bias is not None,
                has_fp16_weights=False,
                threshold=INT8_THRESHOLD,
                device="meta",
            )
            inner.weight = bnb.nn.Int8Params(host, requires_grad=False, has_fp16_weights=False)
        elif method is QuantizeMethod.BITSANDBYTES_NF4:
            inner = bnb.nn.Linear4bit(
                in_features,
                out_features,
                bias=bias is not None,
                compute_dtype=dtype,
                quant_type="nf4",
                device="meta",
            )
            inner.weight = bnb.nn.Params4bit(
                host, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCKSIZE
            )
        else:
            raise ValueError(f"BnbLinear: {method} is not a bitsandbytes method")
        if bias is not None:
            inner.bias = nn.Parameter(bias.detach().to("cpu", dtype), requires_grad=False)
        # Quantization happens here (CPU -> device).
        self.inner = inner.to(device)

    @property
    def weight_bytes(self) -> int:
        w = self.inner.weight
        total = w.numel() * w.element_size()
        scb = getattr(w, "SCB", None)  # int8: one float32 scale per row
        if scb is not None:
            total += scb.numel() * scb.element_size()
        state = getattr(w, "quant_state", None)  # nf4: absmax per block (itself quantized)
        if state is not None:
            for t in (state.absmax, getattr(state, "code", None)):
                if t is not None:
                    total += t.numel() * t.element_size()
            nested = getattr(state, "state2", None)
            if nested is not None:
                total += nested.absmax.numel() * nested.absmax.element_size()
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        return self.inner(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method.value}"
