"""Qwen2-VL / Qwen2.5-VL through the transformers backend on a real shard engine: tiny random
checkpoints (shard/tools/tiny_vlm.py) with transformers' own Qwen2-VL image processor (dynamic
resolution: the patch grid, image_grid_thw, follows each image's size). Greedy tokens equal
transformers' generate with one and two images of different sizes (3-D M-RoPE positions from
the model's get_rope_index, decode positions continuing at max position + 1), prefill chunks
cutting through an image, a text-only request in the same batch, and a repeated image served
from the encoder cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from shard_driver import RouterSim, engine_call
from tokenwire.shard.v1 import shard_pb2 as pb

from shard.tools.tiny_vlm import QWEN_IMAGE, write_tiny_qwen2_vl
from tests.helpers.transformers_backend import backend_shard
from tests.helpers.vision import QwenReference

N = 6  # new tokens per request
# (text, images as (seed, width, height)): a 56x56 image is a 4x4 patch grid (4 tokens),
# 84x56 a 4x6 grid (6 tokens): the placeholders and the 3-D positions differ per image.
ONE = (f"look {QWEN_IMAGE} and tell", [(0, 56, 56)])
TWO = (f"first {QWEN_IMAGE} then {QWEN_IMAGE} which", [(1, 84, 56), (2, 56, 56)])
SAME = (f"a {QWEN_IMAGE} b {QWEN_IMAGE} c", [(1, 84, 56), (1, 84, 56)])
TEXT = ("only words here, no picture at all", [])


class Reference(QwenReference):
    """QwenReference generating N tokens."""

    def greedy(self, text: str, specs: list[tuple[int, int, int]], n: int = N) -> list[int]:
        return super().greedy(text, specs, n)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory) -> Path:
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param) / "model",
                               family=request.param)


def test_greedy_with_images_matches_transformers(qwen: Path) -> None:
    ref = Reference(qwen)
    shard = backend_shard(qwen)
    cache = shard.runner.encoder_cache
    cases = {1: ONE, 2: TWO, 3: TEXT, 4: SAME}
    want = {rid: ref.greedy(*case) for rid, case in cases.items()}
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    for rid, (text, specs) in cases.items():
        enc = ref.inputs(text, specs)
        sim.add(rid, enc["input_ids"][0].tolist(), N, images=ref.shard_images(enc))
    # One batch: the one-image prompt in chunks of 3 (its 4 placeholders start at 3, so
    # chunks cut through the image), the two-image and the text-only prompts whole.
    sim.prefill([(1, 3), (2, 0), (3, 0)])
    while 1 in sim.requests and sim.requests[1].computed < len(sim.requests[1].prompt):
        sim.prefill([(1, 3)])
    sim.run_to_completion()
    assert cache.misses == 3  # three images, each encoded once across the chunks
    # The same image twice in a prompt, already encoded for request 2: all hits.
    sim.prefill([(4, 0)])
    sim.run_to_completion()
    assert cache.misses == 3
    got = {rid: sim.done[rid].generated for rid in cases}
    assert got == want
    assert want[1] != ref.greedy(ONE[0], [(5, 56, 56)])  # the image moves the output


def test_mrope_positions_continue_after_the_prompt(qwen: Path) -> None:
    """The shard's decode positions continue at max position + 1 (not at the token count):
    transformers' rope_deltas."""
    ref = Reference(qwen)
    shard = backend_shard(qwen)
    enc = ref.inputs(*TWO)
    ids = enc["input_ids"][0].tolist()
    images = ref.shard_images(enc)
    positions, delta = shard.runner.model.rope_positions(
        ids, [(i.offset, i.length, tuple(i.shape)) for i in images])
    assert positions.shape == (3, len(ids))
    assert delta == positions.max() + 1 - len(ids) < 0  # images take fewer positions than tokens


