"""What the vision tests share: the tiny random LLaVA (shard/tools/tiny_vlm.py) built once per
session, images encoded as PNG/JPEG/WebP bytes, and transformers' own greedy references (LLaVA
and Idefics3 on their processor's inputs, Qwen2-VL / 2.5-VL on their image processor's
pixels)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from shard.tools.tiny_vlm import write_tiny_idefics3, write_tiny_llava


def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """write_tiny_llava, at most once per test session (shared directory)."""
    out = tmp_path_factory.getbasetemp() / "hf-models" / "llava"
    if not out.exists():
        scratch = tmp_path_factory.mktemp("building-llava") / "model"
        write_tiny_llava(scratch)
        out.parent.mkdir(exist_ok=True)
        scratch.rename(out)
    return out


def tiny_idefics3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """write_tiny_idefics3, at most once per test session (shared directory)."""
    out = tmp_path_factory.getbasetemp() / "hf-models" / "idefics3"
    if not out.exists():
        scratch = tmp_path_factory.mktemp("building-idefics3") / "model"
        write_tiny_idefics3(scratch)
        out.parent.mkdir(exist_ok=True)
        scratch.rename(out)
    return out


def image(seed: int, width: int = 40, height: int = 30) -> Any:
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoded(seed: int, fmt: str = "PNG", **kw: int) -> bytes:
    buf = io.BytesIO()
    image(seed, **kw).save(buf, format=fmt)
    return buf.getvalue()


class HfReference:
    """transformers' LlavaForConditionalGeneration.generate on the processor's inputs."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.processor = transformers.AutoProcessor.from_pretrained(str(model_dir))
        self.model = transformers.LlavaForConditionalGeneration.from_pretrained(
            str(model_dir)).eval()

    def inputs(self, text: str, seeds: list[int], **kw: Any) -> dict[str, Any]:
        return self.processor(text=[text], images=[image(s) for s in seeds] or None,
                              return_tensors="pt", **kw)

    def greedy(self, text: str, seeds: list[int], n: int, **kw: Any) -> list[int]:
        return self.greedy_logprobs(text, seeds, n, **kw)[0]

    def greedy_logprobs(self, text: str, seeds: list[int], n: int, **kw: Any
                        ) -> tuple[list[int], list[float]]:
        """Greedy tokens and each one's log-probability."""
        import torch

        enc = self.inputs(text, seeds, **kw)
        out = self.model.generate(**enc, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                  output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
        lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, ids,
                                                                             strict=True)]
        return ids, lps


class Idefics3Reference(HfReference):
    """transformers' Idefics3ForConditionalGeneration.generate on Idefics3Processor's inputs
    (tiles, pixel_attention_mask, the prompt with each image's tile tags and tokens)."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.processor = transformers.AutoProcessor.from_pretrained(str(model_dir))
        self.model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
            str(model_dir)).eval()

    def inputs(self, text: str, seeds: list[Any], **kw: Any) -> dict[str, Any]:
        """seeds: each image's seed, or (seed, width, height)."""
        images = [image(*s) if isinstance(s, tuple) else image(s) for s in seeds]
        return self.processor(text=[text], images=images or None, return_tensors="pt", **kw)

    def shard_images(self, enc: dict[str, Any]) -> list[Any]:  # shard_pb2.ImageInput
        """The processor's tiles as the shard takes them: each [3, S, S] tile an image input at
        its run of image tokens (the i-th run, the i-th tile; as the router sends them)."""
        import hashlib

        import numpy as np
        from tokenwire.shard.v1 import shard_pb2 as pb

        from service.generation.images.encoders import image_runs

        if "pixel_values" not in enc:
            return []
        ids = tuple(enc["input_ids"][0].tolist())
        tiles = enc["pixel_values"].numpy().astype(np.float32).reshape(-1, 3, *enc[
            "pixel_values"].shape[-2:])  # [images * tiles, 3, S, S]: one prompt, no padding
        out = []
        for tile, (start, length) in zip(tiles, image_runs(ids, self.processor.image_token_id),
                                         strict=True):
            data = np.ascontiguousarray(tile).tobytes()
            out.append(pb.ImageInput(content_hash=hashlib.sha256(data).digest(), offset=start,
                                     length=length, shape=list(tile.shape), pixel_values=data))
        return out


