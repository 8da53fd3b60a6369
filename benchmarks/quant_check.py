"""Quantization check on the Llama-3-8B shape, in one device call (~3-6 minutes on an H100).

For bf16 (reference), fp8, bitsandbytes int8 and nf4, on one random-weight model with the 8B
shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256), built on
the GPU directly (no checkpoint on disk: this checks the quantized linears, the shard's loading
path is covered by the CPU tests):
  - relative logit error vs bf16 over a 4 x 128-token prefill, ||L_q - L_bf16|| / ||L_bf16||, and
    greedy top-1 agreement (targets: fp8 < 2%, int8 < 3%, nf4 < 8%);
  - weight bytes of the linear layers (targets: ~2x, ~2x, ~3.5x less than bf16);
  - batch-1 decode step time (CUDA graph, ~1k-token context, SDPA over a contiguous cache):
    fp8 vs bf16 (target: >= 1.6x faster).
Every linear goes through shard.quantization.make_linear_weights, exactly what the shard uses.
The embedding and LM head stay bf16 in every variant (as in the shard).

Run (from the repo root, bitsandbytes wheel carried in .whl/):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/bitsandbytes-*.whl \
    && PYTHONPATH=/tmp/site:. python3 benchmarks/quant_check.py --out $OUT/quant_check.json
Writes a JSON (and prints a markdown table for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.quantization import QuantizeMethod, make_linear_weights


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


LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def make_float_weights(shape: Shape, device: torch.device, seed: int, std: float):
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

    def rand(*size):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * std).to(
            torch.bfloat16
        )

    layers = [{name: rand(*dims[name]) for name in LINEAR_NAMES} for _ in range(shape.layers)]
    return layers, rand(shape.vocab, h), rand(shape.vocab, h)


class Model:
    """A compact Llama forward over prebuilt linear modules (contiguous KV cache, SDPA)."""

    def __init__(self, shape: Shape, layers, embed, lm_head, method, device):
        self.shape, self.embed, self.lm_head = shape, embed, lm_head
        self.layers = []
        for lw in layers:
            self.layers.append(
                {
                    name: make_linear_weights(lw[name], None, method, compute_dtype=torch.bfloat16)
                    for name in LINEAR_NAMES
                }
            )
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

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache=None, cache_len: int = 0):
        """ids [b, t]. Without cache: causal prefill over t. With cache ([layers] of (k, v)
        [b, kv_heads, T, d]): decode writes at pos and attends to [0, cache_len]."""
        s = self.shape
        b, t = ids.shape
        x = F.embedding(ids, self.embed)  # [b, t, hidden]
        for li, layer in enumerate(self.layers):
            hdn = self.rms(x)
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
            x = x + layer["o"](o.transpose(1, 2).reshape(b, t, s.hidden))
            hdn = self.rms(x)
            x = x + layer["down"](F.silu(layer["gate"](hdn)) * layer["up"](hdn))
        return F.linear(self.rms(x), self.lm_head).float()  # [b, t, vocab]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="fp8,bitsandbytes,bitsandbytes-nf4")
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick look")
    parser.add_argument("--std", type=float, default=0.02, help="init std (HF Llama: 0.02)")
    parser.add_argument("--prompt-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--speed-methods",
        default="fp8,bitsandbytes,bitsandbytes-nf4",
        help="methods whose decode step is timed (bf16 always is)",
    )
    parser.add_argument("--out", default="quant_check.json")
    parser.add_argument("--tiny", action="store_true", help="small shape on CPU (smoke test)")
    args = parser.parse_args()

    if args.tiny:
        device = torch.device("cpu")
        shape = Shape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=1024)
        name, capability = "cpu", []
    else:
        device = torch.device("cuda")
        shape = Shape(layers=args.layers)
        name = torch.cuda.get_device_properties(device).name
        capability = list(torch.cuda.get_device_capability(device))
    report: dict = {
        "device": name,
        "capability": capability,
        "torch": torch.__version__,
        "shape": shape.__dict__,
        "date": time.strftime("%Y-%m-%d"),
        "prompt": [args.prompt_batch, args.prompt_len],
        "context": args.context,
        "results": {},
    }
    try:
        import bitsandbytes

        report["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        report["bitsandbytes"] = None
    print(f"device {name}, torch {torch.__version__}, bitsandbytes {report['bitsandbytes']}")

    t0 = time.time()
    layers, embed, lm_head = make_float_weights(shape, device, seed=0, std=args.std)
    g = torch.Generator(device=device).manual_seed(1)
    if args.tiny:
        args.prompt_len = min(args.prompt_len, 16)
    ids = torch.randint(
        0, shape.vocab, (args.prompt_batch, args.prompt_len), device=device, generator=g
    )
    pos = torch.arange(args.prompt_len, device=device)
    print(f"weights built in {time.time() - t0:.1f} s")

    def evaluate(name: str, method: QuantizeMethod | None, ref_logits: torch.Tensor | None):
        t = time.time()
        model = Model(shape, layers, embed, lm_head, method, device)
        build_s = time.time() - t
        with torch.inference_mode():
            logits = model.forward(ids, pos)  # [b, t, vocab] fp32
        entry = {"weight_bytes": model.weight_bytes(), "build_s": round(build_s, 1)}
        if ref_logits is not None:
            entry["rel_logit_err"] = float((logits - ref_logits).norm() / ref_logits.norm())
            entry["top1_agree"] = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        speed_list = [m for m in args.speed_methods.split(",") if m]
        if device.type == "cuda" and (method is None or method.value in speed_list):
            graph_ok = method in (None, QuantizeMethod.FP8)
            with torch.inference_mode():
                entry["decode_ms"] = time_decode(model, device, args.context, args.iters, graph_ok)
        print(f"{name}: {json.dumps(entry)}", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        return logits, entry

    ref, base = evaluate("bf16", None, None)
    report["results"]["bf16"] = base
    for value in [m for m in args.methods.split(",") if m]:
        method = QuantizeMethod(value)
        try:
            _, entry = evaluate(value, method, ref)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other methods
            print(f"{value}: FAILED {type(exc).__name__}: {exc}", flush=True)
            report["results"][value] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        entry["memory_reduction"] = base["weight_bytes"] / entry["weight_bytes"]
        if "decode_ms" in entry:
            entry["decode_speedup"] = base["decode_ms"] / entry["decode_ms"]
        report["results"][value] = entry

    # Memory roofline of the bf16 decode step, for context.
    kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * args.context
    report["bf16_step_bytes"] = base["weight_bytes"] + 2 * shape.vocab * shape.hidden + kv_bytes
    Path(args.out).write_text(json.dumps(report, indent=2))

    targets = {
        "fp8": (0.02, 2.0, 1.6),
        "bitsandbytes": (0.03, 2.0, None),
        "bitsandbytes-nf4": (0.08, 3.5, None),
    }
    print(
        "\n| method | rel. logit error (target) | top-1 agree | linear weight GiB | reduction "
        "(target) | decode b=1 ms | speedup vs bf16 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    gib = 1024**3
    print(
        f"| bf16 | — | — | {base['weight_bytes'] / gib:.2f} | 1.00× | "
        f"{base.get('decode_ms', math.nan):.2f} | 1.00× |"
    )
    for value, entry in report["results"].items():
        if value == "bf16":
            continue
        if "error" in entry:
            print(f"| {value} | failed: {entry['error']} | | | | | |")
            continue
        err_t, mem_t, speed_t = targets.get(value, (None, None, None))
        speed = entry.get("decode_speedup")
        print(
            f"| {value} | {entry['rel_logit_err'] * 100:.2f}% (< {err_t * 100:.0f}%) | "
            f"{entry['top1_agree'] * 100:.1f}% | {entry['weight_bytes'] / gib:.2f} | "
            f"{entry['memory_reduction']:.2f}× (≈{mem_t}×) | {entry.get('decode_ms', math.nan):.2f} | "
            + (f"{speed:.2f}×" if speed else "—")
            + (f" (≥ {speed_t}×)" if speed_t else "")
            + " |"
        )


if __name__ == "__main__":
    main()
