"""A decoded image -> pixel values and its placeholder-token count, per model family, with the
model's own transformers image processor.

- ProcessorEncoder (LLaVA and others): the model's processor (`AutoProcessor`) run beside a
  prompt holding one image token; the count is how many image tokens the processor expands
  that token to, and pixel_values[0] is the image ([3, H, W]).
- GridEncoder (Qwen2-VL / Qwen2.5-VL: an image processor with a `merge_size`): dynamic
  resolution; the image processor alone yields the image's patch rows [t*h*w, patch_dim] and
  image_grid_thw (t, h, w); the rows go to the shard as [t, h, w, patch_dim] (the grid in the
  shape) and the count is t*h*w / merge_size^2, the expansion Qwen2VLProcessor applies. The
  processor class itself is not used: in transformers 5.x it needs a video processor, which
  needs torchvision, and images need neither.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class Encoded:
    pixels: Any  # np.ndarray float32, C order: [3, H, W], [t, h, w, patch_dim] or [tiles, 3, S, S]
    num_tokens: int  # placeholder (image) tokens the image takes in the prompt
    # The token ids the prompt's one image token becomes, where that is more than num_tokens
    # image tokens (TiledEncoder: tile tags and delimiters around each tile's run of image
    # tokens; pixels[i] is the i-th run's tile); None: num_tokens image tokens, one image.
    expansion: tuple[int, ...] | None = None


class ImageEncoder(Protocol):
    image_token: str  # the placeholder token, expanded to the image's count
    image_token_id: int
    # The text that stands for one image in a prompt the router writes (chat templates that do
    # not render image parts, TGI markdown, gRPC chunks): the image token, or for Qwen2-VL the
    # token inside <|vision_start|> ... <|vision_end|> as its processor's prompts have it.
    image_text: str
    tokenizer: Any

    def __call__(self, image: Any) -> Encoded:  # image: an RGB PIL image
        ...


class ProcessorEncoder:
    """The model's transformers processor (image processor + tokenizer + image token)."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = processor.image_token
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.image_text = self.image_token

    def __call__(self, image: Any) -> Encoded:
        import numpy as np

        enc = self._processor(text=[self.image_token], images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(enc["pixel_values"][0], dtype=np.float32)  # [3, H, W]
        count = int((enc["input_ids"][0] == self.image_token_id).sum())
        return Encoded(pixels, count)


class TiledEncoder(ProcessorEncoder):
    """A tiling processor (Idefics3's): the processor's expansion of one image token and its
    tiles [tiles, 3, S, S], one per run of image tokens in the expansion."""

    def __call__(self, image: Any) -> Encoded:
        import numpy as np

        enc = self._processor(text=[self.image_token], images=[image], return_tensors="np",
                              add_special_tokens=False)
        tokens = tuple(int(t) for t in enc["input_ids"][0])
        tiles = np.ascontiguousarray(enc["pixel_values"][0], dtype=np.float32)  # [n, 3, S, S]
        runs = image_runs(tokens, self.image_token_id)
        # One image pads nothing (every tile is S x S); the shard encodes each tile whole.
        mask = enc.get("pixel_attention_mask")
        if len(runs) != tiles.shape[0] or (mask is not None and not mask.all()):
            raise RuntimeError(f"{type(self._processor).__name__}: {len(runs)} runs of image "
                               f"tokens for {tiles.shape[0]} tiles, or padded tiles")
        return Encoded(tiles, sum(length for _, length in runs), tokens)


def image_runs(tokens: tuple[int, ...], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive image tokens in `tokens`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class GridEncoder:
    """A dynamic-resolution image processor (Qwen2-VL's: patch rows + image_grid_thw)."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token_id: int,
                 start_id: int | None = None, end_id: int | None = None) -> None:
        self._image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.image_token: str = tokenizer.convert_ids_to_tokens(image_token_id)
        self.image_text = self.image_token
        if start_id is not None and end_id is not None:  # <|vision_start|> ... <|vision_end|>
            start, end = tokenizer.convert_ids_to_tokens([start_id, end_id])
            self.image_text = f"{start}{self.image_token}{end}"
        self.merge: int = int(image_processor.merge_size)

    def __call__(self, image: Any) -> Encoded:
        import numpy as np

        enc = self._image_processor(images=[image], return_tensors="np")
        t, h, w = (int(x) for x in enc["image_grid_thw"][0])
        rows = np.asarray(enc["pixel_values"], dtype=np.float32)  # [t*h*w, patch_dim]
        pixels = np.ascontiguousarray(rows.reshape(t, h, w, -1))  # [t, h, w, patch_dim]
        return Encoded(pixels, t * h * w // (self.merge * self.merge))


def grid_encoder(model_dir: Path) -> GridEncoder | None:
    """GridEncoder for a model whose image processor has a merge size and whose config names
    its image token id (Qwen2-VL family); None otherwise."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    token_id = config.get("image_token_id")
    pre = model_dir / "preprocessor_config.json"
    if token_id is None or not pre.is_file() or "merge_size" not in json.loads(pre.read_text()):
        return None
    import transformers

    image_processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return GridEncoder(image_processor, tokenizer, int(token_id),
                       config.get("vision_start_token_id"), config.get("vision_end_token_id"))
