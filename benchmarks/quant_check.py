"""Quantization check on the Llama-3-8B shape, in one device call (~1-3 minutes on an H200).

For bf16 (reference), fp8, bitsandbytes int8 and nf4, on one random-weight model with the 8B
shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256), built on
the GPU directly (no checkpoint on disk: this checks the quantized linears, the shard's loading
path is covered by the CPU tests):
  - relative logit error vs bf16 over a 4 x 128-token prefill, ||L_q - L_bf16|| / ||L_bf16||, and
    greedy top-1 agreement (targets: fp8 < 2%, int8 < 3%, nf4 < 8%); also each variant vs an fp32
    run of the same weights;
  - the tolerance floor: bf16 vs fp32 (same weights upcast, TF32 off). A random deep network
    amplifies any per-layer perturbation (~25-30x at HF init on this shape), which trained models
    do not do, so the whole-model error is only meaningful next to this floor;
  - per-linear error, free of that amplification: ||x W_q^T - x W^T|| / ||x W^T|| for every linear
    kind (q, k, v, o, gate, up, down) of a few layers (default first, middle, last), on the real
    bf16 activations that reach that linear in the bf16 model (x W^T: the bf16 linear; bf16 vs
    fp32 of the same single linears for context);
  - weight bytes of the linear layers (targets: ~2x, ~2x, ~3.5x less than bf16);
  - batch-1 decode step time (CUDA graph, ~1k-token context, SDPA over a contiguous cache):
    fp8 vs bf16 (target: >= 1.6x faster); --skip-decode leaves it out.
Every linear goes through shard.quantization.make_linear_weights, exactly what the shard uses.
The embedding and LM head stay bf16 in every variant (as in the shard).

--init hf: every weight N(0, std) (HF Llama's init). --init depth-scaled: o_proj and down_proj
(the projections that write into the residual stream) N(0, std / sqrt(2 * layers)), as GPT-2 /
Megatron-LM / OLMo initialise deep pre-norm transformers; the rest as hf, from the same random
stream (so the other weights are bit-identical between the two inits).

Run (from the repo root, bitsandbytes wheel carried in .whl/):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/bitsandbytes-*.whl \
    && PYTHONPATH=/tmp/site:. python3 benchmarks/quant_check.py --out $OUT/quant_check.json
Quick look (~1 min of GPU time): add --skip-decode, --layers 8 and/or --methods fp8.
CPU sanity check of the method at a small shape:
  .venv/bin/python benchmarks/quant_check.py --device cpu --shape small --skip-decode --out /tmp/q.json
(fp8 runs weight-only dequantized on CPU, the GPU runs W8A8 _scaled_mm for these prefill-sized
batches; bitsandbytes methods are skipped where bitsandbytes is not installed.)
Writes a JSON (and prints markdown tables for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.quantization import QuantizeMethod, make_linear_weights, parse_quantize
from shard.quantization.fp8 import Fp8Linear


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "8b": Shape(),
    # Same depth and GQA ratio class as the 8B, ~1/64 of its linear FLOPs: runs on a CPU.
    "small": Shape(hidden=512, heads=8, kv_heads=2, intermediate=1792, vocab=4096),
    # For the unit test (seconds on one CPU thread).
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256),
}

LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
# The projections whose outputs are added to the residual stream.
RESIDUAL_OUT = ("o", "down")
INITS = ("hf", "depth-scaled")
ALL_METHODS = "bf16,fp8,bitsandbytes,bitsandbytes-nf4"


def init_stds(shape: Shape, init: str, std: float) -> dict[str, float]:
    """Per linear kind, the std of its N(0, std) init."""
    if init not in INITS:
        raise ValueError(f"--init: unknown {init!r}; expected one of {', '.join(INITS)}")
    stds = dict.fromkeys(LINEAR_NAMES, std)
    if init == "depth-scaled":
        # 2 residual writes per layer: the residual stream's variance then grows like
        # sum over 2L branches of (1/2L) instead of 2L, i.e. O(1) instead of O(L).
        for name in RESIDUAL_OUT:
            stds[name] = std / math.sqrt(2 * shape.layers)
    return stds


def make_float_weights(shape: Shape, device: torch.device, seed: int, std: float, init="hf"):
    """Per layer dict of bf16 [out, in] weights, plus embedding and LM head."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, kv, i = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    dims = {
        "q": (h, h),
        "k": (kv, h),
        "v": (kv, h),
        "o": (h, h),
        "gate": (i, h),
        "up": (i, h),
        "down": (h, i),
    }
    stds = init_stds(shape, init, std)

    def rand(size, s):
        # Same draws in the same order whatever the init: only the scale differs.
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * s).to(
            torch.bfloat16
        )

    layers = [
        {name: rand(dims[name], stds[name]) for name in LINEAR_NAMES} for _ in range(shape.layers)
    ]
    return layers, rand((shape.vocab, h), std), rand((shape.vocab, h), std)


