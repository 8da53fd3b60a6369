"""Gemma 2 and Gemma 3 (text): Llama's layers with Gemma's options. Only assembles layers.

What differs from Llama, each a layer option:
- embeddings times sqrt(hidden) (VocabParallelEmbedding scale, in the model dtype);
- RMSNorm scaling by (1 + w) (RMSNorm weight_offset), and four norms per layer: input and
  post-attention around the attention, pre- and post-feedforward around the MLP ("sandwich":
  each sub-block's output is normalized before the residual add);
- gated MLP with GELU (tanh approximation) (MergedColumnParallelLinear.forward_act_mul);
- softmax scale query_pre_attn_scalar ** -0.5; Gemma 2's attention-logit soft-capping
  (PagedAttention softcap: the attention kernels cap the scores); final-logit soft-capping
  (ParallelLMHead softcap);
- local (sliding window) and global layers (shard/models/layer_types.py), each with its own
  rotary table: Gemma 3's local layers rotate with rope_local_base_freq, its global layers with
  rope_theta and the config's scaling;
- Gemma 3: per-head RMSNorm of q and k before rotary (shard/layers/qk_norm.py's HEAD kind, with
  the (1 + w) offset).

Every layer's KV cache holds the whole context, local layers included (docs/models.md: why, and
what keeping only the window would save).
"""

from __future__ import annotations

import json

import torch
from torch import nn

from shard.attention.base import AttentionMetadata
from shard.layers.attention import PagedAttention
from shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard.layers.linear import GATED_ACTIVATIONS, MergedColumnParallelLinear, RowParallelLinear
from shard.layers.norm import RMSNorm, add_rms_norm
from shard.layers.qk_norm import HeadRMSNorm, qk_rms_norm
from shard.layers.rotary import RotaryEmbedding, rope_parameters
from shard.models.base import LoadContext, NotServedNatively
from shard.models.heads import partition_heads
from shard.models.layer_types import layer_types, layer_windows
from shard.models.paged_kv import KVCache, PagedKVCacheModel, graph_safe, load_weights
from shard.quantization import kv_cache_torch_dtype
from shard.quantization.loading import LinearQuantization
from shard.quantization.methods import KvCacheRotation

GEMMA_NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w)


def _norm(ctx: LoadContext, size: int) -> RMSNorm:
    return RMSNorm(size, ctx.config.get("rms_norm_eps", 1e-6), GEMMA_NORM_OFFSET)


