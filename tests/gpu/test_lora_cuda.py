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


def _blockdiag(slots_n: int, sizes: list[int], rank: int, gen) -> torch.Tensor:
    b = torch.zeros(slots_n, sum(sizes), len(sizes) * rank, device="cuda")
    at = 0
    for p, size in enumerate(sizes):
        b[:, at : at + size, p * rank : (p + 1) * rank] = torch.randn(
            slots_n, size, rank, device="cuda", generator=gen) * 0.02
        at += size
    return b.bfloat16()


def _reference(x, a, b, slots, y0):
    idx = slots.clamp(min=0).long()
    delta = torch.bmm(b[idx].float(), torch.bmm(a[idx].float(), x.float()[:, :, None])).squeeze(2)
    return y0.float() + torch.where((slots >= 0)[:, None], delta, 0.0)


def test_kernels_bf16_match_torch():
    """Llama-3-8B shapes at rank 16, 4 slots, rows of 4 adapters and the base model: q/k/v
    (three parts), o, and gate/up with the fused SiLU-and-mul, against torch in fp32."""
    import torch.nn.functional as F

    from shard.kernels.lora import SILU_MAX_SPLITS, lora_expand_, lora_expand_silu_mul, lora_shrink

    gen = torch.Generator(device="cuda").manual_seed(0)
    slots_n, r, k, m = 4, 16, 4096, 64
    slots = torch.tensor([(i % 5) - 1 for i in range(m)], dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    for sizes in ([4096, 1024, 1024], [4096]):
        a = torch.randn(slots_n, len(sizes) * r, k, device="cuda", generator=gen) * 0.02
        a = a.bfloat16()
        b = _blockdiag(slots_n, sizes, r, gen)
        y0 = torch.randn(m, sum(sizes), device="cuda", generator=gen).bfloat16()
        y = y0.clone()
        lora_expand_(y, lora_shrink(x, a, slots, r), b, slots, sizes, r)
        ref = _reference(x, a, b, slots, y0)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err < 2**-6, (sizes, err)
        assert torch.equal(y[slots < 0], y0[slots < 0])
    inter = 14336
    a = (torch.randn(slots_n, 2 * r, k, device="cuda", generator=gen) * 0.02).bfloat16()
    b = _blockdiag(slots_n, [inter, inter], r, gen)
    y0 = torch.randn(m, 2 * inter, device="cuda", generator=gen).bfloat16()
    out = lora_expand_silu_mul(y0, lora_shrink(x, a, slots, r, SILU_MAX_SPLITS), b, slots, r)
    gu = _reference(x, a, b, slots, y0)
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    assert err < 2**-6, err
    from shard.kernels.elementwise import silu_mul

    # base rows: exactly what the base path's silu_mul gives them
    assert torch.equal(out[slots < 0], silu_mul(y0[:, :inter], y0[:, inter:])[slots < 0])


def test_kernels_in_cuda_graphs_follow_the_slot_buffer():
    """Captured once per bucket (after one eager call at the largest), the graphs replay with
    whatever the static slot buffer holds, bit-identical to eager calls (no atomics)."""
    from shard.kernels.lora import lora_expand_, lora_shrink

    gen = torch.Generator(device="cuda").manual_seed(1)
    slots_n, r, k, sizes = 4, 16, 4096, [4096, 1024, 1024]
    a = (torch.randn(slots_n, 3 * r, k, device="cuda", generator=gen) * 0.02).bfloat16()
    b = _blockdiag(slots_n, sizes, r, gen)
    x = torch.randn(64, k, device="cuda", generator=gen).bfloat16()
    y0 = torch.randn(64, sum(sizes), device="cuda", generator=gen).bfloat16()
    slot_buf = torch.zeros(64, dtype=torch.int32, device="cuda")

    def step(m: int) -> torch.Tensor:
        y = y0[:m].clone()
        lora_expand_(y, lora_shrink(x[:m], a, slot_buf[:m], r), b, slot_buf[:m], sizes, r)
        return y

    step(64)  # the warm-up's eager call compiles the one variant
    torch.cuda.synchronize()
    graphs, outs = {}, {}
    for m in (64, 17, 1):
        graphs[m] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[m]):
            outs[m] = step(m)
    for pattern in ([i % 4 for i in range(64)], [-1 if i % 2 else 3 for i in range(64)]):
        slot_buf.copy_(torch.tensor(pattern, dtype=torch.int32))
        for m, graph in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[m], step(m)), (pattern[:4], m)
            ref = _reference(x[:m], a, b, slot_buf[:m], y0[:m])
            assert float((outs[m].float() - ref).abs().max() / ref.abs().max()) < 2**-6


