"""The attention layer: rotary embedding -> KV-cache write -> attention over the paged cache, for
one decoder layer's already projected q/k/v, through an AttentionBackend.

Which kernels run is the backend's business; the order of the three steps, and when they may be
fused, is this layer's: a decode-only step takes the backend's one-kernel
rotate_write_and_attend_decode where it fuses rotary into decode, other steps its
rotate_and_write_kv then attend. While warmup calibrates an fp8 KV cache the steps run apart, so
that the rotated K and V can be observed before they are stored; an fp8 cache with key rotation
(shard/quantization/kv_rotation.py) always runs them apart, multiplying q and k by R between
rotary and the store.
"""

from __future__ import annotations

import torch
from torch import nn

from shard.attention.base import AttentionBackend, AttentionMetadata
from shard.kernels.head_norms import HeadNorms
from shard.kernels.setting import Setting
from shard.layers.qk_norm import HeadRMSNorm, qk_rms_norm
from shard.layers.rotary import RotaryEmbedding
from shard.layers.weights import WeightLoader, Weights
from shard.quantization.kv_cache import FP8_MAXES, KvCalibration, KvScales, scales_from_amax
from shard.quantization.kv_rotation import orthogonal_rotation, rotate_heads

# Whether decode attention warms the o_proj weight into L2 while it runs (shard/kernels/
# l2_warm.py). Off: at Qwen3-30B-A3B's batch-1 step on an H200 (benchmarks/MOE_B1.md, round 16)
# it was noise with fp8 o_proj (8 MiB: -2.2 to +0.5 us a layer) and mostly a loss with bf16
# (16 MiB, more than the merge's window holds: -0.8 to +4.7), and is unmeasured on dense shapes.
WARM_O_PROJ = Setting(False)
# Whether a decode-only step applies per-head q/k RMSNorms inside the fused rotary + store +
# attention launch where the backend can (fuses_qk_norm_into_decode) instead of its own launch.
# On: one launch a layer fewer; the Qwen3-30B-A3B batch-1 step (H200, interleaved A/B) took
# 1.1-2.8 us a layer less in bf16 and the same in fp8.
FUSE_QK_NORM = Setting(True)


