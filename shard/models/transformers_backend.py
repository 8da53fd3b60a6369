"""The transformers backend: any decoder-only transformers model on tokenwire's engine.

The model is transformers' own modeling code (the installed 5.x), loaded with
`attn_implementation` set to tokenwire's paged attention (shard/models/transformers_attention.py),
its planned projections swapped for tokenwire's tensor-parallel linears
(shard/models/transformers_tp.py). A step is the same flat ragged batch as on the native path:
the new tokens of every sequence as ONE packed sequence [1, num_tokens] with each token's own
position id, the paged KV cache and AttentionMetadata telling attention where each sequence's
context lives. Nothing is recomputed across steps. The model's own head runs on the rows that
need logits (`logits_to_keep`), so final soft-capping and logit scales stay the model's.

Which models: transformers' causal-LM class of the config, decoder-only, whose attention goes
through the attention interface (shard/models/transformers_support.py says why not otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from shard.attention.base import AttentionMetadata
from shard.models import transformers_idefics3 as idefics3
from shard.models import transformers_qwen_vl as qwen_vl
from shard.models.base import ImageEmbeds, LoadContext
from shard.models.heads import partition_heads
from shard.models.transformers_attention import (
    ATTN_IMPLEMENTATION,
    PAGED_LAYER,
    PagedLayer,
    StepState,
    register,
)
from shard.models.transformers_norms import swap_rms_norms
from shard.models.transformers_support import (
    attention_modules,
    backend_class,
    declared_graph_safe,
    tp_plan,
)
from shard.models.transformers_tp import (
    StateWeights,
    attention_split,
    localize_heads,
    swap_linears,
)
from shard.quantization.kv_cache import KvScales
from shard.quantization.loading import LinearQuantization

log = logging.getLogger(__name__)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer (key, value) pools


class TransformersCausalLM:
    """CausalLM (shard/models/base.py) over a transformers model of one tensor-parallel rank."""

    model_impl = "transformers"

    def __init__(self, ctx: LoadContext):
        import transformers

        if ctx.kv_cache_dtype.is_fp8:
            raise ValueError(
                f"--kv-cache-dtype {ctx.kv_cache_dtype.value}: the transformers backend keeps "
                "its KV cache in the model dtype; model_type "
                f"{ctx.config.get('model_type', '')!r} has no native fp8-cache path"
            )
        config = transformers.AutoConfig.from_pretrained(str(ctx.model_dir))
        register()
        chosen = backend_class(config, ATTN_IMPLEMENTATION)  # ValueError: the type and why
        cls = chosen.cls
        hf = cls.from_pretrained(
            str(ctx.model_dir), config=config, dtype=ctx.dtype,
            attn_implementation=chosen.attn_implementation,
        )
        hf.eval().requires_grad_(False)
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // heads
        plan = tp_plan(config)
        # Heads split over ranks only where the plan splits the attention projections (Phi-3's
        # packed qkv and OLMo 2's q/k norms keep every head on every rank).
        world = ctx.dist.world_size if attention_split(plan) else 1
        split = partition_heads(heads, kv_heads, ctx.dist.rank % world, world)
        self.num_kv_heads = split.local_kv_heads
        quant = LinearQuantization.resolve(ctx.quantize, ctx.config)
        if quant is not None and quant.packed is not None:
            raise ValueError(
                f"quantization_config.quant_method: {quant.packed.layout.value} checkpoints are "
                "served by the native model code only, not the transformers backend"
            )
        weights = StateWeights(dict(hf.state_dict()), ctx.device, ctx.dtype, ctx.dist, quant)
        if ctx.dist.world_size > 1 and not plan:
            raise ValueError(
                f"model_type {config.model_type!r}: its transformers config has no "
                "base_model_tp_plan, so the transformers backend cannot split it over "
                f"{ctx.dist.world_size} ranks; run it on one shard"
            )
        prefix = chosen.base_prefix or hf.base_model_prefix
        swapped = swap_linears(hf, prefix, plan, weights, split)
        if quant is not None and swapped == 0:
            raise ValueError(
                f"--quantize: model_type {config.model_type!r} has no base_model_tp_plan naming "
                "its projections, so the transformers backend has no tokenwire linears to "
                "quantize"
            )
        del weights
        norms = swap_rms_norms(hf)
        hf.to(ctx.device)
        self.hf = hf
        self.step = StepState()
        self.num_layers = 0
        for module in attention_modules(hf, config.model_type):
            setattr(module, PAGED_LAYER, PagedLayer(self.num_layers, ctx.attention, self.step))
            if world > 1:
                localize_heads(module, heads, kv_heads, split)
            self.num_layers += 1
        self.vocab_size: int = hf.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings: int = (
            getattr(text, "max_position_embeddings", None) or ctx.config.get("n_positions") or 2048
        )
        window = getattr(text, "sliding_window", None)
        self.sliding_window: int | None = window if isinstance(window, int) else None
        self.attention_name = ctx.attention.name
        self.supports_lora = swapped > 0
        self.supports_images = chosen.vision
        # Qwen2-VL-style multimodal rotary: a prompt with images has 3-D positions (rope_positions).
        self.mrope = config.model_type in qwen_vl.MROPE_MODELS
        # Idefics3: images come as tiles, each [3, S, S] with a run of placeholders of its own.
        self.tiled = config.model_type in idefics3.TILED_MODELS
        self.cuda_graph_safe = ctx.attention.graph_safe and declared_graph_safe(config, quant)
        self._device, self._dtype = ctx.device, ctx.dtype
        log.info(
            "model_type %r: transformers backend (%s), %d attention layers, %d linears and %d "
            "RMSNorms swapped for tokenwire's, decode %s", config.model_type, cls.__name__,
            self.num_layers, swapped, norms,
            "CUDA graphs" if self.cuda_graph_safe else "eager",
        )

    def named_modules(self, *args: Any, **kwargs: Any):
        """The transformers model's modules under their checkpoint names (LoRA attaches to
        them by name, as on the native path)."""
        return self.hf.named_modules(*args, **kwargs)

    def take_expert_counts(self) -> torch.Tensor | None:
        return None  # transformers' MoE blocks keep no routing statistics

    def begin_kv_calibration(self) -> bool:
        return False  # model-dtype caches only

    def finish_kv_calibration(self, headroom: float | None = None) -> list[KvScales]:
        return []

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self._dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kw: dict[str, Any] = {"dtype": self._dtype, "device": self._device}
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw))
                for _ in range(self.num_layers)]

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: list[torch.Tensor]  # each [3, H, W] float32 on the host
    ) -> list[torch.Tensor]:  # each [num_tokens, hidden]
        """A VLM's vision tower and projector (transformers' own get_image_features, with the
        config's feature layer and selection strategy); images of one shape in one call."""
        cfg = self.hf.config
        if self.mrope:  # each [t, h, w, patch_dim]
            return qwen_vl.encode(self.hf, pixel_values, self._device, self._dtype)
        if self.tiled:  # each a [3, S, S] tile
            return idefics3.encode(self.hf, pixel_values, self._device, self._dtype)
        result: list[torch.Tensor] = [torch.empty(0)] * len(pixel_values)
        for shape in dict.fromkeys(p.shape for p in pixel_values):
            idx = [i for i, p in enumerate(pixel_values) if p.shape == shape]
            batch = torch.stack([pixel_values[i] for i in idx])  # [n, 3, H, W]
            feats = self.hf.model.get_image_features(
                pixel_values=batch.to(self._device, self._dtype),
                vision_feature_layer=cfg.vision_feature_layer,
                vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            ).pooler_output  # n x [num_tokens, hidden]
            for i, f in zip(idx, feats, strict=True):
                result[i] = f
        return result

    def image_token_count(self, shape: tuple[int, ...]) -> int | None:
        """LLaVA: one row per patch of the tower's square input ([3, S, S]), plus the CLS
        feature under the "full" selection strategy; Qwen2-VL and Idefics3: their modules'."""
        cfg = self.hf.config
        if self.mrope:
            return qwen_vl.token_count(cfg, tuple(shape))
        if self.tiled:
            return idefics3.token_count(cfg, tuple(shape))
        size, patch = cfg.vision_config.image_size, cfg.vision_config.patch_size
        if tuple(shape) != (3, size, size):
            return None
        cls_row = 1 if cfg.vision_feature_select_strategy == "full" else 0
        return (size // patch) ** 2 + cls_row

    @torch.inference_mode()
    def rope_positions(
        self, token_ids: list[int], images: list[tuple[int, int, tuple[int, ...]]]
    ) -> tuple[np.ndarray, int]:
        """M-RoPE models: the prompt's [3, len] positions and the delta after it (see
        shard/models/transformers_qwen_vl.py); images: (offset, length, shape) in order."""
        return qwen_vl.rope_positions(self.hf, token_ids, images)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], or [3, num_tokens] (M-RoPE prompt rows)
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
        image_embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        self.step.meta, self.step.kv_cache = meta, kv_cache
        inputs: dict[str, torch.Tensor] = {}
        if image_embeds is None:
            inputs["input_ids"] = input_ids.unsqueeze(0)  # one packed sequence [1, num_tokens]
        else:  # placeholder rows take the images' embeddings
            embeds = self.hf.get_input_embeddings()(input_ids)  # [num_tokens, hidden]
            embeds = embeds.index_copy(0, image_embeds.rows, image_embeds.embeds.to(embeds.dtype))
            inputs["inputs_embeds"] = embeds.unsqueeze(0)  # [1, num_tokens, hidden]
        try:
            out = self.hf(
                **inputs,
                # [1, num_tokens] (M-RoPE models repeat it per section), or [3, 1, num_tokens]
                position_ids=positions.unsqueeze(0 if positions.ndim == 1 else 1),
                use_cache=False,
                logits_to_keep=logits_indices,
            )
        finally:
            self.step.meta = self.step.kv_cache = None
        return out.logits[0].float()  # [num_logits, vocab]
