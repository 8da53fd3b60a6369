"""Images -> pixel values and placeholder tokens, with the model's own transformers processor.

The router loads the model directory's image encoder (encoders.py: the model's `AutoProcessor`,
or for dynamic-resolution families such as Qwen2-VL its image processor; either does the
family's resizing, cropping, tiling or dynamic resolution) and runs it on a worker thread,
never on the event loop. Each image yields its pixel values and the number of placeholder
tokens it takes (the count the model's processor expands it to); the prompt's single image
tokens are then expanded to those counts (or, for a tiling family such as Idefics3, to the
processor's own tokens for the image: tile tags and delimiters around each tile's image tokens,
each tile then an image input of its own), and the expanded prompt is what --max-input-tokens
counts.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from service.engine.contracts import ImageInput
from service.generation.images.encoders import (
    ImageEncoder,
    ProcessorEncoder,
    TiledEncoder,
    grid_encoder,
    image_runs,
)
from service.generation.images.fetch import gather_bytes
from service.generation.images.refs import ImageError, ImageLimits, ImageRef

log = logging.getLogger(__name__)

# PIL format names served (the same three as the accepted content types).
FORMATS = frozenset({"PNG", "JPEG", "WEBP"})


@dataclass(frozen=True)
class ImagePart:
    """What the shard encodes as one image input: the whole image, or one tile of a tiling
    family (Idefics3), and where its run of image tokens starts in the image's expansion."""

    content_hash: bytes  # the image's sha256, or for a tile sha256(image's + tile index)
    start: int  # first image token of the run, within ProcessedImage.tokens
    length: int  # image tokens of the run
    pixel_values: bytes  # float32, C order
    shape: tuple[int, ...]  # [3, H, W] (LLaVA, a tile), [t, h, w, patch_dim] (Qwen2-VL)


@dataclass(frozen=True)
class ProcessedImage:
    """One image after the processor: the tokens its one image token becomes and its parts."""

    content_hash: bytes
    tokens: tuple[int, ...]  # the expansion: image tokens (and tile tags, delimiters)
    parts: tuple[ImagePart, ...]  # in prompt order

    @property
    def num_tokens(self) -> int:
        return sum(p.length for p in self.parts)


