"""Qwen2-VL / Qwen2.5-VL through the transformers backend: the vision tower on dynamic-resolution
patches, the placeholder count of a patch grid, and the multimodal rotary positions (M-RoPE).

Pixel values travel as the image processor's patch rows reshaped to [t, h, w, patch_dim]: the
bytes are the processor's [t*h*w, patch_dim] rows unchanged, and the first three dimensions are
its image_grid_thw, so the grid needs no field of its own. The rotary positions of a prompt are
transformers' own get_rope_index (three rows: temporal, height, width); text after the prompt
continues at index + delta, delta = max position + 1 - prompt length (the model's
rope_deltas), which is what transformers' generate does on its decode steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# model_type -> the language model's module path (Qwen2VLForConditionalGeneration.model is the
# Qwen2VLModel holding .visual and .language_model).
MROPE_MODELS: dict[str, str] = {
    "qwen2_vl": "model.language_model",
    "qwen2_5_vl": "model.language_model",
}


def patch_dim(config: Any) -> int:
    """Values per patch row: channels x temporal patch x patch x patch (1176 for 14-px RGB)."""
    v = config.vision_config
    return v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size


def token_count(config: Any, shape: tuple[int, ...]) -> int | None:
    """Placeholder tokens of a [t, h, w, patch_dim] grid: t*h*w / merge^2 (None: not a grid the
    tower takes: wrong rank or patch size, or h, w not multiples of the merge size)."""
    merge = config.vision_config.spatial_merge_size
    if len(shape) != 4 or shape[3] != patch_dim(config) or min(shape[:3]) < 1:
        return None
    t, h, w = shape[:3]
    if h % merge or w % merge:
        return None
    return t * h * w // (merge * merge)


def encode(hf: Any, pixel_values: list[torch.Tensor], device: torch.device,
           dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' own get_image_features over all images in one call: each image's patch rows
    [t*h*w, patch_dim] concatenated, image_grid_thw [n, 3]; returns each [tokens, hidden]."""
    grids = torch.tensor([list(p.shape[:3]) for p in pixel_values], dtype=torch.int64)
    rows = torch.cat([p.reshape(-1, p.shape[-1]) for p in pixel_values])  # [sum t*h*w, dim]
    out = hf.model.get_image_features(pixel_values=rows.to(device, dtype),
                                      image_grid_thw=grids.to(device))
    return list(out.pooler_output)


def rope_positions(
    hf: Any, token_ids: Sequence[int], images: Sequence[tuple[int, int, tuple[int, ...]]]
) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt: [3, len(token_ids)] int64 and the delta of the positions
    after it. images: (offset, length, [t, h, w, dim]) of each image, in prompt order; their
    placeholder spans are the image tokens (mm_token_type_ids 1), everything else text."""
    n = len(token_ids)
    types = torch.zeros(1, n, dtype=torch.int32)  # [1, n]: 0 text, 1 image
    for offset, length, _ in images:
        types[0, offset : offset + length] = 1
    grids = torch.tensor([list(shape[:3]) for _, _, shape in images], dtype=torch.int64)
    ids = torch.tensor([list(token_ids)], dtype=torch.int64)  # [1, n]
    positions, deltas = hf.model.get_rope_index(ids, types, image_grid_thw=grids)
    return positions[:, 0].numpy().astype(np.int64), int(deltas[0, 0])  # [3, n], delta