@pytest.mark.parametrize("speculate", [0, 3])
async def test_router_and_shard_over_grpc_match_transformers(qwen: Path, tmp_path: Path,
                                                             speculate: int) -> None:
    """The router's pipeline (the model's own image processor, placeholders expanded to its
    grid) and engine over gRPC to a shard: chunked prefill (steps of 8 prompt tokens) through
    the images, a text-only request in the same batches, then a prefix-cache hit on a prompt
    whose image sits before the hit's end (the shard's M-RoPE rows still place it). With
    speculate=3 the n-gram drafts are verified at index + delta as well."""
    import asyncio

    from service.engine.backend import WarmupBudgets
    from service.engine.contracts import SamplingConfig, StoppingConfig, ValidatedRequest
    from service.generation.images.pipeline import ImagePipeline
    from service.generation.images.refs import ImageLimits, ImageRef
    from tests.helpers.spec_engine import ShardServer, router_engine, token_ids
    from tests.helpers.vision import encoded

    ref = Reference(qwen)
    pipeline = ImagePipeline.load(qwen, ImageLimits())
    assert pipeline is not None and pipeline.image_token == "<|image_pad|>"
    # what the router writes for an image (TGI markdown, gRPC chunks, plain chat templates)
    assert pipeline.image_text == QWEN_IMAGE
    # the image in the first KV block, a long text after it: "again" hits past the image
    long = (ONE[0] + " the quick brown fox jumps over the lazy dog" * 3, ONE[1])
    cases = {"one": ONE, "two": TWO, "text": TEXT, "long": long, "again": long}
    want = {name: ref.greedy(*case) for name, case in cases.items()}
    budgets = WarmupBudgets(max_input_tokens=96, max_total_tokens=128,
                            max_batch_prefill_tokens=96, max_batch_size=8)
    server = ShardServer(qwen, tmp_path, kv_cache_memory_mb=2, model_impl="transformers")
    got: dict[str, list[int]] = {}
    try:
        async with router_engine(server.url, budgets, speculate,
                                 max_batch_prefill_tokens=8) as engine:

            async def run(name: str) -> None:
                text, specs = cases[name]
                ids = tuple(ref.tok(text).input_ids)
                refs = tuple(ImageRef(f"images[{i}]", data=encoded(s, width=w, height=h))
                             for i, (s, w, h) in enumerate(specs))
                ids, images = await pipeline.prepare(refs, ids, "inputs")
                # the expansion is the processor's: the reference prompt, token for token
                assert list(ids) == ref.inputs(text, specs)["input_ids"][0].tolist()
                req = ValidatedRequest(request_id=name, input_ids=ids, sampling=SamplingConfig(),
                                       stopping=StoppingConfig(max_new_tokens=N,
                                                               ignore_eos_token=True),
                                       images=images)
                got[name] = token_ids([ev async for ev in engine.submit(req)])

            await asyncio.gather(run("one"), run("two"), run("text"), run("long"))
            await run("again")  # prefix-cache hit past the image
    finally:
        server.stop()
        pipeline.close()
    assert got == want


def test_images_out_of_order_or_touching_are_refused_and_the_shard_serves_on(qwen: Path
                                                                            ) -> None:
    """M-RoPE places each image after the text before it: images out of prompt order, or with
    no token between them, are INVALID_ARGUMENT before any state changes; the next request
    is served."""
    from shard.errors import InvalidRequestError

    ref = Reference(qwen)
    shard = backend_shard(qwen)
    enc = ref.inputs(*TWO)
    ids = enc["input_ids"][0].tolist()
    first, second = ref.shard_images(enc)
    touching = pb.ImageInput()
    touching.CopyFrom(second)
    touching.offset = first.offset + first.length
    for images in ([second, first], [first, touching]):
        sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
        sim.add(1, ids, N, images=images)
        with pytest.raises(InvalidRequestError, match="images must be in prompt order"):
            sim.prefill([(1, 0)])
    assert not shard.engine.requests  # nothing admitted
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(2, ids, N, images=[first, second])
    sim.prefill([(2, 0)])
    sim.run_to_completion()
    assert sim.done[2].generated == ref.greedy(*TWO)


@pytest.mark.slow
@pytest.mark.timeout(600)  # two processes importing transformers on a shared host
def test_two_ranks_with_images_match_transformers(tmp_path: Path) -> None:
    """The language model split over two gloo ranks (the vision tower on each), two images in
    the prompt, M-RoPE positions: what transformers generates, fewer weights per rank
    (Qwen2-VL; Qwen2.5-VL's language model is the same code)."""
    from shard.testing.ranks import run_ranks
    from tests.helpers.transformers_backend import held_weights
    from tests.helpers.vision import vision_rank

    qwen = write_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    ref = Reference(qwen)
    enc = ref.inputs(*TWO)
    images = ref.shard_images(enc)
    job = {"device": "cpu", "dir": str(qwen), "ids": enc["input_ids"][0].tolist(), "steps": N,
           "images": [(i.content_hash, tuple(i.shape), i.pixel_values, i.offset, i.length)
                      for i in images]}
    res = run_ranks(2, job, vision_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    assert res["tokens"] == ref.greedy(*TWO)
    assert res["params"] < held_weights(backend_shard(qwen))


def test_a_preempted_request_recomputes_to_the_same_tokens(qwen: Path) -> None:
    """After a preemption the router sends the prompt plus the tokens generated so far
    (generated_len): the shard's M-RoPE rows cover them as text after the prompt, at the
    positions decode gave them, so the rest of the output is unchanged."""
    ref = Reference(qwen)
    shard = backend_shard(qwen)
    enc = ref.inputs(*TWO)
    ids = enc["input_ids"][0].tolist()
    want = ref.greedy(*TWO)
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(1, ids + want[:3], N, images=ref.shard_images(enc), generated_len=3)
    sim.prefill([(1, 5)])  # a first chunk, then the rest
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    assert sim.done[1].generated == want[3:]