def _folded_linear(sizes: list[int], k: int, slots_n: int, r: int, gen):
    """A LoraWeights folded into a bf16 base weight [sum(sizes), k] with random adapters in
    every slot: (lora, wide weight, base weight view)."""
    from shard.layers.lora import LoraBatch, LoraPart, LoraWeights

    parts, at = [], 0
    for p, size in enumerate(sizes):
        parts.append(LoraPart(f"p{p}", k, size, (0, k), (0, size), at))
        at += size
    lora = LoraWeights(parts, LoraBatch(slots_n), r, torch.device("cuda"), torch.bfloat16)
    base = (torch.randn(at, k, device="cuda", generator=gen) * 0.02).bfloat16()
    wide = lora.fold_into(base)
    assert wide is not None
    for s in range(slots_n):
        lora.write_slot(s, [(
            (torch.randn(r, k, device="cuda", generator=gen) * 0.02).bfloat16(),
            (torch.randn(size, r, device="cuda", generator=gen) * 0.02).bfloat16(),
        ) for size in sizes])  # fmt: skip
    return lora, wide, wide[:at]


def test_folded_kernels_bf16_match_torch_in_graphs():
    """The folded path (every slot's A in extra rows of the base weight, cuBLAS computing h):
    q/k/v, o and gate/up + SiLU-and-mul at Llama-3-8B shapes, rank 16, 4 slots, rows of 4
    adapters and the base model, eager and replayed from CUDA graphs captured per bucket after
    one eager call (one compiled variant), against torch in fp32; base rows equal the base GEMM
    output exactly (and silu_mul's result for gate/up)."""
    import torch.nn.functional as F

    from shard.kernels.elementwise import silu_mul
    from shard.kernels.lora import lora_expand_folded, lora_expand_folded_silu_mul

    gen = torch.Generator(device="cuda").manual_seed(2)
    slots_n, r, k = 4, 16, 4096
    x = torch.randn(64, k, device="cuda", generator=gen).bfloat16()
    slot_buf = torch.zeros(64, dtype=torch.int32, device="cuda")
    for sizes in ([4096, 1024, 1024], [4096], [14336, 14336]):
        lora, wide, base = _folded_linear(sizes, k, slots_n, r, gen)
        n = sum(sizes)
        b = lora.b[:slots_n]

        def step(m: int, lora=lora, wide=wide, n=n, b=b, sizes=sizes) -> torch.Tensor:
            y_wide = F.linear(x[:m], wide)
            if len(sizes) == 2:
                return lora_expand_folded_silu_mul(y_wide, n, b, slot_buf[:m], r)
            return lora_expand_folded(y_wide, n, b, slot_buf[:m], sizes, r)

        step(64)
        torch.cuda.synchronize()
        graphs, outs = {}, {}
        for m in (64, 17, 1):
            graphs[m] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[m]):
                outs[m] = step(m)
        for pattern in ([(i % 5) - 1 for i in range(64)], [i % 4 for i in range(64)]):
            slot_buf.copy_(torch.tensor(pattern, dtype=torch.int32))
            for m, graph in graphs.items():
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(outs[m], step(m)), (sizes, pattern[:4], m)
            slots = slot_buf
            a_full = lora.a.float()[slots.clamp(min=0).long()]  # [64, PR, k]
            b_full = b.float()[slots.clamp(min=0).long()]
            h = torch.bmm(a_full, x.float()[:, :, None]).bfloat16().float()
            delta = torch.bmm(b_full, h).squeeze(2)
            y = F.linear(x, base).float() + torch.where((slots >= 0)[:, None], delta, 0.0)
            got, base_rows = outs[64].float(), slots < 0
            if len(sizes) == 2:
                ref = F.silu(y[:, : sizes[0]]) * y[:, sizes[0] :]
                plain = silu_mul(*F.linear(x, base).split(sizes, dim=-1))
            else:
                ref, plain = y, F.linear(x, base)
            err = float((got - ref).abs().max() / ref.abs().max())
            assert err < 2**-6, (sizes, err)
            if base_rows.any():  # the wide GEMM's base columns may round like the plain one's
                assert float((outs[64][base_rows].float() - plain[base_rows].float()).abs()
                             .max() / plain.float().abs().max()) < 2**-7, sizes
