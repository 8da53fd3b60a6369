"""What the vision tests share: the tiny random LLaVA (shard/tools/tiny_vlm.py) built once per
session, images encoded as PNG/JPEG/WebP bytes, and transformers' own greedy reference."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from shard.tools.tiny_vlm import write_tiny_llava


def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """write_tiny_llava, at most once per test session (shared directory)."""
    out = tmp_path_factory.getbasetemp() / "hf-models" / "llava"
    if not out.exists():
        scratch = tmp_path_factory.mktemp("building-llava") / "model"
        write_tiny_llava(scratch)
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
