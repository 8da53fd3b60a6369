"""Independent check of QUALITY.md's deltas: the formats' own error, without tokenwire's code paths.

transformers (float32) on the first N tokens of the perplexity text, with either every linear
weight (embeddings excluded) or every k_proj/v_proj output round-tripped through a format:
  - fp8 e4m3 weights, one scale per output channel (absmax / 448);
  - nf4 weights, bitsandbytes, blocksize 64;
  - fp8 e4m3 K/V, one scale per layer and KV head from that head's absmax over the same text (an
    oracle calibration; K is taken before rotary, tokenwire stores it after).
Also prints each weight format's relative error ||W_q - W|| / ||W|| (int8 per-channel for
comparison). Run: .venv/bin/python benchmarks/quality_roundtrip.py [--tokens 1024]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.tools.perplexity import reference_prefix


def fp8_rows(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(-1, keepdim=True) / 448.0
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(-1, keepdim=True) / 127.0
    return torch.round(w / scale).clamp(-127, 127) * scale


def nf4_blocks(w: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    q, state = bnbf.quantize_4bit(w.to(torch.bfloat16), blocksize=64, quant_type="nf4")
    return bnbf.dequantize_4bit(q, state).float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    import transformers
    from tokenizers import Tokenizer

    model_dir = args.model_dir
    if model_dir is None:
        from service.launcher import cache_dir, resolve_model

        model_dir = resolve_model(None, None, cache_dir())[1]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = reference_prefix(tokenizer, args.tokens)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False).ids])  # [1, T]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    linears = {n: p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n}
    original = {n: p.detach().clone() for n, p in linears.items()}

    def perplexity() -> float:
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # [T-1, vocab]
            return math.exp(-float(logprobs.gather(1, ids[0, 1:, None]).mean()))

    base = perplexity()
    print(f"float32: perplexity {base:.4f} over {ids.shape[1]} tokens")
    weight_formats: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "fp8 e4m3 per-channel": fp8_rows, "int8 per-channel": int8_rows,
        "nf4 blocksize 64": nf4_blocks,
    }
    for name, round_trip in weight_formats.items():
        err = sum(float((round_trip(w) - w).pow(2).sum()) for w in original.values())
        norm = sum(float(w.pow(2).sum()) for w in original.values())
        print(f"{name}: relative weight error {100 * math.sqrt(err / norm):.2f} %")
        if name.startswith("int8"):
            continue  # bitsandbytes int8 also keeps outlier columns in 16-bit: not this
        with torch.no_grad():
            for n, p in linears.items():
                p.copy_(round_trip(original[n]))
        value = perplexity()
        print(f"  weights through {name}: perplexity {value:.4f} ({100 * (value / base - 1):+.2f} %)")
        with torch.no_grad():
            for n, p in linears.items():
                p.copy_(original[n])

    head_dim = model.config.head_dim

    def kv_round_trip(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        x = out.view(*out.shape[:-1], -1, head_dim)  # [1, T, kv_heads, head_dim]
        scale = x.abs().amax(dim=(0, 1, 3), keepdim=True) / 448.0  # one per KV head
        return ((x / scale).to(torch.float8_e4m3fn).float() * scale).view_as(out)

    hooks = [
        proj.register_forward_hook(kv_round_trip)
        for layer in model.model.layers
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)
    ]
    value = perplexity()
    for hook in hooks:
        hook.remove()
    print(f"K/V through fp8 e4m3 per head: perplexity {value:.4f} ({100 * (value / base - 1):+.2f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