def o_proj_warm_target(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The o_proj weight (RowParallelLinear.streamed_weight) for the attention launch to warm,
    when WARM_O_PROJ is on and it can be (a contiguous CUDA tensor); else None."""
    if not WARM_O_PROJ.value or weight is None or not weight.is_cuda or not weight.is_contiguous():
        return None
    return weight


def kernel_head_norms(q_norm: HeadRMSNorm, k_norm: HeadRMSNorm) -> HeadNorms | None:
    """The two per-head norms as one decode launch applies them (one eps and weight offset for
    both), or None where they differ."""
    if q_norm.eps != k_norm.eps or q_norm.weight_offset != k_norm.weight_offset:
        return None
    return HeadNorms(q_norm.weight, k_norm.weight, q_norm.eps, q_norm.weight_offset)


class PagedAttention(nn.Module, WeightLoader):
    """Attention of this rank's heads: num_heads query heads over num_kv_heads KV heads (GQA).

    Its only checkpoint tensors are optional fp8 KV-cache scales, `{parent}.k_scale` and
    `{parent}.v_scale` beside the projections (e.g. `model.layers.0.self_attn.k_scale`, as
    `tokenwire quantize` and llm-compressor write them): one float per KV head ([num_kv_heads])
    or per layer ([] / [1]), stored = x / scale. With an fp8 cache they replace warmup's
    calibration; with a model-dtype cache they are ignored."""

    def __init__(
        self,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        kv_dtype: torch.dtype,  # the cache's storage dtype
        device: torch.device,
        kv_part: tuple[int, int] | None = None,  # which of the layer's KV-head parts this is
        rotate_keys: bool = False,  # fp8 caches: store keys rotated (shard/quantization/kv_rotation.py)
        scale: float | None = None,  # softmax scale (None: head_dim ** -0.5; Gemma:
        # query_pre_attn_scalar ** -0.5)
        softcap: float | None = None,  # attention-logit soft-capping (Gemma 2), None: none
    ):
        super().__init__()
        self.backend = backend
        self.rotary = rotary
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Per layer: alternating local / global layers (Gemma) pass a window or None each.
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.kv_dtype = kv_dtype
        # fp8 caches: per-KV-head scales at fixed device addresses (CUDA graphs read them), 1.0
        # until warmup calibrates them; None for model-dtype caches.
        self.kv_scales: KvScales | None = None
        if kv_dtype in FP8_MAXES:
            ones = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
            self.kv_scales = KvScales(ones, ones.clone())
        self.kv_calibration: KvCalibration | None = None  # set while warmup observes K/V
        # (index, count): this rank holds KV-head part `index` of `count` equal parts (None:
        # (rank, world) of the weights' dist); slices a checkpoint's per-head scales.
        self.kv_part = kv_part
        self.kv_scales_from_checkpoint = False  # then warmup leaves the scales alone
        # fp8 caches with key rotation: R [head_dim, head_dim] (float32 until the first step puts
        # it in the activation dtype); q and k are multiplied by it after rotary, so the cache
        # holds rotated keys. None: no rotation.
        self.key_rotation: torch.Tensor | None = None
        if rotate_keys and self.kv_scales is not None:
            self.key_rotation = orthogonal_rotation(head_dim).to(device)

    def load(self, weights: Weights, prefix: str) -> None:
        """Reads the checkpoint's fp8 KV scales, if it has them and the cache is fp8."""
        parent = prefix.rpartition(".")[0]
        names = (f"{parent}.k_scale", f"{parent}.v_scale")
        if self.kv_scales is None or not all(weights.has(n) for n in names):
            return
        index, count = self.kv_part or (weights.dist.rank, weights.dist.world_size)
        for name, target in zip(names, (self.kv_scales.k_scale, self.kv_scales.v_scale)):
            stored = weights.get(name, raw=True).float().reshape(-1)  # [kv_heads] or [1]
            if stored.numel() == 1:
                target.fill_(float(stored))
                continue
            if stored.numel() != self.num_kv_heads * count:
                raise ValueError(
                    f"{name}: {stored.numel()} scales, expected 1 or one per KV head "
                    f"({self.num_kv_heads * count})"
                )
            local = stored[index * self.num_kv_heads : (index + 1) * self.num_kv_heads]
            if not bool((local > 0).all()) or not bool(torch.isfinite(local).all()):
                raise ValueError(f"{name}: scales must be finite and positive, got {local.tolist()}")
            target.copy_(local.to(target.device))
        self.kv_scales_from_checkpoint = True
        self.key_rotation = None  # the checkpoint's scales describe unrotated keys

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], not yet rotated
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not yet rotated
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [num_tokens]
        cache: tuple[torch.Tensor, torch.Tensor],  # [num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        warm: torch.Tensor | None = None,  # the o_proj weight: a hint (AttentionBackend.attend)
        # Per-head q/k RMSNorms to apply first (Qwen3, Gemma 3): inside the decode launch where
        # the backend fuses them (FUSE_QK_NORM), else their own launch here.
        head_norms: tuple[HeadRMSNorm, HeadRMSNorm] | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        n, b = q.shape[0], self.backend
        key_cache, value_cache = cache
        apart = self.kv_calibration is not None or self.key_rotation is not None
        one_kernel = (not apart and b.fuse_rotary_into_decode and meta.is_decode_only
                      and n == meta.seq_lens.shape[0])
        norms = None
        if head_norms is not None:
            if one_kernel and b.fuses_qk_norm_into_decode and FUSE_QK_NORM.value:
                norms = kernel_head_norms(*head_norms)
            if norms is None:
                q, k = qk_rms_norm(q, k, *head_norms)
        if apart:
            # Steps apart: warmup observes K/V as stored; key rotation multiplies q and k by R
            # after rotary (the fused kernels apply rotary only).
            q, k = self.rotary(positions, q, k)
            if self.key_rotation is not None:
                r = self.key_rotation
                if r.dtype != q.dtype:  # first step: keep R in the activation dtype from now on
                    r = self.key_rotation = r.to(q.dtype)
                q, k = rotate_heads(q, r), rotate_heads(k, r)
            if self.kv_calibration is not None:
                self.kv_calibration.observe(k, v)
            b.write_kv(k, v, key_cache, value_cache, meta.slot_mapping, self.kv_scales)
        elif one_kernel:  # (q/k norms,) rotary, cache store, attention: one kernel
            o = b.rotate_write_and_attend_decode(
                self.rotary, positions, q, k, v, key_cache, value_cache, meta, self.scale,
                self.sliding_window, self.kv_scales, self.softcap, warm, norms,
            )
            return o.reshape(n, self.num_heads * self.head_dim)
        else:
            q = b.rotate_and_write_kv(self.rotary, positions, q, k, v, key_cache, value_cache,
                                      meta.slot_mapping, self.kv_scales)
        o = b.attend(q, key_cache, value_cache, meta, self.scale, self.sliding_window,
                     self.kv_scales, self.softcap, warm)
        return o.reshape(n, self.num_heads * self.head_dim)

    def begin_kv_calibration(self) -> bool:
        """fp8 caches: start recording max |K|, |V| per KV head; False for model-dtype caches
        and for scales the checkpoint gave."""
        if self.kv_scales is None or self.kv_scales_from_checkpoint:
            return False
        self.kv_calibration = KvCalibration(self.num_kv_heads, self.kv_scales.k_scale.device)
        return True

    def finish_kv_calibration(self, headroom: float | None = None) -> KvScales | None:
        """Sets the fp8 scales from what was observed (in place: captured graphs keep their
        addresses) and returns them; None when nothing was calibrated."""
        cal, scales = self.kv_calibration, self.kv_scales
        if cal is None or scales is None:
            return None
        kw = {} if headroom is None else {"headroom": headroom}
        scales.k_scale.copy_(scales_from_amax(cal.k_amax, self.kv_dtype, **kw))
        scales.v_scale.copy_(scales_from_amax(cal.v_amax, self.kv_dtype, **kw))
        self.kv_calibration = None
        return scales