class Model:
    """A compact Llama forward over prebuilt linear modules (contiguous KV cache, SDPA). Runs in
    the dtype of its weights (bf16, or fp32 for the reference)."""

    def __init__(self, shape: Shape, layers, embed, lm_head, method, device, fp8_scaled_mm=None):
        """fp8_scaled_mm: None builds every linear as the shard does (make_linear_weights);
        True/False forces fp8's W8A8 / weight-only path (e.g. W8A8 on CPU, as GPUs run it)."""
        self.shape, self.embed, self.lm_head = shape, embed, lm_head
        self.layers = []

        def build(w):
            if method is QuantizeMethod.FP8 and fp8_scaled_mm is not None:
                return Fp8Linear.from_float(w, None, use_scaled_mm=fp8_scaled_mm)
            return make_linear_weights(w, None, method, compute_dtype=torch.bfloat16)

        for lw in layers:
            self.layers.append({name: build(lw[name]) for name in LINEAR_NAMES})
        inv = 1.0 / (
            shape.rope_theta
            ** (torch.arange(0, shape.head_dim, 2, device=device).float() / shape.head_dim)
        )
        self.inv_freq = inv

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes for layer in self.layers for m in layer.values())

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x [b, heads, t, d], pos [t]; rotate-half convention
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [t, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def rms(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.eps)).to(x.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache=None,
        cache_len: int = 0,
        record: dict[int, dict[str, torch.Tensor]] | None = None,
    ):
        """ids [b, t]. Without cache: causal prefill over t. With cache ([layers] of (k, v)
        [b, kv_heads, T, d]): decode writes at pos and attends to [0, cache_len].
        record {layer index: {}}: each such dict is filled with the input of every linear of
        that layer (by name), for the per-linear errors."""
        s = self.shape
        b, t = ids.shape
        x = F.embedding(ids, self.embed)  # [b, t, hidden]
        for li, layer in enumerate(self.layers):
            rec = record.get(li) if record is not None else None
            hdn = self.rms(x)
            if rec is not None:
                rec.update(q=hdn, k=hdn, v=hdn)
            q = layer["q"](hdn).view(b, t, s.heads, s.head_dim).transpose(1, 2)
            k = layer["k"](hdn).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            v = layer["v"](hdn).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if cache is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                kc, vc = cache[li]
                kc.index_copy_(2, pos, k)
                vc.index_copy_(2, pos, v)
                o = F.scaled_dot_product_attention(
                    q, kc[:, :, :cache_len], vc[:, :, :cache_len], enable_gqa=True
                )
            o = o.transpose(1, 2).reshape(b, t, s.hidden)
            if rec is not None:
                rec["o"] = o
            x = x + layer["o"](o)
            hdn = self.rms(x)
            if rec is not None:
                rec.update(gate=hdn, up=hdn)
            act = F.silu(layer["gate"](hdn)) * layer["up"](hdn)
            if rec is not None:
                rec["down"] = act
            x = x + layer["down"](act)
        return F.linear(self.rms(x), self.lm_head).float()  # [b, t, vocab]


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """||value - ref|| / ||ref||, in fp32."""
    ref = ref.float()
    return float((value.float() - ref).norm() / ref.norm())


