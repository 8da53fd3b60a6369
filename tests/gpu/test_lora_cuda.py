"""LoRA on CUDA (Triton shrink/expand, the decode CUDA graphs captured with and without the
LoRA kernels) against the CPU path: a batch mixing the base model and 3 adapters gives the same
greedy tokens on both, and the kernels equal a torch reference in bf16.

Run on a GPU machine: `pytest -m gpu tests/gpu`. Without CUDA every test here is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]
N = 12


def _shard(model_dir: Path, device: str):
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="float32", device=device,
                              kv_cache_memory_mb=64 if device == "cpu" else None,
                              max_loras=4, max_lora_rank=8), Dist())
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=4096))
    return shard


def _run(shard, prompt: list[int], names: list[str]) -> dict[int, list[int]]:
    sys.path.insert(0, str(REPO / "tests" / "shard"))
    from shard_driver import RouterSim, engine_call

    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    for i, name in enumerate(names):
        sim.add(i + 1, prompt, N, adapter=name)
    sim.prefill([(i + 1, 0) for i in range(len(names))])
    sim.run_to_completion()
    return {i: sim.done[i + 1].generated for i in range(len(names))}


def test_mixed_batch_cuda_equals_cpu(tmp_path):
    from benchmarks.lora import write_adapter
    from shard.lora import AdapterSource
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", TinyModelSpec(arch="llama"))
    import json

    config = json.loads((model_dir / "config.json").read_text())
    adapters = {f"a{i}": write_adapter(tmp_path / f"a{i}", config, 4 + 2 * i, seed=i, std=0.2)
                for i in range(3)}
    prompt = list(range(5, 16))
    names = ["", "a0", "a1", "a2", "a0", ""]
    out = {}
    for device in ("cpu", "cuda"):
        shard = _shard(model_dir, device)
        for name, path in adapters.items():
            shard.register_adapter(shard.read_adapter(AdapterSource(name, str(path))))
        if device == "cuda":
            assert shard.runner.graphs is not None and shard.runner.graphs.lora_graphs
        out[device] = _run(shard, prompt, names)
        out[device + "-base"] = _run(shard, prompt, ["", ""])
    assert out["cuda"] == out["cpu"]
    assert out["cuda-base"] == out["cpu-base"]
    assert out["cpu"][1] != out["cpu"][0]  # the adapters change the output


def test_kernels_bf16_match_torch():
    from shard.kernels.lora import lora_expand_, lora_shrink

    gen = torch.Generator(device="cuda").manual_seed(0)
    slots_n, r, k, n, m = 4, 48, 4096, 6144, 64
    a = (torch.randn(slots_n + 1, r, k, device="cuda", generator=gen) * 0.02).bfloat16()
    b = (torch.randn(slots_n + 1, n, r, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    slots = torch.tensor([(i % 5) - 1 for i in range(m)], dtype=torch.int32, device="cuda")
    y0 = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    y = y0.clone()
    lora_expand_(y, lora_shrink(x, a, slots), b, slots)
    idx = slots.clamp(min=0).long()
    ref = y0.float() + torch.where(
        (slots >= 0)[:, None],
        torch.bmm(b[idx].float(), torch.bmm(a[idx].float(), x.float()[:, :, None])).squeeze(2),
        0.0,
    )
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err < 2**-6, err
    assert torch.equal(y[slots < 0], y0[slots < 0])
