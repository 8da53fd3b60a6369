"""LoRA benchmark (issue 25): decode steps at batch 64 with every row on one of 4 different
adapters against the same batch on the base model alone, and the time to load an adapter.

    # GPU, Llama-3-8B shape, rank 16 (what benchmarks/LORA.md reports):
    python -m benchmarks.lora --device cuda
    # CPU check with tiny shapes:
    python -m benchmarks.lora --device cpu --tiny

One process: writes the random checkpoint (GPU: shard/testing/checkpoint.py's 8B shape, bf16;
--tiny: a small llama) and 4 random rank-16 adapters in PEFT's file format (adapter_config.json +
adapter_model.safetensors, every q/k/v/o/gate/up/down projection), loads the shard through the
normal path (`shard.server.loader.Shard` with --max-loras 4, so warmup captures the decode CUDA
graphs with and without the LoRA kernels), then times decode steps through
`ModelRunner.execute` (CUDA-graph replay on GPU, as serving runs them) for:
  base      — every row on the base model (the LoRA-less graphs),
  1 adapter — every row on the same adapter,
  4 adapters — rows spread over 4 adapters (row i on adapter i % 4),
  mixed     — half the rows on the base model, the rest over 4 adapters,
and reports the slowdown against base (target: 4 adapters <= 15 % slower). Adapter load time is
read + validate + slice (file I/O, off the model thread in serving), register, and the first
swap-in to the device. Writes a JSON line to stdout and --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, config: dict, rank: int, seed: int, std: float = 0.01) -> Path:
    """A random LoRA adapter in PEFT's format for a Llama-shaped `config` (the tests check
    tokenwire against adapters written by peft itself)."""
    import torch
    from safetensors.torch import save_file

    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kvh = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kvh * hd),
        "self_attn.v_proj": (h, kvh * hd), "self_attn.o_proj": (heads * hd, h),
        "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter), "mlp.down_proj": (inter, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            p = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{p}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * std).bfloat16()
            tensors[f"{p}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * std).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False,
    }))
    return out


def _timer(device):
    import torch

    def run(fn, iters: int, warmup: int = 3) -> float:
        """Median wall ms per call, synchronised (what a serving step costs)."""
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small llama shapes (CPU check)")
    ap.add_argument("--num-layers", type=int, default=32, help="8B shape: 32 layers")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/twb"),
                    help="checkpoint and adapters (the harness's default: its checkpoint is reused)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    import torch

    from shard.distributed.groups import Dist
    from shard.lora import AdapterSource
    from shard.runner.model_runner import StepInputs
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    device = torch.device(args.device)
    t_start = time.perf_counter()
    if args.tiny:
        from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

        model_dir = args.workdir / "tiny"
        if not (model_dir / "config.json").is_file():
            make_tiny_model(model_dir, TinyModelSpec(
                arch="llama", hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
                num_kv_heads=4, max_position_embeddings=4096))  # fmt: skip
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    else:
        from shard.testing.checkpoint import write_checkpoint

        # The harness's directory name: a checkpoint it wrote on this machine is reused.
        model_dir = args.workdir / f"llama3-8b-shape-{args.num_layers}l"
        write_checkpoint(model_dir, args.num_layers)
        dtype = "bfloat16"
    config = json.loads((model_dir / "config.json").read_text())
    adapter_dirs = [
        write_adapter(args.workdir / f"adapter-{config['num_hidden_layers']}l-r{args.rank}-{i}",
                      config, args.rank, seed=i)
        for i in range(args.adapters)
    ]
    t_written = time.perf_counter()

    block_size = 16
    shard = Shard(ShardConfig(
        model_id=str(model_dir), dtype=dtype, device=args.device, block_size=block_size,
        kv_cache_memory_mb=512 if device.type == "cpu" else None,
        max_loras=args.adapters, max_lora_rank=args.rank,
    ), Dist())  # fmt: skip
    total = args.batch * (args.context + 16)
    shard.warmup(WarmupSpec(
        max_input_tokens=min(args.context, 2048), max_total_tokens=args.context + 16,
        max_batch_prefill_tokens=max(2048, args.context), max_batch_size=args.batch,
        max_batch_total_tokens=total,
    ))  # fmt: skip
    t_loaded = time.perf_counter()
    assert shard.lora is not None
    lora_mib = shard.lora.device_bytes() / 2**20

    # Adapter load time: read + validate + slice, register, first swap-in to the device.
    loads = []
    for i, path in enumerate(adapter_dirs):
        t0 = time.perf_counter()
        adapter = shard.read_adapter(AdapterSource(f"a{i}", str(path)))
        t1 = time.perf_counter()
        shard.register_adapter(adapter)
        t2 = time.perf_counter()
        shard.lora.slots_for([f"a{i}"], set)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t3 = time.perf_counter()
        loads.append({"read_ms": (t1 - t0) * 1e3, "register_ms": (t2 - t1) * 1e3,
                      "swap_in_ms": (t3 - t2) * 1e3, "host_mib": adapter.nbytes() / 2**20})

    runner = shard.runner
    per = math.ceil(args.context / block_size)
    b = args.batch
    assert b * per <= runner.num_blocks, "KV cache too small for the batch"

    def step(slots: list[int] | None) -> StepInputs:
        return StepInputs(
            token_ids=[(17 * i + 5) % 1000 for i in range(b)],
            positions=[args.context - 1] * b,
            query_lens=[1] * b,
            seq_lens=[args.context] * b,
            block_tables=[list(range(i * per, (i + 1) * per)) for i in range(b)],
            logits_indices=list(range(b)),
            lora_slots=slots,
        )

    slot_of = [shard.lora.resident[f"a{i}"] for i in range(args.adapters)]
    cases = {
        "base": None,
        "1_adapter": [slot_of[0]] * b,
        f"{args.adapters}_adapters": [slot_of[i % args.adapters] for i in range(b)],
        "mixed_half_base": [-1 if i % 2 == 0 else slot_of[(i // 2) % args.adapters]
                            for i in range(b)],
    }
    timer = _timer(device)
    results: dict[str, float] = {}
    graphs = runner.graphs is not None
    for name, slots in cases.items():
        s = step(slots)
        results[name] = timer(lambda s=s: runner.execute(s), args.iters)
    # Interleaved second round: the median of both rounds per case (drift on shared machines).
    for name, slots in cases.items():
        s = step(slots)
        results[name] = statistics.median(
            [results[name], timer(lambda s=s: runner.execute(s), args.iters)])
    base = results["base"]
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "shape": "tiny llama (hidden 256, 4 layers)" if args.tiny else
        f"Llama-3-8B ({config['num_hidden_layers']} layers), bf16",
        "rank": args.rank, "adapters": args.adapters, "batch": b, "context": args.context,
        "cuda_graphs": graphs, "lora_slots_mib": round(lora_mib, 1),
        "decode_ms": {k: round(v, 3) for k, v in results.items()},
        "slowdown_vs_base": {k: round(v / base - 1, 4) for k, v in results.items() if k != "base"},
        "target_4_adapters_max_slowdown": 0.15,
        "adapter_load": {
            "read_ms_median": round(statistics.median(x["read_ms"] for x in loads), 1),
            "register_ms_median": round(statistics.median(x["register_ms"] for x in loads), 3),
            "swap_in_ms_median": round(statistics.median(x["swap_in_ms"] for x in loads), 2),
            "host_mib": round(loads[0]["host_mib"], 1),
        },
        "setup_s": {"write": round(t_written - t_start, 1), "load_warmup": round(
            t_loaded - t_written, 1), "total": round(time.perf_counter() - t_start, 1)},
    }
    key = f"{args.adapters}_adapters"
    out["meets_target"] = out["slowdown_vs_base"][key] <= 0.15
    line = json.dumps(out)
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
