"""Image embeddings of a prefill step: the vision encoder runs once per image (the encoder cache,
keyed by the image's content hash, keeps its output across chunks, preemptions and requests),
and the rows of each image that the step's chunk covers are scattered into the flat batch in
place of the placeholder tokens' embeddings."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from shard.models.base import ImageEmbeds, VisionLM


@dataclass(frozen=True)
class StepImage:
    """The part of one image a step computes: embedding rows [first, first + count) of the image
    go to flat-batch rows [row, row + count)."""

    content_hash: bytes
    shape: tuple[int, ...]  # of pixel_values: [3, H, W] or [t, h, w, patch_dim] (Qwen2-VL)
    pixel_values: bytes  # float32, C order
    row: int
    first: int
    count: int


class EncoderCache:
    """Image embeddings by content hash, least recently used evicted first (a bounded count:
    an entry is [num_tokens, hidden] in the model dtype, a few MB for a 7B LLaVA image)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._embeds: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._embeds)

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self._embeds.get(key)
        if found is not None:
            self._embeds.move_to_end(key)
        return found

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        self._embeds[key] = embeds
        self._embeds.move_to_end(key)
        while len(self._embeds) > self.capacity:
            self._embeds.popitem(last=False)

    def clear(self) -> None:
        self._embeds.clear()


def image_embeds(
    images: list[StepImage], model: VisionLM, cache: EncoderCache, device: torch.device
) -> ImageEmbeds:
    """The step's image rows and their embeddings; images missing from the cache are encoded
    (one encoder call for all of them). The step keeps its own references to every embedding
    it uses: a step may need more images than the cache holds (an Idefics3 image is up to 17
    tiles), so putting the new ones may evict others of the same step."""
    found: dict[bytes, torch.Tensor] = {}  # [num_tokens, hidden] by content hash
    missing: dict[bytes, StepImage] = {}
    for image in images:
        key = image.content_hash
        if key in found or key in missing:
            continue
        cached = cache.get(key)
        if cached is None:
            missing[key] = image
        else:
            found[key] = cached
    cache.hits += len(images) - len(missing)
    cache.misses += len(missing)
    if missing:
        pixels = [
            torch.from_numpy(np.frombuffer(i.pixel_values, dtype=np.float32).reshape(i.shape).copy())
            for i in missing.values()
        ]
        for key, embeds in zip(missing, model.encode_images(pixels), strict=True):
            found[key] = embeds
            cache.put(key, embeds)  # [num_tokens, hidden]
    rows: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    for image in images:
        embeds = found[image.content_hash]
        if image.first + image.count > embeds.shape[0]:
            raise ValueError(
                f"image {image.content_hash.hex()[:12]}: the router placed "
                f"{image.first + image.count}+ placeholder tokens, the encoder yields "
                f"{embeds.shape[0]} embeddings"
            )
        rows.append(torch.arange(image.row, image.row + image.count))
        parts.append(embeds[image.first : image.first + image.count])
    return ImageEmbeds(
        rows=torch.cat(rows).to(device),  # [n] flat-batch rows
        embeds=torch.cat(parts),  # [n, hidden]
    )