class GemmaAttention(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        cfg, world = ctx.config, ctx.dist.world_size
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        split = partition_heads(heads, kv_heads, ctx.dist.rank, world)
        kv_block = (split.kv_part, split.kv_parts)
        bias = cfg.get("attention_bias", False)
        parts = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                 "v_proj": kv_heads * head_dim}
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, parts, bias, ctx.dist, merge=True,
            row_blocks={"k_proj": kv_block, "v_proj": kv_block},
        )
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias, ctx.dist)
        # Gemma 3 has q/k norms; its attention ignores attn_logit_softcapping (transformers
        # passes no softcap there), Gemma 2 caps.
        self.q_norm: HeadRMSNorm | None = None
        self.k_norm: HeadRMSNorm | None = None
        softcap = cfg.get("attn_logit_softcapping")
        if cfg["model_type"] != "gemma2":
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = HeadRMSNorm(head_dim, eps, GEMMA_NORM_OFFSET)
            self.k_norm = HeadRMSNorm(head_dim, eps, GEMMA_NORM_OFFSET)
            softcap = None
        self.attn = PagedAttention(
            ctx.attention, rotary, split.local_heads, split.local_kv_heads, head_dim, sliding_window,
            kv_cache_torch_dtype(ctx.kv_cache_dtype, ctx.dtype), ctx.device, kv_part=kv_block,
            rotate_keys=ctx.kv_cache_rotation is KvCacheRotation.HADAMARD,
            scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            softcap=softcap or None,
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], reduced over ranks
        n, a = x.shape[0], self.attn
        q, k, v = self.qkv_proj(x)
        q, k = q.view(n, a.num_heads, a.head_dim), k.view(n, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Gemma 3, before rotary
            q, k = qk_rms_norm(q, k, self.q_norm, self.k_norm)
        o = a(q, k, v.view(n, a.num_kv_heads, a.head_dim), positions, cache, meta)
        return self.o_proj(o)


class GemmaMLP(nn.Module):
    def __init__(self, ctx: LoadContext):
        super().__init__()
        cfg = ctx.config
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
        if self.activation not in GATED_ACTIVATIONS:
            raise NotServedNatively(f"hidden_activation {self.activation!r}")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, {"gate_proj": inter, "up_proj": inter}, False, ctx.dist, merge=True,
        )
        self.down_proj = RowParallelLinear(inter, hidden, False, ctx.dist)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden], reduced
        return self.down_proj(self.gate_up_proj.forward_act_mul(x, self.activation))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        hidden = ctx.config["hidden_size"]
        self.self_attn = GemmaAttention(ctx, rotary, sliding_window)
        self.mlp = GemmaMLP(ctx)
        self.input_layernorm = _norm(ctx, hidden)
        self.post_attention_layernorm = _norm(ctx, hidden)
        self.pre_feedforward_layernorm = _norm(ctx, hidden)
        self.post_feedforward_layernorm = _norm(ctx, hidden)

    def forward(self, x, pending, positions, cache, meta):
        """Residual stream x [num_tokens, hidden] and pending, the previous layer's MLP output
        and post-feedforward norm, still to be normalized and added (None before the first
        layer). Each sub-block's post-norm, residual add and the next pre-norm are one fused
        step (add_rms_norm with delta_norm). Returns the new (x, pending)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            h, x = add_rms_norm(pending[0], x, self.input_layernorm, pending[1])
        a = self.self_attn(h, positions, cache, meta)
        h, x = add_rms_norm(a, x, self.pre_feedforward_layernorm, self.post_attention_layernorm)
        return x, (self.mlp(h), self.post_feedforward_layernorm)


class GemmaModel(nn.Module):
    def __init__(self, ctx: LoadContext):
        super().__init__()
        cfg = ctx.config
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        # One rotary table per distinct parameter set of the layer types (Gemma 2: one for both;
        # Gemma 3: local and global bases).
        tables: dict[str, RotaryEmbedding] = {}
        rotaries: dict[str, RotaryEmbedding] = {}
        for t in sorted(set(layer_types(cfg))):
            params = rope_parameters(cfg, t)
            key = json.dumps(params, sort_keys=True)
            if key not in tables:
                tables[key] = RotaryEmbedding(head_dim, cfg["max_position_embeddings"], params,
                                              ctx.device)
            rotaries[t] = tables[key]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden, ctx.dist,
                                                   scale=hidden**0.5)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(ctx, rotaries[t], w)
            for t, w in zip(layer_types(cfg), layer_windows(cfg), strict=True)
        )
        self.norm = _norm(ctx, hidden)


class GemmaForCausalLM(PagedKVCacheModel, nn.Module):
    """Serves model_type gemma2 and gemma3_text (Gemma3ForCausalLM checkpoints)."""

    model_impl = "native"
    supports_lora = True  # shard/lora adapts qkv_proj, o_proj, gate_up_proj and down_proj
    supports_images = False  # text only (VLMs: the transformers backend)

    def __init__(self, ctx: LoadContext):
        super().__init__()
        cfg = ctx.config
        if cfg.get("use_bidirectional_attention"):  # embedding models (EmbeddingGemma)
            raise NotServedNatively("use_bidirectional_attention (only causal attention)")
        self.vocab_size = cfg["vocab_size"]
        self.max_position_embeddings = cfg["max_position_embeddings"]
        self.attention_name = ctx.attention.name
        # The model-wide window the shard reports: None, since the global layers see the whole
        # context (each local layer's window is its attention layer's option).
        self.sliding_window: int | None = None
        self.model = GemmaModel(ctx)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], ctx.dist,
                                      softcap=cfg.get("final_logit_softcapping") or None)
        self.attns = [layer.self_attn.attn for layer in self.model.layers]
        self._device = ctx.device
        quant = LinearQuantization.resolve(ctx.quantize, cfg)
        # Soft-capping and windows are kernel options: the decode step reads device tensors only.
        self.cuda_graph_safe = graph_safe(quant)
        # Gemma ties the LM head to the embedding (the default); checkpoints omit lm_head.weight.
        load_weights(self, ctx, quant, self.model.embed_tokens, self.lm_head,
                     tied=cfg.get("tie_word_embeddings", True))

    def take_expert_counts(self) -> torch.Tensor | None:
        return None  # dense (CausalLM's MoE routing statistics)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        pending = None
        for layer, cache in zip(self.model.layers, kv_cache):
            x, pending = layer(x, pending, positions, cache, meta)
        # Only the rows that need logits: [num_logits, hidden].
        mlp_out, post_norm = pending
        h, _ = add_rms_norm(mlp_out[logits_indices], x[logits_indices], self.model.norm,
                            post_norm)
        return self.lm_head(h)
