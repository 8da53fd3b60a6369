"""Time to first token of a 1-image request on a LLaVA-1.5-7B- or Qwen2-VL-7B-shaped random
model, with and without an encoder-cache hit, and the decode step with and without an image in
the context.

    python benchmarks/vision_ttft.py [--out DIR] [--reps 5] [--tiny] [--family qwen2_vl]

Builds a random bf16 LLaVA with Llama-2-7B's language model (hidden 4096, 32 layers, 32 heads,
intermediate 11008, vocab 32064) and CLIP ViT-L/14-336's tower (24 layers, hidden 1024; 576
placeholder tokens per image) with shard/tools/tiny_vlm.py, or with --family qwen2_vl a random
Qwen2-VL-7B shape (hidden 3584, 28 layers, 28/4 heads, intermediate 18944, vocab 152064; the
32-layer 1280-wide tower, 14-px patches merged 2x2: a 640x480 image is 391 tokens; M-RoPE), serves it with the shard's own loader
(transformers backend, CUDA), and times on the runner (host step -> tensors -> forward, synced):
  - router preprocessing of one 640x480 PNG (the model's processor, as the router runs it);
  - the prefill step of a ~600-token prompt holding one image: a new image (encoder runs) and the
    same image again under other text (encoder-cache hit, no prefix-cache reuse), and a
    text-only prompt of the same length;
  - batch-1 decode steps after each prefill (the step an image never touches).
Writes vision_ttft.json and vision_ttft.md (vision_ttft_qwen2_vl.* for Qwen2-VL) under --out (default $OUT or .). --tiny: the tiny CPU
shapes (a smoke run of the script itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32064,
            "initializer_range": 0.02}
CLIP_L_336 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
              "num_attention_heads": 16, "patch_size": 14, "projection_dim": 768,
              "initializer_range": 0.02}
QWEN2_VL_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
               "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
               "initializer_range": 0.02,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                   "mrope_section": [16, 24, 24]}}
QWEN2_VL_7B_TOWER = {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4,
                     "hidden_size": 3584, "initializer_range": 0.02}


def png(seed: int, width: int = 640, height: int = 480) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def build(workdir: Path, tiny: bool, family: str) -> Path:
    from shard.tools.tiny_vlm import write_tiny_llava, write_tiny_qwen2_vl

    out = workdir / (f"{family}-tiny" if tiny else f"{family}-7b-shape")
    if (out / "config.json").exists():
        return out
    if family == "qwen2_vl":
        if tiny:
            return write_tiny_qwen2_vl(out)
        return write_tiny_qwen2_vl(out, text=QWEN2_VL_7B, vision=QWEN2_VL_7B_TOWER,
                                   max_pixels=28 * 28 * 1280, dtype="bfloat16", device="cuda")
    if tiny:
        return write_tiny_llava(out)
    return write_tiny_llava(out, text=LLAMA_7B, vision=CLIP_L_336, image_size=336,
                            dtype="bfloat16", device="cuda", projector_std=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--family", choices=("llava", "qwen2_vl"), default="llava")
    args = parser.parse_args()
    import torch

    from service.generation.images.pipeline import ImagePipeline
    from service.generation.images.refs import ImageLimits, ImageRef
    from shard.distributed.groups import Dist
    from shard.runner.images import StepImage
    from shard.runner.model_runner import StepInputs
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    cuda = torch.cuda.is_available() and not args.tiny
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vision-ttft-"))
    t0 = time.perf_counter()
    model_dir = build(workdir, args.tiny, args.family)
    build_s = time.perf_counter() - t0
    pipeline = ImagePipeline.load(model_dir, ImageLimits())
    assert pipeline is not None
    shard = Shard(ShardConfig(model_id=str(model_dir), model_impl="transformers",
                              dtype="bfloat16" if cuda else "float32",
                              device="cuda" if cuda else "cpu",
                              kv_cache_memory_mb=4096 if cuda else 64), Dist())
    shard.warmup(WarmupSpec(1024, 1100, 1024, 4, max_batch_total_tokens=8192))
    runner = shard.runner
    tok = pipeline.encoder.tokenizer
    from shard.tools.tiny_vlm import QWEN_IMAGE

    image_text = QWEN_IMAGE if args.family == "qwen2_vl" else "<image>"
    mrope = getattr(runner.model, "mrope", False)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def prepare(text: str, seed: int | None) -> tuple[list[int], list]:
        ids = tuple(tok(text).input_ids)
        refs = (ImageRef("image", data=png(seed)),) if seed is not None else ()
        t = time.perf_counter()
        ids2, images = asyncio.run(pipeline.prepare(refs, ids, "inputs"))
        prepare.last_s = time.perf_counter() - t  # type: ignore[attr-defined]
        return list(ids2), list(images)

    block = runner.block_size
    next_block = [0]

    def blocks_for(n: int) -> list[int]:
        count = -(-n // block)
        out = list(range(next_block[0], next_block[0] + count))
        next_block[0] += count
        if next_block[0] > runner.num_blocks - 200:
            next_block[0] = 0
        return out

    def prefill(ids: list[int], images: list, blocks: list[int]) -> tuple[float, int, int]:
        """(ms, first token, M-RoPE delta of the positions after the prompt)."""
        step = StepInputs(ids, list(range(len(ids))), [len(ids)], [len(ids)], [blocks],
                          [len(ids) - 1])
        step.images = [StepImage(i.content_hash, i.shape, i.pixel_values, i.offset, 0, i.length)
                       for i in images]
        sync()
        t = time.perf_counter()
        delta = 0
        if mrope and images:  # the shard's engine does this when a request arrives
            step.rope_positions, delta = runner.model.rope_positions(
                ids, [(i.offset, i.length, i.shape) for i in images])
        logits = runner.execute(step)
        token = int(logits.argmax(-1)[0])
        sync()
        return (time.perf_counter() - t) * 1e3, token, delta

    def decode(n: int, token: int, blocks: list[int], delta: int = 0) -> float:
        times = []
        for _ in range(args.decode_steps):
            sync()
            t = time.perf_counter()
            logits = runner.execute(StepInputs([token], [n + delta], [1], [n + 1], [blocks],
                                               [0]))
            token = int(logits.argmax(-1)[0])
            sync()
            times.append((time.perf_counter() - t) * 1e3)
            n += 1
        return statistics.median(times)

    words = "describe the picture in detail and list every object you can see " * 2
    rows: dict[str, list[float]] = {k: [] for k in (
        "preprocess_ms", "ttft_miss_ms", "ttft_hit_ms", "ttft_text_ms", "decode_image_ms",
        "decode_text_ms")}
    prompt_len = 0
    for rep in range(args.reps + 1):  # rep 0 warms up every path
        ids, images = prepare(f"request {rep}: {image_text} {words}", 1000 + rep)
        pre = prepare.last_s * 1e3  # type: ignore[attr-defined]
        blocks = blocks_for(len(ids) + args.decode_steps + 1)
        miss, token, delta = prefill(ids, images, blocks)
        dec_img = decode(len(ids), token, blocks, delta)
        ids_hit, images_hit = prepare(f"again {rep}, other words: {image_text} {words}",
                                      1000 + rep)
        hit, _, _ = prefill(ids_hit, images_hit, blocks_for(len(ids_hit) + 1))
        text_ids = [t if t != pipeline.image_token_id else 17 for t in ids]
        text_blocks = blocks_for(len(text_ids) + args.decode_steps + 1)
        text, token, _ = prefill(text_ids, [], text_blocks)
        dec_text = decode(len(text_ids), token, text_blocks)
        prompt_len = len(ids)
        if rep:
            for k, v in zip(rows, (pre, miss, hit, text, dec_img, dec_text), strict=True):
                rows[k].append(v)
    median = {k: statistics.median(v) for k, v in rows.items()}
    device = torch.cuda.get_device_name() if cuda else "cpu"
    shape = "qwen2-vl-7b shape (bf16)" if args.family == "qwen2_vl" else "llava-1.5-7b shape (bf16)"
    result = {"device": device, "model": f"tiny {args.family}" if args.tiny else shape,
              "prompt_tokens": prompt_len, "image_tokens": images[0].length if images else 0,
              "reps": args.reps, "build_s": round(build_s, 1),
              "median": {k: round(v, 2) for k, v in median.items()}, "all": rows,
              "encoder_cache": {"hits": runner.encoder_cache.hits,
                                "misses": runner.encoder_cache.misses}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "vision_ttft" if args.family == "llava" else f"vision_ttft_{args.family}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    m = median
    md = (f"# Vision TTFT ({result['model']}, {device})\n\n"
          f"Prompt {prompt_len} tokens incl. {result['image_tokens']} image placeholders; "
          f"median of {args.reps} reps.\n\n"
          "| measure | ms |\n| --- | --- |\n"
          f"| router preprocessing (640x480 PNG) | {m['preprocess_ms']:.1f} |\n"
          f"| prefill, new image (encoder runs) | {m['ttft_miss_ms']:.1f} |\n"
          f"| prefill, encoder-cache hit | {m['ttft_hit_ms']:.1f} |\n"
          f"| prefill, text only (same length) | {m['ttft_text_ms']:.1f} |\n"
          f"| decode step after an image prompt | {m['decode_image_ms']:.2f} |\n"
          f"| decode step after a text prompt | {m['decode_text_ms']:.2f} |\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
    pipeline.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
