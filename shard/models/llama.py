"""Llama family (Llama, Mistral, Qwen2): GQA, RoPE (default/linear/llama3), sliding window,
tied embeddings, optional q/k/v bias. Module names equal checkpoint tensor names, so each
tensor-parallel layer loads its own slice."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shard import decode_linear
from shard.attention.base import AttentionMetadata
from shard.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    PushedPartial,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    reduce_add_rms_norm,
)
from shard.models.base import LoadContext
from shard.models.heads import partition_heads
from shard.quantization import QuantizeMethod, kv_cache_torch_dtype
from shard.quantization.fp8 import Fp8Linear
from shard.quantization.kv_cache import FP8_MAXES, KvCalibration, KvScales, scales_from_amax
from shard.quantization.loading import LinearQuantization
from shard.rotary import RotaryEmbedding, rope_parameters
from shard.weights import Weights

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value) pools


class FusedProjection:
    """Several column-parallel linears over the same input as one matmul (CUDA decode fast
    path): q/k/v or gate/up. Deliberately not an nn.Module: the parts stay the model's modules
    (checkpoint names, loaders), this only holds the merged weight they are views of."""

    def __init__(
        self,
        linear: Callable[[torch.Tensor], torch.Tensor],
        silu_mul: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.linear = linear
        # For gate/up: silu(gate) * up of the merged output, [n, in] -> [n, sum(out) / 2], in
        # one kernel where the decode GEMV serves the batch.
        self.silu_mul = silu_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, sum(out)]
        return self.linear(x)


def merge_rows(*linears: ColumnParallelLinear) -> FusedProjection | None:
    """One [sum(out), in] weight whose row blocks back the given column-parallel linears' weights
    (their weights become views: no extra memory). Plain weights and fp8 weights (each row keeps
    its scale) merge; None when any part has a bias or another quantization."""
    if all(m.quantized is None and m.weight is not None and m.bias is None for m in linears):
        merged = torch.cat([m.weight.data for m in linears])
        at = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight.data = merged[at : at + rows]
            at += rows
        return FusedProjection(lambda x: decode_linear.linear(x, merged),
                               lambda x: decode_linear.gate_up_silu(x, merged))
    if all(isinstance(m.quantized, Fp8Linear) and m.quantized.bias is None for m in linears):
        fp8 = Fp8Linear.merge_rows(*(m.quantized for m in linears))
        return FusedProjection(fp8, fp8.forward_silu_mul)
    return None


class LlamaAttention(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        cfg, world = ctx.config, ctx.dist.world_size
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        # Fewer KV heads than ranks: each rank loads the one KV head its query heads read.
        heads = partition_heads(self.num_heads, self.num_kv_heads, ctx.dist.rank, world)
        self.local_heads, self.local_kv_heads = heads.local_heads, heads.local_kv_heads
        kv_part = (heads.kv_part, heads.kv_parts)
        # Qwen2 always has q/k/v biases; Llama only with attention_bias.
        bias = cfg.get("attention_bias", False) or cfg["model_type"] == "qwen2"
        self.q_proj = ColumnParallelLinear(hidden, self.num_heads * self.head_dim, bias, ctx.dist)
        self.k_proj = ColumnParallelLinear(
            hidden, self.num_kv_heads * self.head_dim, bias, ctx.dist, kv_part
        )
        self.v_proj = ColumnParallelLinear(
            hidden, self.num_kv_heads * self.head_dim, bias, ctx.dist, kv_part
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim, hidden, cfg.get("attention_bias", False), ctx.dist
        )
        self.rotary = rotary
        self.attention = ctx.attention
        self.sliding_window = sliding_window
        self.scale = self.head_dim**-0.5
        self.qkv: FusedProjection | None = None  # set by merge_rows() on CUDA
        # fp8 caches: per-KV-head scales at fixed device addresses (CUDA graphs read them), 1.0
        # until warmup calibrates them; None for model-dtype caches.
        self.kv_scales: KvScales | None = None
        if kv_cache_torch_dtype(ctx.kv_cache_dtype, ctx.dtype) in FP8_MAXES:
            ones = torch.ones(self.local_kv_heads, dtype=torch.float32, device=ctx.device)
            self.kv_scales = KvScales(ones, ones.clone())
        self.kv_calibration: KvCalibration | None = None  # set while warmup observes K/V

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        reduce: bool = True,
    ) -> torch.Tensor:
        """-> [num_tokens, hidden]; with reduce=False this rank's un-reduced o_proj share."""
        n = x.shape[0]
        if self.qkv is not None and x.is_cuda:  # one GEMM for q, k and v
            nq, nk = self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([nq, nk, nk], dim=-1)
            q = q.view(n, self.local_heads, self.head_dim)
            k = k.view(n, self.local_kv_heads, self.head_dim)
            v = v.view(n, self.local_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(n, self.local_heads, self.head_dim)
            k = self.k_proj(x).view(n, self.local_kv_heads, self.head_dim)
            v = self.v_proj(x).view(n, self.local_kv_heads, self.head_dim)
        key_cache, value_cache = cache
        fused_decode = None
        if getattr(self.attention, "fuse_rotary_into_decode", False):
            fused_decode = self.attention.rotate_write_and_attend_decode
        fused_store = getattr(self.attention, "rotate_and_write_kv", None)
        fast = x.is_cuda and self.kv_calibration is None
        if (fused_decode is not None and fast and meta.is_decode_only
                and n == meta.seq_lens.shape[0]):  # rotary, cache store, attention: one kernel
            o = fused_decode(self.rotary, positions, q, k, v, key_cache, value_cache, meta,
                             self.scale, self.sliding_window, self.kv_scales)
        else:
            if fused_store is not None and fast:
                q = fused_store(self.rotary, positions, q, k, v, key_cache, value_cache,
                                meta.slot_mapping, self.kv_scales)  # one kernel for both steps
            else:
                q, k = self.rotary(positions, q, k)
                if self.kv_calibration is not None:
                    self.kv_calibration.observe(k, v)
                self.attention.write_kv(k, v, key_cache, value_cache, meta.slot_mapping,
                                        self.kv_scales)
            o = self.attention.attend(
                q, key_cache, value_cache, meta, self.scale, self.sliding_window, self.kv_scales
            )
        o = o.reshape(n, self.local_heads * self.head_dim)
        # Un-reduced: the layer's next step is the fused all-reduce + norm, so the GEMV may push.
        return self.o_proj(o) if reduce else self.o_proj.partial(o, push=True)


class LlamaMLP(nn.Module):
    def __init__(self, ctx: LoadContext):
        super().__init__()
        hidden, inter = ctx.config["hidden_size"], ctx.config["intermediate_size"]
        bias = ctx.config.get("mlp_bias", False)
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias, ctx.dist)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias, ctx.dist)
        self.down_proj = RowParallelLinear(inter, hidden, bias, ctx.dist)
        self.gate_up: FusedProjection | None = None  # set by merge_rows() on CUDA

    def forward(
        self, x: torch.Tensor, reduce: bool = True, push: bool = False
    ) -> torch.Tensor | PushedPartial:
        """x [num_tokens, hidden] -> [num_tokens, hidden]; with reduce=False this rank's
        un-reduced down_proj share (push: see RowParallelLinear.partial)."""
        if reduce:
            down = self.down_proj
        else:
            def down(h: torch.Tensor) -> torch.Tensor | PushedPartial:
                return self.down_proj.partial(h, push=push)
        if x.is_cuda:  # fused SiLU-and-mul: one kernel instead of two
            from shard.triton_ops import silu_mul

            if self.gate_up is not None:  # one pass over the merged gate/up weight
                return down(self.gate_up.silu_mul(x))
            return down(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return down(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        eps = ctx.config.get("rms_norm_eps", 1e-6)
        self.dist = ctx.dist
        self.self_attn = LlamaAttention(ctx, rotary, sliding_window)
        self.mlp = LlamaMLP(ctx)
        self.input_layernorm = RMSNorm(ctx.config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(ctx.config["hidden_size"], eps)

    def forward(self, x, positions, cache, meta):  # x [num_tokens, hidden]
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, delta, positions, cache, meta, last: bool = False):
        """The same layer with each residual add (and, under tensor parallelism, the all-reduce
        before it) fused into the following norm. The residual stream is x + the sum over ranks
        of delta, this rank's un-reduced share of the previous MLP output (None before the first
        layer); returns the new (x, delta) pair, delta still to be reduced and added. delta
        may be pushed into the all-reduce's buffers already (PushedPartial) except after the
        last layer, whose delta the caller slices to the rows that need logits."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        if delta is None:
            h = n1(x)
        else:
            h, x = reduce_add_rms_norm(self.dist, delta, x, n1)
        a = self.self_attn(h, positions, cache, meta, reduce=False)
        h, x = reduce_add_rms_norm(self.dist, a, x, n2)
        return x, self.mlp(h, reduce=False, push=not last)


class LlamaModel(nn.Module):
    def __init__(self, ctx: LoadContext, sliding_window: int | None):
        super().__init__()
        cfg = ctx.config
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rotary = RotaryEmbedding(
            head_dim, cfg["max_position_embeddings"], rope_parameters(cfg), ctx.device
        )
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], ctx.dist)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(ctx, rotary, sliding_window) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(nn.Module):
    """Serves model_type llama, mistral and qwen2."""

    def __init__(self, ctx: LoadContext):
        super().__init__()
        cfg = ctx.config
        self.vocab_size = cfg["vocab_size"]
        self.max_position_embeddings = cfg["max_position_embeddings"]
        # Qwen2 configs carry a sliding_window that only applies with use_sliding_window.
        window = cfg.get("sliding_window")
        if cfg["model_type"] == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        self.sliding_window: int | None = window
        self.model = LlamaModel(ctx, window)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], ctx.dist)
        attn = self.model.layers[0].self_attn
        self._kv_shape = (attn.local_kv_heads, attn.head_dim)
        self._dtype, self._device = ctx.dtype, ctx.device
        # fp8 caches store K/V / scale (per layer and KV head; shard/quantization/kv_cache.py).
        self._kv_dtype = kv_cache_torch_dtype(ctx.kv_cache_dtype, ctx.dtype)
        self.tie = cfg.get("tie_word_embeddings", False)
        # The fused-residual forward is the CUDA path; on CPU it exists for tests (same math).
        self.fused_residual = False
        quant = LinearQuantization.resolve(ctx.quantize, cfg)
        # bitsandbytes' LLM.int8() outlier path syncs with the host: no CUDA-graph capture.
        self.cuda_graph_safe = quant is None or quant.flag not in (
            QuantizeMethod.BITSANDBYTES, QuantizeMethod.BITSANDBYTES_NF4
        )
        self.load_weights(Weights(ctx.model_dir, ctx.device, ctx.dtype, ctx.dist, quant))

    def load_weights(self, weights: Weights) -> None:
        # Checkpoints with tied embeddings usually omit lm_head.weight.
        tie = self.tie or not weights.has("lm_head.weight")
        for name, module in self.named_modules():
            loader = getattr(module, "load", None)
            if callable(loader) and not (tie and name == "lm_head"):
                loader(weights, name)
        if tie:
            self.lm_head.tie_to(self.model.embed_tokens)
        if self._device.type == "cuda":
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                attn.qkv = merge_rows(attn.q_proj, attn.k_proj, attn.v_proj)
                mlp.gate_up = merge_rows(mlp.gate_proj, mlp.up_proj)

    def begin_kv_calibration(self) -> bool:
        """fp8 caches: start recording max |K|, |V| per layer and KV head (warmup's prefill).
        False (nothing to do) for model-dtype caches."""
        layers = [layer.self_attn for layer in self.model.layers]
        if layers[0].kv_scales is None:
            return False
        for attn in layers:
            attn.kv_calibration = KvCalibration(attn.local_kv_heads, self._device)
        return True

    def finish_kv_calibration(self, headroom: float | None = None) -> list[KvScales]:
        """Sets every layer's fp8 scales from what was observed (in place: captured graphs keep
        their addresses); returns them."""
        out = []
        for layer in self.model.layers:
            attn = layer.self_attn
            cal, scales = attn.kv_calibration, attn.kv_scales
            if cal is None or scales is None:
                continue
            kw = {} if headroom is None else {"headroom": headroom}
            scales.k_scale.copy_(scales_from_amax(cal.k_amax, self._kv_dtype, **kw))
            scales.v_scale.copy_(scales_from_amax(cal.v_amax, self._kv_dtype, **kw))
            attn.kv_calibration = None
            out.append(scales)
        return out

    def kv_bytes_per_block(self, block_size: int) -> int:
        heads, head_dim = self._kv_shape
        elem = torch.empty((), dtype=self._kv_dtype).element_size()
        return 2 * len(self.model.layers) * block_size * heads * head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        shape = (num_blocks, block_size, *self._kv_shape)
        return [
            (
                torch.zeros(shape, dtype=self._kv_dtype, device=self._device),
                torch.zeros(shape, dtype=self._kv_dtype, device=self._device),
            )
            for _ in self.model.layers
        ]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        embed = self.model.embed_tokens
        if input_ids.is_cuda or self.fused_residual:  # residual adds, all-reduces fused in norms
            delta = None
            if embed.dist.world_size > 1:
                # The lookup's all-reduce goes into the first norm like any row-parallel output:
                # the residual stream starts at 0 and the un-reduced lookup is its first delta
                # (0 + the exact sum: bit-identical to all-reduce, then norm).
                delta = embed.partial(input_ids)  # [num_tokens, hidden]
                x = torch.zeros_like(delta)
            else:
                x = embed(input_ids)  # [num_tokens, hidden]
            layers = self.model.layers
            for i, (layer, cache) in enumerate(zip(layers, kv_cache)):
                x, delta = layer.forward_fused(x, delta, positions, cache, meta,
                                               last=i == len(layers) - 1)
            # Only the rows that need logits are reduced and normalized: [num_logits, hidden].
            h, _ = reduce_add_rms_norm(
                self.model.layers[-1].dist, delta[logits_indices], x[logits_indices],
                self.model.norm,
            )
            return self.lm_head(h)
        x = embed(input_ids)  # [num_tokens, hidden]
        for layer, cache in zip(self.model.layers, kv_cache):
            x = layer(x, positions, cache, meta)
        x = self.model.norm(x[logits_indices])  # [num_logits, hidden]
        return self.lm_head(x)
