"""LoRA adapters in one shard (convert + engine, no gRPC): adapters written by `peft` for a tiny
model give the same greedy tokens as transformers + PeftModel (unmerged), alone and mixed with
the base model and each other in one batch, through LRU swaps when there are fewer device slots
than adapters; bad adapters fail to load with a message naming the problem and leave nothing
registered."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from reference import prompts
from shard_driver import RouterSim, engine_call

from shard.lora import AdapterLoadError, AdapterSource
from tests.helpers.lora import load_base, peft_greedy, write_adapter
from tests.helpers.models import tiny_model
from tests.helpers.shards import make_shard

N = 12
# name -> write_adapter options: every target at rank 4; q/v only at rank 8 (the limit); the
# MLP only with rsLoRA scaling at rank 2.
ADAPTERS = {
    "all4": dict(r=4, alpha=8.0, seed=1),
    "qv8": dict(r=8, alpha=16.0, targets=("q_proj", "v_proj"), seed=2, std=0.3),
    "mlp2": dict(r=2, alpha=4.0, targets=("gate_proj", "up_proj", "down_proj"), seed=3,
                 use_rslora=True, std=0.3),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = load_base(model_dir)
    return {name: write_adapter(model_dir, root / name, base=base, **kw)
            for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def reference(model_dir, adapters) -> dict[str, list[int]]:
    """transformers + peft greedy tokens per adapter ("" = base) for the test prompt."""
    prompt = prompts(model_dir, [11])[0]
    base = load_base(model_dir)
    out = {"": peft_greedy(model_dir, None, prompt, N, base=base)}
    for name, path in adapters.items():
        out[name] = peft_greedy(model_dir, path, prompt, N, base=base)
    return out


def _load(shard, name: str, path: Path) -> None:
    shard.register_adapter(shard.read_adapter(AdapterSource(name, str(path))))


def _run(shard, model_dir, names: list[str]) -> dict[str, list[int]]:
    """One batch of requests (one per name, "" = base) with the same prompt, run to the end."""
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    prompt = prompts(model_dir, [11])[0]
    for i, name in enumerate(names):
        sim.add(i + 1, prompt, N, adapter=name)
    sim.prefill([(i + 1, 0) for i in range(len(names))])
    sim.run_to_completion()
    return {name: sim.done[i + 1].generated for i, name in enumerate(names)}


def test_adapters_change_the_output(reference):
    # The test can fail: every adapter's greedy tokens differ from the base model's.
    for name in ADAPTERS:
        assert reference[name] != reference[""], name


def test_mixed_batch_equals_peft(model_dir, adapters, reference):
    shard = make_shard(model_dir, max_loras=4, max_lora_rank=8)
    for name, path in adapters.items():
        _load(shard, name, path)
    names = ["", "all4", "qv8", "mlp2"]
    mixed = _run(shard, model_dir, names)
    assert mixed == {n: reference[n] for n in names}
    for name in names:  # each alone equals its share of the mixed batch
        assert _run(shard, model_dir, [name])[name] == reference[name]
    facts = {f.name: f for f in shard.adapters()}
    assert facts["qv8"].rank == 8 and facts["qv8"].target_modules == ("q_proj", "v_proj")
    # every adapted linear of this (float32, unquantized) model carries its slots' A as extra
    # rows of its weight: the path above was the folded one
    assert shard.lora is not None
    assert all(w.folded is not None for w in shard.lora.layers), "not folded"


def test_lru_swaps_with_fewer_slots_than_adapters(model_dir, adapters, reference):
    shard = make_shard(model_dir, max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        _load(shard, name, path)
    order = ["all4", "qv8", "mlp2", "all4", "", "qv8"]
    for name in order:
        assert _run(shard, model_dir, [name])[name] == reference[name], name
    assert shard.lora is not None and shard.lora.swap_ins >= 4
    assert len(shard.lora.resident) == 2
    # Two adapters at once in two slots; unloading frees a slot for the third.
    assert _run(shard, model_dir, ["mlp2", "all4"]) == {
        "mlp2": reference["mlp2"], "all4": reference["all4"]}
    shard.unload_adapter("mlp2")
    assert "mlp2" not in shard.lora.adapters and "mlp2" not in shard.lora.resident


def _expect_error(shard, path: Path | str, *needles: str, name: str = "bad") -> None:
    with pytest.raises(AdapterLoadError) as info:
        shard.register_adapter(shard.read_adapter(AdapterSource(name, str(path))))
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert shard.adapters() == [] or all(f.name != name for f in shard.adapters())


def test_bad_adapters_fail_clearly(model_dir, adapters, tmp_path):
    shard = make_shard(model_dir, max_loras=2, max_lora_rank=4)
    # Rank above --max-lora-rank.
    _expect_error(shard, adapters["qv8"], "rank 8 exceeds --max-lora-rank 4")
    # Wrong base: an adapter written with peft for a model of another MLP width.
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    config.intermediate_size = 96
    other_base = transformers.AutoModelForCausalLM.from_config(config)
    wrong = write_adapter(model_dir, tmp_path / "wrong", r=2, base=other_base)
    _expect_error(shard, wrong, "has shape [2, 96]", "the base model needs [2, 128]", "down_proj")
    # Missing files.
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_error(shard, empty, "no adapter_config.json")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(adapters["all4"] / "adapter_config.json", no_weights)
    _expect_error(shard, no_weights, "no adapter_model.safetensors")
    _expect_error(shard, str(tmp_path / "nowhere"), "not found")
    # Unsupported target modules (peft adapts lm_head too).
    head = write_adapter(model_dir, tmp_path / "head", r=2, targets=("q_proj", "lm_head"))
    _expect_error(shard, head, "target module 'lm_head'", "not supported")
    # DoRA is another method.
    dora = tmp_path / "dora"
    shutil.copytree(adapters["all4"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    _expect_error(shard, dora, "use_dora", "not supported")
    # Nothing was registered, and a good adapter still loads and serves.
    assert shard.adapters() == []
    _load(shard, "all4", adapters["all4"])
    assert [f.name for f in shard.adapters()] == ["all4"]


@pytest.mark.slow
def test_two_ranks_load_their_slices(model_dir, adapters, reference, tmp_path):
    """`tokenwire shard --world-size 2` (two processes, gloo): each rank loads its slice of every
    adapter (column-parallel B rows, row-parallel A columns; one at start-up, two over the
    LoadAdapter RPC), both ranks answer alike and a mixed batch equals transformers + peft."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from tokenwire.shard.v1 import shard_pb2 as pb
    from tokenwire.shard.v1 import shard_pb2_grpc

    from tests.helpers.ports import free_port

    repo = Path(__file__).resolve().parents[2]
    prefix, port = str(tmp_path / "shard"), free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(repo), str(repo / "gen" / "python"), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "service.app.cli", "shard", "--model-id", str(model_dir),
             "--device", "cpu", "--rank", str(r), "--world-size", "2", "--uds-path", prefix,
             "--master-port", str(port), "--kv-cache-memory-mb", "1", "--log-level", "WARNING",
             "--max-loras", "3", "--max-lora-rank", "8",
             "--lora-adapters", f"all4={adapters['all4']}"],
            cwd=repo, env=env,
        )  # fmt: skip
        for r in range(2)
    ]
    channels = [grpc.insecure_channel(f"unix://{prefix}-{r}") for r in range(2)]
    pool = ThreadPoolExecutor(2)
    try:
        for ch in channels:
            grpc.channel_ready_future(ch).result(timeout=120)
        stubs = [shard_pb2_grpc.ShardServiceStub(ch) for ch in channels]

        def call(method, request):
            futures = [pool.submit(getattr(s, method), request, timeout=120) for s in stubs]
            answers = [f.result() for f in futures]
            if method in ("Prefill", "Decode"):
                for a in answers:
                    a.ClearField("timings")
            if method != "Warmup":
                assert all(a == answers[0] for a in answers[1:]), method
            return answers[0]

        info = call("Info", pb.InfoRequest())
        assert [a.name for a in info.adapters] == ["all4"] and info.max_loras == 3
        for name in ("qv8", "mlp2"):
            call("LoadAdapter", pb.LoadAdapterRequest(name=name, path=str(adapters[name])))
        warm = call("Warmup", pb.WarmupRequest(
            max_input_tokens=128, max_total_tokens=256, max_batch_prefill_tokens=256,
            max_batch_size=8, max_batch_total_tokens=2048))  # fmt: skip
        sim = RouterSim(call, warm.num_blocks, warm.block_size)
        prompt = prompts(model_dir, [11])[0]
        names = ["", "all4", "qv8", "mlp2"]
        for i, name in enumerate(names):
            sim.add(i + 1, prompt, N, adapter=name)
        sim.prefill([(i + 1, 0) for i in range(len(names))])
        sim.run_to_completion()
        for i, name in enumerate(names):
            assert sim.done[i + 1].generated == reference[name], name
        call("UnloadAdapter", pb.UnloadAdapterRequest(name="qv8"))
        assert [a.name for a in call("Info", pb.InfoRequest()).adapters] == ["all4", "mlp2"]
    finally:
        for ch in channels:
            ch.close()
        for p in procs:
            p.terminate()
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0]


