"""Quantization quality on trained weights: SmolLM2-135M-Instruct (the embedded default).

For each variant (bf16 reference, --quantize fp8, bitsandbytes int8, bitsandbytes-nf4,
--kv-cache-dtype fp8_e4m3fn, plus float32 for context), a shard is built exactly as
`tokenwire shard` builds it (shard.loader.Shard: the same weight loading and quantization, the
same warmup, which calibrates fp8 KV scales), and the first N tokens of
`pydoc_data.topics` (shard/tools/perplexity.py) are run through it as a chunked prefill on one
sequence: every chunk after the first attends to the K/V of the earlier ones through the paged
cache, so an fp8 KV cache is read back quantized. From the logits of every position:
  - perplexity of the text and its change vs bf16 (targets: <= 1.5 % for fp8 weights, int8 and
    the fp8 KV cache, <= 10 % for nf4);
  - top-1 agreement: how often the next-token argmax equals bf16's;
  - mean KL(bf16 || variant) of the next-token distributions, in nats.

On CPU, fp8 weights run weight-only: the stored float8_e4m3fn weight and its per-channel scale
are dequantized to the activation dtype for the matmul (shard/quantization/fp8.py). That measures
the error of the fp8 weights themselves; on Hopper, prefill batches go through W8A8
`_scaled_mm` (activations quantized per token too), whose own error against this path is covered
by the GPU tests.

Calibrated variants (`tokenwire quantize`, shard/tools/quantize.py) score checkpoints the tool
writes from the same snapshot, calibrated on pydoc_data.topics tokens from 8,192 on (never the
scored first N): GPTQ fp8 (served with no --quantize), GPTQ nf4 (served with --quantize
bitsandbytes-nf4), and fp8 KV-cache scales from that text under several scale choices (the
spread says how much of the KV figure is the choice of scale). The checkpoints are written once
into --calibrated-dir and reused (their config.json says how each was made; a mismatch is an
error, not a silent reuse).

Run (from the repo root; converts the default model once into the cache if needed):
  .venv/bin/python benchmarks/quality.py --out benchmarks/raw/quality-cpu.json
Prints the markdown table of benchmarks/QUALITY.md. --reuse RAW.json takes the rows of the named
variants from an earlier run of this script instead of scoring them again, only if that run's
bf16 perplexity is bit-identical to this one's (same text, model and code path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.distributed.groups import Dist  # noqa: E402
from shard.runner.warmup import WarmupSpec  # noqa: E402
from shard.server.loader import Shard, ShardConfig  # noqa: E402
from shard.runner.model_runner import StepInputs  # noqa: E402
from shard.tools.perplexity import reference_prefix  # noqa: E402
from shard.tools.gptq import GptqSettings  # noqa: E402
from shard.tools.quantize import QuantizeSpec, quantize_model  # noqa: E402

# Checkpoints `tokenwire quantize` writes for the calibrated variants (key -> how). GPTQ on
# 32 x 512 calibration tokens; KV scales from 8 x 512 (only a max or an MSE per head to fit).
CALIBRATED: dict[str, QuantizeSpec] = {
    "fp8-gptq": QuantizeSpec(weights="fp8", kv_scales=True, samples=32),
    "nf4-gptq": QuantizeSpec(weights="nf4", samples=8),
    "nf4-gptq-act-order": QuantizeSpec(weights="nf4", samples=8,
                                       gptq=GptqSettings(act_order=True)),
    "kv-mse": QuantizeSpec(weights="none", kv_scales=True, kv_scale_method="mse",
                           kv_headroom=4.0, samples=8),
    "kv-absmax": QuantizeSpec(weights="none", kv_scales=True, kv_scale_method="absmax",
                              kv_headroom=1.0, samples=8),
}


def quantize_flags(spec: QuantizeSpec) -> str:
    """The `tokenwire quantize` command line of a CALIBRATED spec."""
    parts = [f"--weights {spec.weights}"]
    if spec.kv_scales:
        parts.append(f"--kv-scales --kv-scale-method {spec.kv_scale_method} "
                     f"--kv-headroom {spec.kv_headroom:g}")
    parts.append(f"--samples {spec.samples} --seq-len {spec.seq_len}")
    if spec.gptq.act_order:
        parts.append("--act-order")
    return "tokenwire quantize " + " ".join(parts)


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str
    quantize: str | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_rotation: str = "hadamard"  # the shard's default; "none" stores keys unrotated
    target_delta_pct: float | None = None  # |Δ perplexity| target vs bf16, percent
    checkpoint: str | None = None  # a CALIBRATED key: serve that checkpoint instead
    # fp8 KV cache: after warmup, set every scale to this value / multiply every scale by it
    kv_scale_value: float | None = None
    kv_scale_factor: float | None = None

    @property
    def flags(self) -> str:
        parts = []
        if self.checkpoint is not None:
            parts.append(f"{quantize_flags(CALIBRATED[self.checkpoint])} →")
        parts.append(f"--dtype {self.dtype}")
        if self.quantize:
            parts.append(f"--quantize {self.quantize}")
        if self.kv_cache_dtype != "auto":
            parts.append(f"--kv-cache-dtype {self.kv_cache_dtype}")
            if self.kv_cache_rotation != "hadamard":
                parts.append(f"--kv-cache-rotation {self.kv_cache_rotation}")
        if self.kv_scale_value is not None:
            parts.append(f"(scales set to {self.kv_scale_value:g})")
        if self.kv_scale_factor is not None:
            parts.append(f"(scales x{self.kv_scale_factor:g})")
        return " ".join(parts)


VARIANTS = {
    "bf16": Variant("bf16", "bfloat16"),
    "fp32": Variant("fp32", "float32"),
    "fp8": Variant("fp8 weights", "bfloat16", quantize="fp8", target_delta_pct=1.5),
    "int8": Variant("int8 (bitsandbytes)", "bfloat16", quantize="bitsandbytes",
                    target_delta_pct=1.5),
    "nf4": Variant("nf4 (bitsandbytes-nf4)", "bfloat16", quantize="bitsandbytes-nf4",
                   target_delta_pct=10.0),
    "kv-fp8": Variant("fp8 KV cache", "bfloat16", kv_cache_dtype="fp8_e4m3fn",
                      target_delta_pct=1.5),
    "kv-fp8-norot": Variant("fp8 KV cache, keys not rotated", "bfloat16",
                            kv_cache_dtype="fp8_e4m3fn", kv_cache_rotation="none"),
    "fp8-gptq": Variant("fp8 weights, GPTQ", "bfloat16", target_delta_pct=1.5,
                        checkpoint="fp8-gptq"),
    "nf4-gptq": Variant("nf4, GPTQ", "bfloat16", quantize="bitsandbytes-nf4",
                        target_delta_pct=10.0, checkpoint="nf4-gptq"),
    "nf4-gptq-act-order": Variant("nf4, GPTQ act-order", "bfloat16", quantize="bitsandbytes-nf4",
                                  target_delta_pct=10.0, checkpoint="nf4-gptq-act-order"),
    "kv-fp8-mse": Variant("fp8 KV cache, calibrated (MSE x4)", "bfloat16",
                          kv_cache_dtype="fp8_e4m3fn", target_delta_pct=1.5, checkpoint="kv-mse"),
    "kv-fp8-absmax1": Variant("fp8 KV cache, calibrated (absmax x1)", "bfloat16",
                              kv_cache_dtype="fp8_e4m3fn", checkpoint="kv-absmax"),
    "kv-fp8-absmax4": Variant("fp8 KV cache, calibrated (absmax x4)", "bfloat16",
                              kv_cache_dtype="fp8_e4m3fn", checkpoint="kv-absmax",
                              kv_scale_factor=4.0),
    "kv-fp8-one": Variant("fp8 KV cache, scale 1.0", "bfloat16", kv_cache_dtype="fp8_e4m3fn",
                          kv_scale_value=1.0),
}


def calibrated_checkpoint(model_dir: Path, root: Path, key: str) -> Path:
    """The CALIBRATED[key] checkpoint under root, written by the tool the first time."""
    spec = CALIBRATED[key]
    path = root / key
    if not path.exists():
        print(f"writing {path}: {quantize_flags(spec)}", file=sys.stderr, flush=True)
        report = quantize_model(model_dir, path, spec)
        print(f"  done in {report.seconds:.0f}s: {report}", file=sys.stderr, flush=True)
    made = json.loads((path / "config.json").read_text()).get("tokenwire_quantize", {})
    expected = {
        "weights": spec.weights,
        "kv_scales": f"{spec.kv_scale_method} x{spec.kv_headroom:g}" if spec.kv_scales else None,
        "calibration_tokens": spec.samples * spec.seq_len,
    }
    if {k: made.get(k) for k in expected} != expected:
        raise SystemExit(f"{path} was made differently ({made}); expected {expected}: remove it")
    return path


@dataclass
class Row:
    variant: str
    flags: str
    perplexity: float
    delta_pct: float
    top1_agreement: float
    mean_kl: float
    target_delta_pct: float | None
    seconds: float


def next_token_logprobs(model_dir: Path, variant: Variant, ids: list[int], chunk: int,
                        device: str) -> torch.Tensor:
    """[len(ids) - 1, vocab] float32 log-softmax of the logits at positions 0 .. T-2."""
    shard = Shard(
        ShardConfig(model_id=str(model_dir), dtype=variant.dtype, device=device,
                    quantize=variant.quantize, kv_cache_dtype=variant.kv_cache_dtype,
                    kv_cache_rotation=variant.kv_cache_rotation,
                    kv_cache_memory_mb=1024),
        Dist(),
    )
    total = len(ids)
    shard.warmup(WarmupSpec(max_input_tokens=chunk, max_total_tokens=total,
                            max_batch_prefill_tokens=chunk, max_batch_size=1))
    for attn in shard.runner.model.attns:  # the scale-choice variants of the fp8 KV cache
        scales = attn.kv_scales
        for s in () if scales is None else (scales.k_scale, scales.v_scale):
            if variant.kv_scale_value is not None:
                s.fill_(variant.kv_scale_value)
            if variant.kv_scale_factor is not None:
                s.mul_(variant.kv_scale_factor)
    bs = shard.runner.block_size
    blocks = list(range(math.ceil(total / bs)))
    out = []
    with torch.inference_mode():
        for start in range(0, total - 1, chunk):
            stop = min(start + chunk, total - 1)
            n = stop - start
            step = StepInputs(
                token_ids=ids[start:stop], positions=list(range(start, stop)), query_lens=[n],
                seq_lens=[stop], block_tables=[blocks], logits_indices=list(range(n)),
            )
            logits = shard.runner.execute(step).float()  # [n, vocab]
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return torch.cat(out)  # [T-1, vocab]


def compare(name: Variant, logprobs: torch.Tensor, reference: torch.Tensor,
            targets: torch.Tensor, ref_ppl: float, seconds: float) -> Row:
    nll = -logprobs.gather(1, targets[:, None])[:, 0]  # [T-1]
    ppl = math.exp(float(nll.mean()))
    top1 = float((logprobs.argmax(-1) == reference.argmax(-1)).float().mean())
    # KL(ref || q) = sum_v p_ref (log p_ref - log q), per position, then the mean.
    kl = float((reference.exp() * (reference - logprobs)).sum(-1).mean())
    return Row(name.name, name.flags, ppl, 100.0 * (ppl / ref_ppl - 1.0), top1, kl,
               name.target_delta_pct, seconds)


def markdown(rows: list[Row], tokens: int) -> str:
    lines = [
        (
            f"| variant | flags | perplexity ({tokens} tokens) | Δ ppl vs bf16 | target | "
            "top-1 agreement with bf16 | mean KL vs bf16 (nats) |"
        ),
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        target = f"≤ {r.target_delta_pct:g} %" if r.target_delta_pct is not None else ""
        met = ""
        if r.target_delta_pct is not None:
            met = " ✓" if abs(r.delta_pct) <= r.target_delta_pct else " ✗"
        lines.append(
            f"| {r.variant} | `{r.flags}` | {r.perplexity:.3f} | {r.delta_pct:+.2f} %{met} | "
            f"{target} | {100 * r.top1_agreement:.2f} % | {r.mean_kl:.5f} |"
        )
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a snapshot (default: the embedded SmolLM2, converted into the cache)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of text to score")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default="bf16,fp32,fp8,int8,nf4,kv-fp8",
                        help=f"comma-separated, from {', '.join(VARIANTS)} (bf16 always runs)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--calibrated-dir", type=Path, default=None,
                        help="where the calibrated checkpoints live (default: the tokenwire "
                        "cache's quality-calibrated/)")
    parser.add_argument("--reuse", type=Path, nargs="+", default=[],
                        help="earlier runs' JSON to take the --reuse-variants rows from")
    parser.add_argument("--reference", type=Path, default=None,
                        help="bf16 log-probabilities cache: read if it exists (bf16 is then not "
                        "scored again), else written; lets variants run in separate processes")
    parser.add_argument("--reuse-variants", default="",
                        help="comma-separated variant keys to take from --reuse")
    args = parser.parse_args(argv)

    from service.app.launcher import cache_dir, ensure_local_model

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = ensure_local_model(None, None, cache_dir())[1]
    calibrated_root = args.calibrated_dir or cache_dir() / "quality-calibrated"
    reused: dict[str, tuple[Path, dict, dict]] = {}  # key -> (file, its JSON, the row)
    wanted = [k for k in args.reuse_variants.split(",") if k]
    for path in args.reuse:
        earlier = json.loads(path.read_text())
        by_name = {r["variant"]: r for r in earlier["rows"]}
        for k in wanted:
            if VARIANTS[k].name in by_name:
                reused[k] = (path, earlier, by_name[VARIANTS[k].name])
    if missing := [k for k in wanted if k not in reused]:
        raise SystemExit(f"--reuse-variants {','.join(missing)}: not in {args.reuse}")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(reference_prefix(tokenizer, args.tokens), add_special_tokens=False).ids
    targets = torch.tensor(ids[1:])
    names = ["bf16"] + [v for v in args.variants.split(",") if v and v != "bf16"]
    rows: list[Row] = []
    reference: torch.Tensor | None = None
    ref_ppl = float("nan")
    for key in names:
        variant = VARIANTS[key]
        if key in reused:
            path, earlier, row = reused[key]
            if earlier.get("tokens") != len(ids) or earlier["rows"][0]["perplexity"] != ref_ppl:
                raise SystemExit(f"--reuse: {path} scored other tokens or another bf16 "
                                 f"perplexity ({earlier['rows'][0]['perplexity']} vs {ref_ppl})")
            rows.append(Row(**row))
            print(f"{variant.name}: reused from {path}", file=sys.stderr, flush=True)
            continue
        if key == "bf16" and args.reference is not None and args.reference.exists():
            reference = torch.load(args.reference)
            ref_ppl = math.exp(float(-reference.gather(1, targets[:, None]).mean()))
            rows.append(compare(variant, reference, reference, targets, ref_ppl, 0.0))
            print(f"bf16: from {args.reference}, ppl {ref_ppl:.4f}", file=sys.stderr, flush=True)
            continue
        served = model_dir
        if variant.checkpoint is not None:
            served = calibrated_checkpoint(model_dir, calibrated_root, variant.checkpoint)
        t0 = time.perf_counter()
        logprobs = next_token_logprobs(served, variant, ids, args.chunk, args.device)
        seconds = time.perf_counter() - t0
        if reference is None:
            reference = logprobs
            ref_ppl = math.exp(float(-logprobs.gather(1, targets[:, None]).mean()))
            if args.reference is not None:
                torch.save(reference, args.reference)
        row = compare(variant, logprobs, reference, targets, ref_ppl, seconds)
        rows.append(row)
        print(f"{variant.name}: ppl {row.perplexity:.4f} ({row.delta_pct:+.2f} %), top-1 "
              f"{100 * row.top1_agreement:.2f} %, KL {row.mean_kl:.5f} [{seconds:.0f}s]",
              file=sys.stderr, flush=True)
    table = markdown(rows, len(ids))
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {cpu_model()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "device": args.device,
            "model_dir": str(model_dir),
            "calibrated": {k: quantize_flags(v) for k, v in CALIBRATED.items()},
            "reused": {k: str(v[0]) for k, v in reused.items()},
            "tokens": len(ids),
            "chunk": args.chunk,
            "rows": [asdict(r) for r in rows],
            "table": table,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