class QwenReference:
    """transformers' generate on the image processor's pixels and the expanded prompt (the
    placeholder count: image_grid_thw.prod() / merge^2, as Qwen2VLProcessor expands it)."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.images = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
        self.tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            str(model_dir)).eval()
        self.pad = self.tok.convert_tokens_to_ids("<|image_pad|>")

    def inputs(self, text: str, specs: list[tuple[int, int, int]], **kw: Any) -> dict[str, Any]:
        """specs: each image's (seed, width, height); kw: for the tokenizer."""
        import torch

        ids: list[int] = self.tok(text, **kw).input_ids
        if not specs:
            return {"input_ids": torch.tensor([ids])}
        enc = self.images(images=[image(s, w, h) for s, w, h in specs], return_tensors="pt")
        merge = self.images.merge_size ** 2
        counts = iter((enc["image_grid_thw"].prod(-1) // merge).tolist())
        out: list[int] = []
        for t in ids:
            out.extend([t] * next(counts) if t == self.pad else [t])
        ids_t = torch.tensor([out])
        # mm_token_type_ids (1: image) as the processor returns it: M-RoPE needs it
        return {"input_ids": ids_t, "mm_token_type_ids": (ids_t == self.pad).int(), **enc}

    def greedy(self, text: str, specs: list[tuple[int, int, int]], n: int, **kw: Any
               ) -> list[int]:
        enc = self.inputs(text, specs, **kw)
        out = self.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, enc["input_ids"].shape[1]:].tolist()

    def shard_images(self, enc: dict[str, Any]) -> list[Any]:  # shard_pb2.ImageInput
        """The router's form: each image's patch rows as [t, h, w, patch_dim] float32."""
        import hashlib

        import numpy as np
        from tokenwire.shard.v1 import shard_pb2 as pb

        if "pixel_values" not in enc:
            return []
        ids = enc["input_ids"][0].tolist()
        pixels = enc["pixel_values"].numpy().astype(np.float32)
        merge = self.images.merge_size ** 2
        out, row, pos = [], 0, 0
        for t, h, w in enc["image_grid_thw"].tolist():
            patch = np.ascontiguousarray(pixels[row : row + t * h * w]).reshape(t, h, w, -1)
            row += t * h * w
            offset = ids.index(self.pad, pos)
            pos = offset + t * h * w // merge
            out.append(pb.ImageInput(content_hash=hashlib.sha256(patch.tobytes()).digest(),
                                     offset=offset, length=t * h * w // merge,
                                     shape=list(patch.shape), pixel_values=patch.tobytes()))
        return out


def vision_rank(dist: Any, device: str, job: dict[str, Any], res: dict[str, Any]) -> None:
    """shard.testing.ranks RankFn: the tiny LLaVA of job["dir"] on this rank (transformers
    backend, the language model split over the ranks, the vision tower on each), one prefill of
    job["ids"] with job["images"] (content_hash, shape, pixel bytes, offset, length) and greedy
    decode steps: res["tokens"], and res["params"], the weights this rank holds. An M-RoPE model
    (Qwen2-VL) gets its prompt's 3-D positions and decodes at index + delta."""
    import torch

    from shard.runner.images import StepImage
    from shard.runner.model_runner import StepInputs
    from tests.helpers.transformers_backend import backend_shard, held_weights

    torch.set_num_threads(1)  # two ranks on a shared host
    shard = backend_shard(Path(job["dir"]), dist)
    runner = shard.runner
    ids: list[int] = job["ids"]
    n, steps = len(ids), job["steps"]
    blocks = list(range(-(-(n + steps + 1) // runner.block_size)))
    step = StepInputs(ids, list(range(n)), [n], [n], [blocks], [n - 1])
    step.images = [StepImage(h, tuple(shape), pixels, offset, 0, length)
                   for h, shape, pixels, offset, length in job["images"]]
    delta = 0
    if getattr(runner.model, "mrope", False):
        step.rope_positions, delta = runner.model.rope_positions(
            ids, [(offset, length, tuple(shape)) for _, shape, _, offset, length in job["images"]])
    token = int(runner.execute(step).argmax(-1)[0])
    tokens = [token]
    for _ in range(steps - 1):
        logits = runner.execute(StepInputs([token], [n + delta], [1], [n + 1], [blocks], [0]))
        token = int(logits.argmax(-1)[0])
        tokens.append(token)
        n += 1
    res["tokens"] = tokens
    res["params"] = held_weights(shard)