def test_cpu_paths_agree():
    """The CPU application's two shapes (per-row gather + bmm for small steps, one matmul pair
    per adapter for large ones) equal a row-by-row reference; base rows are untouched."""
    import torch

    from shard.layers.lora import GATHER_MAX_ROWS, LoraBatch, LoraPart, LoraWeights

    gen = torch.Generator().manual_seed(0)
    batch = LoraBatch(3)
    w = LoraWeights([LoraPart("p", 32, 24, (0, 32), (0, 24), 0)], batch, 8,
                    torch.device("cpu"), torch.float32)
    w.a[:3] = torch.randn(3, 8, 32, generator=gen)
    w.b[:3] = torch.randn(3, 24, 8, generator=gen)
    for n in (5, GATHER_MAX_ROWS + 36):
        slots = [(i % 4) - 1 for i in range(n)]
        x, y0 = torch.randn(n, 32, generator=gen), torch.randn(n, 24, generator=gen)
        ref = y0.clone()
        for i, s in enumerate(slots):
            if s >= 0:
                ref[i] += w.b[s] @ (w.a[s] @ x[i])
        batch.set_rows(slots, torch.device("cpu"))
        assert (batch.gather is not None) == (n <= GATHER_MAX_ROWS)
        y = y0.clone()
        w.apply_(x, y)
        assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), n
        assert torch.equal(y[::4], y0[::4])  # slot -1 rows


def test_quantized_base_keeps_the_shrink_path(model_dir, adapters):
    """An fp8 base (weights that cannot carry 16-bit A rows): no linear is folded, the
    separate shrink + expand path serves, and a mixed batch equals each request run alone."""
    shard = make_shard(model_dir, max_loras=2, max_lora_rank=8, quantize="fp8")
    _load(shard, "all4", adapters["all4"])
    assert shard.lora is not None and shard.lora.layers
    assert all(w.folded is None for w in shard.lora.layers)
    mixed = _run(shard, model_dir, ["", "all4"])
    assert mixed["all4"] != mixed[""]
    for name in ("", "all4"):
        assert _run(shard, model_dir, [name])[name] == mixed[name], name
