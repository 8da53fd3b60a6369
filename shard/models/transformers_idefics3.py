"""Idefics3 (and SmolVLM v1, whose checkpoints are Idefics3) through the transformers backend:
the vision tower and connector on image tiles, and the placeholder count of a tile.

The router's processor (Idefics3Processor) splits an image into tiles, crops of S x S plus the
whole image resized to S x S, and writes each tile's run of image_seq_len image tokens between
tile tags; each tile comes to the shard as an image input of its own, [3, S, S] pixels, so a
tile's embeddings fill one contiguous run of placeholder rows. transformers' own
get_image_features runs the SigLIP tower, then the connector's pixel shuffle (scale_factor^2
neighbouring patches folded into one row) and projection: (S / patch)^2 / scale^2 rows a tile.
"""

from __future__ import annotations

from typing import Any

import torch

# model_type -> the language model's module path (Idefics3ForConditionalGeneration.model is the
# Idefics3Model holding .vision_model, .connector and .text_model).
TILED_MODELS: dict[str, str] = {"idefics3": "model.text_model"}


def token_count(config: Any, shape: tuple[int, ...]) -> int | None:
    """Placeholder tokens of a [3, S, S] tile, S the tower's image size: (S / patch)^2 /
    scale^2 (None: not a tile the tower takes)."""
    size = config.vision_config.image_size
    if tuple(shape) != (3, size, size):
        return None
    return (size // config.vision_config.patch_size) ** 2 // (config.scale_factor ** 2)


def encode(hf: Any, tiles: list[torch.Tensor], device: torch.device, dtype: torch.dtype
           ) -> list[torch.Tensor]:
    """Each [3, S, S] tile -> its [tokens, hidden] embeddings; all tiles in one tower call,
    as one image of len(tiles) sub-images ([1, n, 3, S, S]: no padding mask, every tile whole)."""
    batch = torch.stack(tiles).unsqueeze(0).to(device, dtype)  # [1, n, 3, S, S]
    pooled = hf.model.get_image_features(pixel_values=batch).pooler_output
    # transformers 5.24: a list, per image, of [n*tokens, hidden]; 5.17 (the GPU machine's): one
    # [n, tokens, hidden] tensor
    feats = (torch.cat(list(pooled)) if isinstance(pooled, (list, tuple))
             else pooled.reshape(-1, pooled.shape[-1]))  # [n*tokens, hidden]
    if feats.shape[0] % len(tiles):
        # transformers drops all-zero sub-images as padding: not reachable from a processor
        # that normalizes uint8 pixels with mean 0.5 (no pixel maps to exactly 0)
        raise ValueError(f"{len(tiles)} tiles gave {feats.shape[0]} embedding rows (an "
                         "all-zero tile is taken for padding by transformers)")
    return list(feats.view(len(tiles), -1, feats.shape[-1]))  # n x [tokens, hidden]
