"""Llama family (Llama, Mistral, Qwen2): GQA, RoPE (default/linear/llama3), sliding window,
tied embeddings, optional q/k/v bias. Only assembles layers (shard/layers/): module names equal
checkpoint tensor names, and each tensor-parallel layer loads its own slice.

Families that differ from Llama only in layer options (LayerOptions: q/k norms, checkpoint-fused
projections) or in their decoder layer (OLMo-2's post-norms) subclass LlamaForCausalLM in files
of their own (qwen3.py, phi3.py, olmo2.py), setting `options`, `decoder_layer` and
`fuses_residuals`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shard.attention.base import AttentionMetadata
from shard.layers.attention import PagedAttention, o_proj_warm_target
from shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard.layers.linear import MergedColumnParallelLinear, PushedPartial, RowParallelLinear
from shard.layers.norm import RMSNorm, reduce_add_rms_norm
from shard.layers.qk_norm import HeadRMSNorm, ProjectionRMSNorm, QKNormKind, qk_rms_norm
from shard.layers.rotary import RotaryEmbedding, rope_parameters
from shard.models.base import LoadContext
from shard.models.heads import partition_heads
from shard.models.paged_kv import KVCache, PagedKVCacheModel, graph_safe, load_weights
from shard.quantization import kv_cache_torch_dtype
from shard.quantization.loading import LinearQuantization
from shard.quantization.methods import KvCacheRotation

# (ctx, layer index) -> the layer's MLP: called as mlp(x, reduce=..., push=...) (LlamaMLP's call);
# MoE families pass their sparse blocks (shard/models/mixtral.py).
MlpFactory = Callable[[LoadContext, int], nn.Module]


@dataclass(frozen=True)
class LayerOptions:
    """A family's quirks as options of these layers."""

    qk_norm: QKNormKind | None = None  # RMSNorm of q and k before rotary (shard/layers/qk_norm.py)
    # The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3).
    fused_checkpoint: bool = False


class LlamaAttention(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 opts: LayerOptions = LayerOptions()):
        super().__init__()
        cfg, world = ctx.config, ctx.dist.world_size
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        # Fewer KV heads than ranks: each rank loads the one KV head its query heads read.
        split = partition_heads(heads, kv_heads, ctx.dist.rank, world)
        kv_block = (split.kv_part, split.kv_parts)
        # Qwen2 always has q/k/v biases, Qwen2-MoE by qkv_bias; Llama only with attention_bias.
        bias = (cfg.get("attention_bias", False) or cfg["model_type"] == "qwen2"
                or cfg.get("qkv_bias", cfg["model_type"] == "qwen2_moe"))
        parts = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                 "v_proj": kv_heads * head_dim}
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, parts, bias, ctx.dist, merge=True,
            row_blocks={"k_proj": kv_block, "v_proj": kv_block},
            fused_checkpoint=opts.fused_checkpoint,
        )
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm: HeadRMSNorm | ProjectionRMSNorm | None = None
        self.k_norm: HeadRMSNorm | ProjectionRMSNorm | None = None
        if opts.qk_norm is QKNormKind.HEAD:
            self.q_norm, self.k_norm = HeadRMSNorm(head_dim, eps), HeadRMSNorm(head_dim, eps)
        elif opts.qk_norm is QKNormKind.PROJECTION:
            replicas = world * split.local_kv_heads // kv_heads  # > 1: replicated KV heads
            self.q_norm = ProjectionRMSNorm(heads * head_dim, eps, ctx.dist,
                                            (ctx.dist.rank, world), 1)
            self.k_norm = ProjectionRMSNorm(kv_heads * head_dim, eps, ctx.dist, kv_block, replicas)
        self.o_proj = RowParallelLinear(
            heads * head_dim, hidden, cfg.get("attention_bias", False), ctx.dist
        )
        self.attn = PagedAttention(
            ctx.attention, rotary, split.local_heads, split.local_kv_heads, head_dim, sliding_window,
            kv_cache_torch_dtype(ctx.kv_cache_dtype, ctx.dtype), ctx.device, kv_part=kv_block,
            rotate_keys=ctx.kv_cache_rotation is KvCacheRotation.HADAMARD,
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        reduce: bool = True,
    ) -> torch.Tensor:
        """-> [num_tokens, hidden]; with reduce=False this rank's un-reduced o_proj share."""
        q, k, v = self.qkv_proj(x)
        return self.forward_projected(q, k, v, positions, cache, meta, reduce)

    def forward_projected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                          meta: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        """forward after the qkv projection: q [n, heads * head_dim], k and v [n, kv_heads *
        head_dim] (this rank's) -> [n, hidden]."""
        n, a = q.shape[0], self.attn
        q, k = q.view(n, a.num_heads, a.head_dim), k.view(n, a.num_kv_heads, a.head_dim)
        head_norms = None
        if isinstance(self.q_norm, HeadRMSNorm) and isinstance(self.k_norm, HeadRMSNorm):
            head_norms = (self.q_norm, self.k_norm)  # the attention layer applies them
        elif self.q_norm is not None and self.k_norm is not None:
            q, k = qk_rms_norm(q, k, self.q_norm, self.k_norm)
        o = a(q, k, v.view(n, a.num_kv_heads, a.head_dim), positions, cache, meta,
              warm=o_proj_warm_target(self.o_proj.streamed_weight()), head_norms=head_norms)
        # Un-reduced: the layer's next step is the fused all-reduce + norm, so the GEMV may push.
        return self.o_proj(o) if reduce else self.o_proj.partial(o, push=True)


