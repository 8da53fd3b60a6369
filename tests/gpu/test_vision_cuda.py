"""Vision-language models on CUDA through the transformers backend: Qwen2-VL / Qwen2.5-VL decode
steps replay CUDA graphs (a decode row's M-RoPE position is index + rope_delta, the same on all
three sections) and generate what eager decoding and transformers' own generate do, with images
in the prompt and a text-only request in the same batch; Idefics3 (tiles) likewise.

Run on a GPU machine: `pytest -m gpu tests/gpu`. Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N = 8  # new tokens per request


def _generate(shard, ref, cases: dict[int, tuple[str, list[tuple[int, int, int]]]]
              ) -> tuple[dict[int, list[int]], list[str]]:
    """Every case in one batch through a RouterSim; the tokens per request and how each step
    ran (runner.last_path after every execute)."""
    from tests.shard.shard_driver import RouterSim, engine_call

    runner = shard.runner
    paths: list[str] = []
    execute = runner.execute

    def recording(step):  # type: ignore[no-untyped-def]
        out = execute(step)
        paths.append(runner.last_path)
        return out

    runner.execute = recording
    try:
        sim = RouterSim(engine_call(shard), runner.num_blocks, runner.block_size)
        for rid, (text, specs) in cases.items():
            enc = ref.inputs(text, specs)
            sim.add(rid, enc["input_ids"][0].tolist(), N, images=ref.shard_images(enc))
        sim.prefill([(rid, 0) for rid in cases])
        sim.run_to_completion()
    finally:
        runner.execute = execute
    return {rid: sim.done[rid].generated for rid in cases}, paths


def _check_graphs(model: Path, ref, cases: dict[int, tuple[str, list[tuple[int, int, int]]]]
                  ) -> None:
    """On one CUDA shard of `model`: decode steps replay graphs (the prefill, with images, runs
    eagerly), and graph decoding, eager decoding and transformers' generate (`ref`, CPU float32)
    give the same tokens for `cases` in one batch."""
    from tests.helpers.transformers_backend import backend_shard

    want = {rid: ref.greedy(text, specs, N) for rid, (text, specs) in cases.items()}
    shard = backend_shard(model, device="cuda", dtype="float32")
    assert shard.info.cuda_graphs and shard.runner.graphs is not None
    graphed, paths = _generate(shard, ref, cases)
    assert paths[0] == "eager" and set(paths[1:]) == {"decode_graph"}, paths

    shard.runner.graphs = None  # the same shard, decoding eagerly
    eager, eager_paths = _generate(shard, ref, cases)
    assert set(eager_paths) == {"eager"}
    assert graphed == eager
    assert graphed == want


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_decode_replays_graphs_and_equals_eager_and_transformers(
        tmp_path: Path, family: str) -> None:
    from shard.tools.tiny_vlm import QWEN_IMAGE, write_tiny_qwen2_vl
    from tests.helpers.vision import QwenReference

    model = write_tiny_qwen2_vl(tmp_path / family, family=family)
    ref = QwenReference(model)  # transformers on the CPU, float32
    cases = {
        1: (f"look {QWEN_IMAGE} and tell", [(0, 56, 56)]),
        2: (f"first {QWEN_IMAGE} then {QWEN_IMAGE} which", [(1, 84, 56), (2, 56, 56)]),
        3: ("only words here, no picture at all", []),
    }
    _check_graphs(model, ref, cases)


def test_idefics3_decode_replays_graphs_and_equals_eager_and_transformers(tmp_path: Path
                                                                          ) -> None:
    from shard.tools.tiny_vlm import write_tiny_idefics3
    from tests.helpers.vision import Idefics3Reference

    model = write_tiny_idefics3(tmp_path / "idefics3")
    ref = Idefics3Reference(model)  # transformers on the CPU, float32
    cases = {
        1: ("look <image> and tell", [(0, 40, 30)]),  # 5 tiles
        2: ("first <image> then <image> which", [(1, 80, 30), (2, 40, 30)]),  # 3 + 5 tiles
        3: ("only words here, no picture at all", []),
    }
    _check_graphs(model, ref, cases)
