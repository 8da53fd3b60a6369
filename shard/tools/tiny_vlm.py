"""Tiny random vision-language checkpoints laid out like a hub snapshot, with a real processor:
LLaVA 1.5 (a CLIP vision tower, a 2-layer projector, a Llama language model) with transformers'
own CLIP image processor (the PIL backend: no torchvision needed) and LlavaProcessor, the tiny
byte-level BPE tokenizer plus an `<image>` token, and a ChatML chat template; Qwen2-VL /
Qwen2.5-VL with their image processor; Idefics3 with its processor (tiles). For the vision
tests (greedy parity with transformers' generate) and the GPU TTFT benchmark
(benchmarks/vision_ttft.py builds a 7B-shaped one with `text`/`vision` overrides)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_llava(
    out: Path,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    image_size: int = 28,
    dtype: str = "float32",
    device: str = "cpu",
    projector_std: float | None = 0.5,
) -> Path:
    """Writes a random LLaVA checkpoint, its processor and tokenizer into `out`. Defaults: a
    2-layer Llama (hidden 64) and a 2-layer CLIP tower on 28x28 images in 14-pixel patches,
    so each image takes 4 placeholder tokens (the CLS feature is dropped: "default").
    `device`: where the random weights are drawn (cuda for 7B shapes); `projector_std`: the
    projector's weights drawn wide so that the image moves a tiny model's output (None: as
    transformers initializes them)."""
    import torch
    import transformers

    try:  # the PIL backend (transformers >= 5.2x): no torchvision needed
        from transformers.models.clip.image_processing_pil_clip import (
            CLIPImageProcessorPil as ImageProcessor,
        )
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    from shard.tools.tiny_model import BOS, EOS, PAD, build_tokenizer

    tokenizer = build_tokenizer(512)
    tokenizer.add_special_tokens([IMAGE_TOKEN, "<|im_start|>", "<|im_end|>"])
    ids = {t: tokenizer.token_to_id(t) for t in (BOS, EOS, PAD, IMAGE_TOKEN)}
    text_kw: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 4096, "initializer_range": 0.1,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "tie_word_embeddings": False,
    }
    text_kw.update(text or {})
    vision_kw: dict[str, Any] = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "image_size": image_size, "patch_size": 14,
        "projection_dim": 32, "initializer_range": 0.1,
    }
    vision_kw.update(vision or {})
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision_kw),
        text_config=transformers.LlamaConfig(**text_kw),
        image_token_id=ids[IMAGE_TOKEN], vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlavaForConditionalGeneration(config)
    model = model.to(getattr(torch, dtype)).eval()
    if projector_std is not None:
        with torch.no_grad():  # a projector far from zero, so that the image moves the output
            for param in model.model.multi_modal_projector.parameters():
                param.normal_(0.0, projector_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), bos_token=BOS, eos_token=EOS,
        pad_token=PAD,
    )
    size = {"height": image_size, "width": image_size}
    processor = transformers.LlavaProcessor(
        image_processor=ImageProcessor(size={"shortest_edge": image_size}, crop_size=size),
        tokenizer=fast, patch_size=vision_kw["patch_size"],
        vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=CHATML,
    )
    processor.save_pretrained(out)
    # The router reads the chat template from tokenizer_config.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                "eos_token": EOS, "pad_token": PAD, "chat_template": CHATML})
    cfg_path.write_text(json.dumps(cfg) + "\n")
    return out


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a Qwen2-VL prompt
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def write_tiny_qwen2_vl(out: Path, seed: int = 0, family: str = "qwen2_vl",
                        max_pixels: int = 56 * 56, text: dict[str, Any] | None = None,
                        vision: dict[str, Any] | None = None, dtype: str = "float32",
                        device: str = "cpu") -> Path:
    """Writes a random Qwen2-VL (family "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") checkpoint with
    transformers' own Qwen2-VL image processor (the PIL backend) into `out`: a 2-layer language
    model (hidden 64, M-RoPE sections [2, 3, 3] of head_dim 16) and a 2-layer vision tower on
    14-pixel patches merged 2x2, images resized to at most `max_pixels` (dynamic resolution:
    a 56x56 image is a 4x4 patch grid, 4 placeholder tokens). `text` / `vision` override the
    configs (benchmarks/vision_ttft.py builds a Qwen2-VL-7B shape on a GPU: `device`)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from shard.tools.tiny_model import BOS, EOS, PAD, build_tokenizer

    tokenizer = build_tokenizer(512)
    tokenizer.add_special_tokens([*QWEN_TOKENS, "<|im_start|>", "<|im_end|>"])
    ids = {t: tokenizer.token_to_id(t) for t in (BOS, EOS, PAD, *QWEN_TOKENS)}
    text_kw: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 4096, "initializer_range": 0.1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]},
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "tie_word_embeddings": False,
    }
    text_kw.update(text or {})
    vision_kw: dict[str, Any] = {"depth": 2, "embed_dim": 32, "num_heads": 4, "patch_size": 14,
                                 "spatial_merge_size": 2, "temporal_patch_size": 2,
                                 "initializer_range": 0.1}
    token_kw = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                "vision_start_token_id": ids["<|vision_start|>"],
                "vision_end_token_id": ids["<|vision_end|>"], "tie_word_embeddings": False}
    if family == "qwen2_vl":
        vision_kw.update(hidden_size=64, mlp_ratio=2)  # hidden_size: the merger's output
        vision_kw.update(vision or {})
        config: Any = transformers.Qwen2VLConfig(text_config=text_kw, vision_config=vision_kw,
                                                 **token_kw)
        cls: Any = transformers.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision_kw.update(hidden_size=32, out_hidden_size=64, intermediate_size=64,
                         window_size=56, fullatt_block_indexes=[1])
        vision_kw.update(vision or {})
        config = transformers.Qwen2_5_VLConfig(text_config=text_kw, vision_config=vision_kw,
                                               **token_kw)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"family {family!r}: qwen2_vl or qwen2_5_vl")
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    model = model.to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), bos_token=BOS, eos_token=EOS,
        pad_token=PAD,
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels)
    # Qwen2VLProcessor itself needs a video processor, which needs torchvision (not installed):
    # the image processor is saved alone (preprocessor_config.json).
    image_processor.save_pretrained(out)
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                "eos_token": EOS, "pad_token": PAD, "chat_template": CHATML})
    cfg_path.write_text(json.dumps(cfg) + "\n")
    return out