class LlamaMLP(nn.Module):
    def __init__(self, ctx: LoadContext, opts: LayerOptions = LayerOptions()):
        super().__init__()
        hidden, inter = ctx.config["hidden_size"], ctx.config["intermediate_size"]
        bias = ctx.config.get("mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, {"gate_proj": inter, "up_proj": inter}, bias, ctx.dist,
            merge=True, fused_checkpoint=opts.fused_checkpoint,
        )
        self.down_proj = RowParallelLinear(inter, hidden, bias, ctx.dist)

    def forward(
        self, x: torch.Tensor, reduce: bool = True, push: bool = False
    ) -> torch.Tensor | PushedPartial:
        """x [num_tokens, hidden] -> [num_tokens, hidden]; with reduce=False this rank's
        un-reduced down_proj share (push: see RowParallelLinear.partial)."""
        h = self.gate_up_proj.forward_silu_mul(x)  # [num_tokens, intermediate / world]
        return self.down_proj(h) if reduce else self.down_proj.partial(h, push=push)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 opts: LayerOptions = LayerOptions(), mlp: nn.Module | None = None,
                 mlp_name: str = "mlp"):
        super().__init__()
        eps = ctx.config.get("rms_norm_eps", 1e-6)
        self.dist = ctx.dist
        self.self_attn = LlamaAttention(ctx, rotary, sliding_window, opts)
        # The MLP under its checkpoint name (Mixtral: block_sparse_moe); self.mlp is the same.
        setattr(self, mlp_name, mlp if mlp is not None else LlamaMLP(ctx, opts))
        self.mlp = getattr(self, mlp_name)
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
        attn = self.self_attn
        # One rank: the add + norm may run in the qkv GEMV's own launch (opt-in,
        # shard/layers/linear.norm_prologue); then qkv is (q, k, v) and x the new residual.
        qkv = attn.qkv_proj.forward_add_rms_norm(delta, x, n1.weight, n1.eps, n1.weight_offset) \
            if self.dist.world_size == 1 and isinstance(delta, torch.Tensor) else None
        if qkv is not None:
            (q, k, v), x = qkv
            a = attn.forward_projected(q, k, v, positions, cache, meta, reduce=False)
        else:
            if delta is None:
                h = n1(x)
            else:
                h, x = reduce_add_rms_norm(self.dist, delta, x, n1)
            a = attn(h, positions, cache, meta, reduce=False)
        # An MLP that fuses the add + norm into its own first launch where it can (MoE blocks:
        # with the router and routing, shard/kernels/moe_router.py) returns (x, delta) there.
        fused = getattr(self.mlp, "forward_add_norm", None)
        done = fused(a, x, n2, push=not last) if fused is not None else None
        if done is not None:
            return done
        h, x = reduce_add_rms_norm(self.dist, a, x, n2)
        return x, self.mlp(h, reduce=False, push=not last)