def top1_agree(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return float((logits.argmax(-1) == ref.argmax(-1)).float().mean())


def per_linear_errors(
    modules: list[dict], acts: dict[int, dict[str, torch.Tensor]], refs: dict[int, dict]
) -> dict[str, dict[int, float]]:
    """{kind: {layer: rel. error}} of modules[layer][kind](x) vs refs[layer][kind] on the recorded
    inputs x = acts[layer][kind]."""
    out: dict[str, dict[int, float]] = {name: {} for name in LINEAR_NAMES}
    for li, layer_acts in acts.items():
        for name in LINEAR_NAMES:
            y = modules[li][name](layer_acts[name])
            out[name][li] = rel_err(y, refs[li][name])
    return out


def summarize(errs: dict[str, dict[int, float]]) -> dict:
    """Median over the sampled layers per kind, and the max; the same over every (kind, layer)."""
    by_kind = {
        name: {
            "median": statistics.median(per_layer.values()),
            "max": max(per_layer.values()),
            "layers": {str(li): e for li, e in per_layer.items()},
        }
        for name, per_layer in errs.items()
    }
    everything = [e for per_layer in errs.values() for e in per_layer.values()]
    return {
        "median": statistics.median(everything),
        "max": max(everything),
        "by_kind": by_kind,
    }


def sample_layers(spec: str, layers: int) -> list[int]:
    """'first,mid,last' (default) or explicit indices -> sorted distinct layer indices."""
    named = {"first": 0, "mid": (layers - 1) // 2, "last": layers - 1}
    picked = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        li = named[part] if part in named else int(part)
        if not 0 <= li < layers:
            raise ValueError(f"--sample-layers: layer {li} out of range [0, {layers})")
        picked.add(li)
    return sorted(picked)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_decode(
    model: Model, device: torch.device, context: int, iters: int, graph_ok: bool
) -> float:
    """Mean ms of one batch-1 decode step, replayed from a CUDA graph where graph_ok (bitsandbytes
    kernels are timed eagerly: their int8 outlier path syncs with the host)."""
    s = model.shape
    cache = [
        (
            torch.randn(
                1, s.kv_heads, context + 1, s.head_dim, device=device, dtype=torch.bfloat16
            ),
            torch.randn(
                1, s.kv_heads, context + 1, s.head_dim, device=device, dtype=torch.bfloat16
            ),
        )
        for _ in range(s.layers)
    ]
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.full((1,), context, dtype=torch.long, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up (lazy inits, autotuning) outside the capture
            model.forward(ids, pos, cache, context + 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = None
    if graph_ok:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward(ids, pos, cache, context + 1)
        run = graph.replay
        mode = "graph"
    else:

        def run():
            model.forward(ids, pos, cache, context + 1)

        mode = "eager"
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    print(f"  decode step ({mode}): {ms:.3f} ms")
    return ms  # cache and graph are freed with this frame


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods",
        default=ALL_METHODS,
        help="comma list of bf16, fp8, bitsandbytes, bitsandbytes-nf4 (bf16 always runs as the "
        "reference; listing it also reruns it against itself: should be 0)",
    )
    parser.add_argument("--init", choices=INITS, default="hf", help="see the module docstring")
    parser.add_argument("--std", type=float, default=0.02, help="init std (HF Llama: 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (8b: 32)")
    parser.add_argument(
        "--sample-layers",
        default="first,mid,last",
        help="layers whose linears get per-linear errors: first, mid, last and/or indices",
    )
    parser.add_argument("--prompt-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--skip-decode", action="store_true", help="no decode timing")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--speed-methods",
        default="fp8,bitsandbytes,bitsandbytes-nf4",
        help="methods whose decode step is timed (bf16 always is, unless --skip-decode)",
    )
    parser.add_argument(
        "--fp8-path",
        choices=("auto", "w8a8", "weight-only"),
        default="auto",
        help="auto: as the shard picks (CUDA sm_89+: W8A8 _scaled_mm for prefill; CPU: weight-"
        "only); w8a8 forces torch._scaled_mm (torch >= 2.13 also runs it on CPU)",
    )
    parser.add_argument("--out", default="quant_check.json")
    parser.add_argument("--tiny", action="store_true", help="smoke test: --device cpu --shape tiny")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device, args.shape = "cpu", "tiny"
    return args


def bitsandbytes_missing() -> str | None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        return f"skipped: bitsandbytes is not installed here ({exc})"
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    wall0 = time.time()
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
    methods: list[tuple[str, QuantizeMethod | None]] = []
    for value in [m.strip() for m in args.methods.split(",") if m.strip()]:
        method = None if value == "bf16" else parse_quantize(value)
        methods.append((method.value if method else "bf16", method))
    picked = sample_layers(args.sample_layers, shape.layers)
    fp8_scaled_mm = {"auto": None, "w8a8": True, "weight-only": False}[args.fp8_path]
    # The fp32 reference must be true fp32: TF32 matmuls (10-bit mantissa vs bf16's 7) would put
    # rounding of nearly bf16's own size into the reference.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    if device.type == "cuda":
        name = torch.cuda.get_device_properties(device).name
        capability = list(torch.cuda.get_device_capability(device))
    else:
        name, capability = device.type, []
    if args.shape == "tiny":
        args.prompt_len = min(args.prompt_len, 16)
    stds = init_stds(shape, args.init, args.std)
    report: dict = {
        "device": name,
        "capability": capability,
        "torch": torch.__version__,
        "shape": shape.__dict__,
        "date": time.strftime("%Y-%m-%d"),
        "prompt": [args.prompt_batch, args.prompt_len],
        "context": args.context,
        "init": args.init,
        "std": args.std,
        "init_stds": stds,
        "seed": args.seed,
        "methods": [value for value, _ in methods],
        "fp8_path_flag": args.fp8_path,
        "sample_layers": picked,
        "fp32_reference": "same bf16 weights upcast, fp32 activations, TF32 off",
        "per_linear_reference": "the bf16 linear's output on the bf16 model's own activations",
        "results": {},
    }
    try:
        import bitsandbytes

        report["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        report["bitsandbytes"] = None
    print(
        f"device {name}, torch {torch.__version__}, bitsandbytes {report['bitsandbytes']}, "
        f"shape {args.shape} x {shape.layers} layers, init {args.init} "
        f"(o/down std {stds['o']:.3g}, others {stds['q']:.3g})"
    )

    t0 = time.time()
    layers, embed, lm_head = make_float_weights(shape, device, args.seed, args.std, args.init)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    ids = torch.randint(
        0, shape.vocab, (args.prompt_batch, args.prompt_len), device=device, generator=g
    )
    pos = torch.arange(args.prompt_len, device=device)
    print(f"weights built in {time.time() - t0:.1f} s")
    do_decode = device.type == "cuda" and not args.skip_decode
    speed_list = [m for m in args.speed_methods.split(",") if m]

    # 1. bf16: the reference logits, and the inputs of the sampled layers' linears.
    t = time.time()
    model = Model(shape, layers, embed, lm_head, None, device)
    base = {"weight_bytes": model.weight_bytes(), "build_s": round(time.time() - t, 1)}
    acts: dict[int, dict[str, torch.Tensor]] = {li: {} for li in picked}
    with torch.inference_mode():
        ref = model.forward(ids, pos, record=acts)
        ref_lin = {li: {n: model.layers[li][n](acts[li][n]) for n in LINEAR_NAMES} for li in picked}
        # The exact product of the same bf16 inputs and weights.
        exact_lin = {
            li: {n: F.linear(acts[li][n].float(), layers[li][n].float()) for n in LINEAR_NAMES}
            for li in picked
        }
        if "bf16" in report["methods"]:
            # bf16 vs itself: a second run, so a nonzero value would show run-to-run noise.
            again = model.forward(ids, pos)
            base["rel_logit_err"] = rel_err(again, ref)
            base["top1_agree"] = top1_agree(again, ref)
            base["per_linear"] = summarize(per_linear_errors(model.layers, acts, ref_lin))
            del again
        if do_decode:
            base["decode_ms"] = time_decode(model, device, args.context, args.iters, True)
    del model
    free(device)
    report["results"]["bf16"] = base

    # 2. fp32 reference: how much the network amplifies bf16's own rounding.
    t = time.time()
    model = Model(
        shape,
        [{n: w.float() for n, w in lw.items()} for lw in layers],
        embed.float(),
        lm_head.float(),
        None,
        device,
    )
    with torch.inference_mode():
        ref32 = model.forward(ids, pos)
    del model
    free(device)
    floor_lin = summarize(
        {n: {li: rel_err(ref_lin[li][n], exact_lin[li][n]) for li in picked} for n in LINEAR_NAMES}
    )
    report["bf16_vs_fp32_rel_err"] = rel_err(ref, ref32)
    report["bf16_vs_fp32_top1_agree"] = top1_agree(ref, ref32)
    report["bf16_vs_fp32_per_linear"] = floor_lin
    report["bf16_amplification"] = report["bf16_vs_fp32_rel_err"] / floor_lin["median"]
    base["rel_logit_err_vs_fp32"] = report["bf16_vs_fp32_rel_err"]
    base["top1_agree_vs_fp32"] = report["bf16_vs_fp32_top1_agree"]
    base["per_linear_vs_fp32"] = floor_lin
    print(
        f"fp32 reference ({time.time() - t:.1f} s): bf16 vs fp32 logits "
        f"{report['bf16_vs_fp32_rel_err'] * 100:.3g}%, per linear median "
        f"{floor_lin['median'] * 100:.3g}% -> amplification {report['bf16_amplification']:.1f}x",
        flush=True,
    )

    # 3. The quantized variants.
    for value, method in methods:
        if method is None:
            continue
        if method is not QuantizeMethod.FP8 and (why := bitsandbytes_missing()):
            print(f"{value}: {why}", flush=True)
            report["results"][value] = {"skipped": why}
            continue
        try:
            t = time.time()
            model = Model(shape, layers, embed, lm_head, method, device, fp8_scaled_mm)
            entry = {"weight_bytes": model.weight_bytes(), "build_s": round(time.time() - t, 1)}
            if method is QuantizeMethod.FP8:
                q0 = model.layers[0]["q"]
                entry["path"] = (
                    "W8A8 torch._scaled_mm, per-token activation scales"
                    if q0.use_scaled_mm
                    else "weight-only (dequantized to bf16, F.linear)"
                )
            with torch.inference_mode():
                logits = model.forward(ids, pos)
                entry["rel_logit_err"] = rel_err(logits, ref)
                entry["top1_agree"] = top1_agree(logits, ref)
                entry["rel_logit_err_vs_fp32"] = rel_err(logits, ref32)
                entry["top1_agree_vs_fp32"] = top1_agree(logits, ref32)
                del logits

                entry["per_linear"] = summarize(per_linear_errors(model.layers, acts, ref_lin))
                entry["per_linear_vs_fp32"] = summarize(
                    per_linear_errors(model.layers, acts, exact_lin)
                )
                if entry["per_linear"]["median"] > 0:
                    entry["amplification"] = entry["rel_logit_err"] / entry["per_linear"]["median"]
                if do_decode and value in speed_list:
                    graph_ok = method is QuantizeMethod.FP8
                    entry["decode_ms"] = time_decode(
                        model, device, args.context, args.iters, graph_ok
                    )
        except Exception as exc:  # noqa: BLE001 - report and go on with the other methods
            print(f"{value}: FAILED {type(exc).__name__}: {exc}", flush=True)
            report["results"][value] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        finally:
            model = None
            free(device)
        entry["memory_reduction"] = base["weight_bytes"] / entry["weight_bytes"]
        if "decode_ms" in entry and "decode_ms" in base:
            entry["decode_speedup"] = base["decode_ms"] / entry["decode_ms"]
        brief = {k: v for k, v in entry.items() if not k.startswith("per_linear")}
        print(
            f"{value}: {json.dumps(brief)}, per-linear median "
            f"{entry['per_linear']['median'] * 100:.3g}% max {entry['per_linear']['max'] * 100:.3g}%",
            flush=True,
        )
        report["results"][value] = entry

    # Memory roofline of the bf16 decode step, for context.
    kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * args.context
    report["bf16_step_bytes"] = base["weight_bytes"] + 2 * shape.vocab * shape.hidden + kv_bytes
    report["wall_s"] = round(time.time() - wall0, 1)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_tables(report)
    return report


def pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x * 100:.3g}%"


def ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def print_tables(report: dict) -> None:
    targets = {
        "fp8": (0.02, 2.0, 1.6),
        "bitsandbytes": (0.03, 2.0, None),
        "bitsandbytes-nf4": (0.08, 3.5, None),
    }
    gib = 1024**3
    results = report["results"]
    base = results["bf16"]
    print(
        f"\ninit {report['init']} (std {report['std']}, o/down {report['init_stds']['o']:.3g}), "
        f"{report['shape']['layers']} layers, per-linear errors over layers "
        f"{report['sample_layers']}; bf16 vs fp32 logits (tolerance floor): "
        f"{pct(report['bf16_vs_fp32_rel_err'])}"
    )
    print(
        "\n| method | rel. logit error vs bf16 (target) | vs fp32 | top-1 agree | per-linear err "
        "median / max | logit / linear err | linear weight GiB | reduction (target) "
        "| decode b=1 ms | speedup vs bf16 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    floor = report["bf16_vs_fp32_per_linear"]
    print(
        f"| bf16 vs fp32 (floor) | — | {pct(report['bf16_vs_fp32_rel_err'])} | "
        f"{report['bf16_vs_fp32_top1_agree'] * 100:.1f}% | {pct(floor['median'])} / "
        f"{pct(floor['max'])} | {report['bf16_amplification']:.1f}× | | | | |"
    )
    same = (
        f"{pct(base['rel_logit_err'])} (rerun) | — | {base['top1_agree'] * 100:.1f}% | "
        f"{pct(base['per_linear']['median'])} / {pct(base['per_linear']['max'])} | —"
        if "rel_logit_err" in base
        else "— | — | — | — | —"
    )
    print(
        f"| bf16 | {same} | {base['weight_bytes'] / gib:.2f} | 1.00× | "
        f"{ms(base.get('decode_ms'))} | 1.00× |"
    )
    for value, entry in results.items():
        if value == "bf16":
            continue
        if "error" in entry or "skipped" in entry:
            why = entry.get("error") or entry["skipped"]
            print(f"| {value} | {'failed: ' if 'error' in entry else ''}{why} | | | | | | | | |")
            continue
        err_t, mem_t, speed_t = targets.get(value, (None, None, None))
        speed = entry.get("decode_speedup")
        amp = entry.get("amplification")
        print(
            f"| {value} | {pct(entry['rel_logit_err'])} (< {err_t * 100:.0f}%) | "
            f"{pct(entry['rel_logit_err_vs_fp32'])} | {entry['top1_agree'] * 100:.1f}% | "
            f"{pct(entry['per_linear']['median'])} / {pct(entry['per_linear']['max'])} | "
            + (f"{amp:.1f}×" if amp is not None else "—")
            + f" | {entry['weight_bytes'] / gib:.2f} | "
            f"{entry['memory_reduction']:.2f}× (≈{mem_t}×) | {ms(entry.get('decode_ms'))} | "
            + (f"{speed:.2f}×" if speed else "—")
            + (f" (≥ {speed_t}×)" if speed_t else "")
            + " |"
        )

    # Per-linear errors by kind: median over the sampled layers (max).
    print(
        f"\n| per-linear rel. error, median over layers {report['sample_layers']} (max) | "
        + " | ".join(LINEAR_NAMES)
        + " |"
    )
    print("| --- |" + " --- |" * len(LINEAR_NAMES))
    rows = [("bf16 vs fp32 (floor)", floor)]
    rows += [
        (f"{value} vs bf16", entry["per_linear"])
        for value, entry in results.items()
        if "per_linear" in entry
    ]
    for label, summary in rows:
        cells = [
            f"{pct(summary['by_kind'][n]['median'])} ({pct(summary['by_kind'][n]['max'])})"
            for n in LINEAR_NAMES
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