# Idefics3's prompt tokens: the image token, the tile delimiters and tags its processor writes
# (<fake_token_around_image><row_i_col_j> before each tile, <global-img> before the whole image)
IDEFICS3_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>",
                   "<end_of_utterance>",
                   *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)))


def write_tiny_idefics3(out: Path, seed: int = 0, tile: int = 56, longest_edge: int = 112,
                        text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
                        dtype: str = "float32", device: str = "cpu") -> Path:
    """Writes a random Idefics3 checkpoint (SmolVLM's architecture) with transformers' own
    Idefics3Processor and Idefics3 image processor (the PIL backend) into `out`: a 2-layer Llama
    (hidden 64), a 2-layer SigLIP-style tower on `tile`-pixel tiles in 14-pixel patches and the
    connector's 2x2 pixel shuffle, so each tile takes (tile/14)^2/4 placeholder tokens (4 for
    56). An image is resized to `longest_edge` and split into tile x tile crops plus the whole
    image as a global tile: a 40x30 image is 2x2 crops + global (5 tiles, 20 image tokens), an
    80x30 one 1x2 + global (3 tiles)."""
    import torch
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    from shard.tools.tiny_model import BOS, EOS, PAD, build_tokenizer

    tokenizer = build_tokenizer(512)
    tokenizer.add_special_tokens([*IDEFICS3_TOKENS, "<|im_start|>", "<|im_end|>"])
    ids = {t: tokenizer.token_to_id(t) for t in (BOS, EOS, PAD, IMAGE_TOKEN)}
    text_kw: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 4096, "initializer_range": 0.1,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "tie_word_embeddings": False, "model_type": "llama",
    }
    text_kw.update(text or {})
    vision_kw: dict[str, Any] = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "image_size": tile, "patch_size": 14,
        "initializer_range": 0.1,
    }
    vision_kw.update(vision or {})
    scale = 2
    config = transformers.Idefics3Config(
        vision_config=vision_kw, text_config=text_kw, image_token_id=ids[IMAGE_TOKEN],
        scale_factor=scale, tie_word_embeddings=False, pad_token_id=ids[PAD],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Idefics3ForConditionalGeneration(config)
    model = model.to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), bos_token=BOS, eos_token=EOS,
        pad_token=PAD,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile},
    )
    # image_seq_len: what the processor writes per tile, (tile/patch)^2 / scale^2 (its docs)
    seq_len = (tile // vision_kw["patch_size"]) ** 2 // (scale * scale)
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=fast, image_seq_len=seq_len,
        chat_template=CHATML,
    )
    processor.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                "eos_token": EOS, "pad_token": PAD, "chat_template": CHATML})
    cfg_path.write_text(json.dumps(cfg) + "\n")
    return out