class LlamaModel(nn.Module):
    def __init__(self, ctx: LoadContext, sliding_window: int | None,
                 opts: LayerOptions = LayerOptions(),
                 layer: type[nn.Module] = LlamaDecoderLayer,
                 mlp: MlpFactory | None = None, mlp_name: str = "mlp"):
        super().__init__()
        cfg = ctx.config
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rotary = RotaryEmbedding(
            head_dim, cfg["max_position_embeddings"], rope_parameters(cfg), ctx.device
        )
        self.rotary = rotary  # shared by every layer's attention
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], ctx.dist)
        self.layers = nn.ModuleList(
            layer(ctx, rotary, sliding_window, opts,
                  **({"mlp": mlp(ctx, i), "mlp_name": mlp_name} if mlp else {}))
            for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(PagedKVCacheModel, nn.Module):
    """Serves model_type llama, mistral and qwen2; the base of the families in their own files."""

    model_impl = "native"
    supports_lora = True  # shard/lora adapts qkv_proj, o_proj, gate_up_proj and down_proj
    supports_images = False  # text only (VLMs: the transformers backend)
    options = LayerOptions()  # the family's layer options
    # Built as decoder_layer(ctx, rotary, sliding_window, options); has forward(x, positions,
    # cache, meta) -> x, and forward_fused (LlamaDecoderLayer's) where fuses_residuals.
    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    # Whether the decoder layer has forward_fused (residual adds and all-reduces fused into the
    # next norm: pre-norm layers); post-norm layers run their plain forward on every device.
    fuses_residuals = True

    def __init__(self, ctx: LoadContext, mlp: MlpFactory | None = None, mlp_name: str = "mlp"):
        """mlp: each layer's MLP (default LlamaMLP), registered under mlp_name."""
        super().__init__()
        cfg = ctx.config
        self.vocab_size = cfg["vocab_size"]
        self.max_position_embeddings = cfg["max_position_embeddings"]
        self.attention_name = ctx.attention.name
        # Qwen2 / Qwen3 configs carry a sliding_window that only applies with use_sliding_window.
        window = cfg.get("sliding_window")
        if (cfg["model_type"] in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
                and not cfg.get("use_sliding_window", False)):
            window = None
        self.sliding_window: int | None = window
        self.model = LlamaModel(ctx, window, self.options, self.decoder_layer, mlp, mlp_name)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], ctx.dist)
        self.attns = [layer.self_attn.attn for layer in self.model.layers]
        self._device = ctx.device
        # The fused-residual forward is the CUDA path; on CPU it exists for tests (same math).
        self.fused_residual = False
        quant = LinearQuantization.resolve(ctx.quantize, cfg)
        self.cuda_graph_safe = graph_safe(quant)
        load_weights(self, ctx, quant, self.model.embed_tokens, self.lm_head,
                     tied=cfg.get("tie_word_embeddings", False))

    def take_expert_counts(self) -> torch.Tensor | None:
        return None  # dense; MoE families override (shard/models/moe.py)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        embed, layers = self.model.embed_tokens, self.model.layers
        positions = self.model.rotary.table_rows(positions, meta)  # LongRoPE: per sequence
        if not self.fuses_residuals or not (input_ids.is_cuda or self.fused_residual):
            x = embed(input_ids)  # [num_tokens, hidden]
            for layer, cache in zip(layers, kv_cache):
                x = layer(x, positions, cache, meta)
            return self.lm_head(self.model.norm(x[logits_indices]))  # [num_logits, hidden] in
        # Residual adds (and all-reduces) fused into the norms.
        delta = None
        if embed.dist.world_size > 1:
            # The lookup's all-reduce goes into the first norm like any row-parallel output: the
            # residual stream starts at 0 and the un-reduced lookup is its first delta (0 + the
            # exact sum: bit-identical to all-reduce, then norm).
            delta = embed.partial(input_ids)  # [num_tokens, hidden]
            x = torch.zeros_like(delta)
        else:
            x = embed(input_ids)  # [num_tokens, hidden]
        for i, (layer, cache) in enumerate(zip(layers, kv_cache)):
            x, delta = layer.forward_fused(x, delta, positions, cache, meta,
                                           last=i == len(layers) - 1)
        # Only the rows that need logits are reduced and normalized: [num_logits, hidden].
        h, _ = reduce_add_rms_norm(layers[-1].dist, delta[logits_indices], x[logits_indices],
                                   self.model.norm)
        return self.lm_head(h)