def has_image_processor(model_dir: Path) -> bool:
    """Whether the directory holds a processor with an image processor (a VLM's snapshot)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            if name == "preprocessor_config.json" or "image_processor" in data:
                return True
    return False


class ImagePipeline:
    """Fetches, decodes and preprocesses a request's images (one worker thread: the processor
    is not documented as thread-safe)."""

    def __init__(self, encoder: ImageEncoder, limits: ImageLimits) -> None:
        self.encoder = encoder
        self.limits = limits
        # The text that stands for one image in a prompt, and its token id.
        self.image_token: str = encoder.image_token
        self.image_token_id: int = encoder.image_token_id
        # What the router writes for one image in a prompt (encoders.ImageEncoder.image_text).
        self.image_text: str = encoder.image_text
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="images")

    @classmethod
    def load(cls, model_dir: Path, limits: ImageLimits) -> ImagePipeline | None:
        """The model's pipeline, or None when the model takes no images."""
        if not has_image_processor(model_dir):
            return None
        import transformers

        try:
            grid = grid_encoder(model_dir)
        except Exception as error:  # noqa: BLE001 - serve text; say why images are refused
            log.warning("%s: the image processor does not load (%s: %s); images are refused",
                        model_dir, type(error).__name__, error)
            return None
        if grid is not None:
            log.info("images: %s, dynamic resolution (image token %r)",
                     type(grid._image_processor).__name__, grid.image_token)
            return cls(grid, limits)
        try:
            processor = transformers.AutoProcessor.from_pretrained(str(model_dir))
        except Exception as error:  # noqa: BLE001 - serve text; say why images are refused
            log.warning("%s: the processor does not load (%s: %s); images are refused",
                        model_dir, type(error).__name__, error)
            return None
        if getattr(processor, "image_token", None) is None:
            log.warning("%s: the processor names no image token; images are refused", model_dir)
            return None
        # Idefics3 / SmolVLM: tiles, and the processor's tile tags around each one's tokens
        tiled = getattr(processor, "fake_image_token", None) is not None
        log.info("images: %s with %s (image token %r%s)", type(processor).__name__,
                 type(processor.image_processor).__name__, processor.image_token,
                 ", tiles" if tiled else "")
        return cls(TiledEncoder(processor) if tiled else ProcessorEncoder(processor), limits)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def prepare(
        self, refs: tuple[ImageRef, ...], ids: tuple[int, ...], field: str
    ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The prompt `ids` (one image token per image) with each image token expanded to the
        image's placeholder count, and the images; ImageError naming the field at fault."""
        if len(refs) > self.limits.max_images:
            raise ImageError(refs[self.limits.max_images].field,
                             f"{field}: {len(refs)} images; at most {self.limits.max_images} "
                             "per request (--max-images-per-request)")
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != len(refs):
            raise ImageError(field, f"{field}: the prompt has {found} image placeholders "
                             f"({self.image_token!r}) for {len(refs)} images")
        blobs = await gather_bytes(refs, self.limits)
        loop = asyncio.get_running_loop()
        processed = await loop.run_in_executor(self._executor, self._process_all, refs, blobs)
        return expand(ids, self.image_token_id, processed)

    def _process_all(self, refs: tuple[ImageRef, ...], blobs: list[bytes]
                     ) -> list[ProcessedImage]:
        done: dict[bytes, ProcessedImage] = {}  # a repeated image is processed once
        out = []
        for ref, blob in zip(refs, blobs, strict=True):
            key = hashlib.sha256(blob).digest()
            if key not in done:
                done[key] = self._process(ref, blob, key)
            out.append(done[key])
        return out

    def _process(self, ref: ImageRef, blob: bytes, key: bytes) -> ProcessedImage:
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(blob))  # reads the header only
        except (UnidentifiedImageError, OSError, ValueError):
            raise ImageError(ref.field, f"{ref.field}: the image could not be decoded (not a "
                             "PNG, JPEG or WebP file)") from None
        if image.format not in FORMATS:
            raise ImageError(ref.field, f"{ref.field}: unsupported image format "
                             f"{image.format}; supported: PNG, JPEG, WebP")
        width, height = image.size
        if width * height > self.limits.max_pixels:
            raise ImageError(ref.field, f"{ref.field}: the image has {width}x{height} = "
                             f"{width * height} pixels; at most {self.limits.max_pixels} "
                             "(--max-image-pixels)")
        try:
            image = image.convert("RGB")  # decodes the pixels
        except (OSError, ValueError, Image.DecompressionBombError):
            raise ImageError(ref.field, f"{ref.field}: the image could not be decoded "
                             "(truncated or corrupt)") from None
        encoded = self.encoder(image)
        pixels = encoded.pixels
        if encoded.expansion is None:  # one image input: num_tokens image tokens
            tokens = (self.image_token_id,) * encoded.num_tokens
            part = ImagePart(key, 0, encoded.num_tokens, pixels.tobytes(), tuple(pixels.shape))
            return ProcessedImage(key, tokens, (part,))
        # tiles: pixels [tiles, 3, S, S], tile i for the i-th run of image tokens
        runs = image_runs(encoded.expansion, self.image_token_id)
        parts = tuple(
            ImagePart(hashlib.sha256(key + i.to_bytes(4, "little")).digest(), start, length,
                      pixels[i].tobytes(), tuple(pixels[i].shape))
            for i, (start, length) in enumerate(runs)
        )
        return ProcessedImage(key, encoded.expansion, parts)


def expand(ids: tuple[int, ...], image_token_id: int, images: list[ProcessedImage]
           ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
    """Each image token of `ids` becomes its image's tokens (images in order), and each part of
    the image an ImageInput at its run of image tokens."""
    out: list[int] = []
    placed: list[ImageInput] = []
    it = iter(images)
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        image = next(it)
        placed.extend(ImageInput(p.content_hash, len(out) + p.start, p.length, p.pixel_values,
                                 p.shape) for p in image.parts)
        out.extend(image.tokens)
    return tuple(out), tuple(placed)
