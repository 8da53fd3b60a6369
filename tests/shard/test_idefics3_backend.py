"""Idefics3 (SmolVLM v1's architecture) through the router's image pipeline and a real shard
(gRPC, transformers backend): a tiny random Idefics3 (shard/tools/tiny_vlm.py) with
transformers' own Idefics3Processor, which splits each image into 56x56 tiles (crops plus the
whole image) and writes tile tags around each tile's 4 image tokens. The router's expansion is
the processor's, token for token; each tile is an image input of its own; greedy tokens and
log-probabilities equal transformers' generate with one and two images (of different tile
grids), a text-only request in the same batches, prefill chunks cutting through tiles, and a
repeated image served from the encoder cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.engine.backend import WarmupBudgets
from service.engine.contracts import SamplingConfig, StoppingConfig, ValidatedRequest
from service.generation.images.pipeline import ImagePipeline
from service.generation.images.refs import ImageError, ImageLimits, ImageRef
from tests.helpers.spec_engine import ShardServer, router_engine, token_ids
from tests.helpers.vision import Idefics3Reference, encoded, tiny_idefics3

N = 6  # new tokens per request
BUDGETS = WarmupBudgets(max_input_tokens=160, max_total_tokens=192,
                        max_batch_prefill_tokens=160, max_batch_size=8)
# Steps of at most 16 prefill tokens: chunks end inside tiles' runs of image tokens.
STEP_TOKENS = 16
# Images as (seed, width, height): 40x30 is resized to 112x84, tiled 2x2 + the global image
# (5 tiles, 20 image tokens, 34 tokens with the tags); 80x30 to 112x42, tiled 1x2 + global (3).
WIDE = (1, 80, 30)
ONE = ("see <image> and say what you see", [(0, 40, 30)])
TWO = ("first <image> then <image> which one", [WIDE, (2, 40, 30)])
TEXT = ("no picture here, only words and more words", [])
REPEAT = ("a <image> b <image> c", [WIDE, WIDE])


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory) -> Path:
    return tiny_idefics3(tmp_path_factory)


@pytest.fixture(scope="module")
def ref(idefics3: Path) -> Idefics3Reference:
    return Idefics3Reference(idefics3)


def _refs(specs: list[tuple[int, int, int]]) -> tuple[ImageRef, ...]:
    return tuple(ImageRef(f"images[{i}]", data=encoded(s, width=w, height=h))
                 for i, (s, w, h) in enumerate(specs))


async def test_greedy_with_images_matches_transformers(idefics3, ref, tmp_path):
    import asyncio

    pipeline = ImagePipeline.load(idefics3, ImageLimits())
    assert pipeline is not None and pipeline.image_token == "<image>"
    server = ShardServer(idefics3, tmp_path, kv_cache_memory_mb=2, model_impl="transformers")
    cache = server.shard.runner.encoder_cache
    other = (ONE[0], [(5, 40, 30)])  # ONE's text, another image: no prefix-cache hit on ONE
    cases = {"one": ONE, "two": TWO, "text": TEXT, "other": other, "again": ONE,
             "repeat": REPEAT}
    want = {name: ref.greedy_logprobs(text, specs, N) for name, (text, specs) in cases.items()}
    got: dict[str, list[int]] = {}
    try:
        async with router_engine(server.url, BUDGETS, 0,
                                 max_batch_prefill_tokens=STEP_TOKENS) as engine:

            async def run(name: str) -> None:
                text, specs = cases[name]
                ids = tuple(ref.processor.tokenizer(text).input_ids)  # one <image> per image
                ids, images = await pipeline.prepare(_refs(specs), ids, "inputs")
                # The expansion is transformers' own: the processor's ids, token for token.
                assert list(ids) == ref.inputs(text, specs)["input_ids"][0].tolist()
                # one image input per tile, at its run of 4 image tokens
                assert all(i.shape == (3, 56, 56) and i.length == 4 for i in images)
                req = ValidatedRequest(request_id=name, input_ids=ids, sampling=SamplingConfig(),
                                       stopping=StoppingConfig(max_new_tokens=N,
                                                               ignore_eos_token=True),
                                       images=images)
                events = [ev async for ev in engine.submit(req)]
                got[name] = token_ids(events)
                assert got[name] == want[name][0], name
                # a tile's rows in the wrong place shows in the log-probabilities first
                assert [e.token.logprob for e in events] == pytest.approx(want[name][1],
                                                                         abs=2e-4), name

            # One batch: one image, two images and text only; each equals its reference alone.
            await asyncio.gather(run("one"), run("two"), run("text"))
            assert cache.misses == 5 + 3 + 5  # every tile encoded once across the chunks
            await run("other")  # its tiles' hashes key its blocks: ONE's K/V is not reused
            await run("again")  # prefix-cache and encoder-cache hit
            hits = cache.hits
            await run("repeat")  # the wide image twice, already encoded for "two"
            assert cache.misses == 18 and cache.hits >= hits + 2 * 3
    finally:
        server.stop()
        pipeline.close()
    assert want["one"][0] != want["other"][0]  # the image moves the output


async def test_the_pipeline_tiles_and_refuses_over_limit_images(idefics3):
    """Limits apply to the images a request names (not to their tiles); placeholders must
    match the images; the tiles of one image sit at their runs of image tokens."""
    pipeline = ImagePipeline.load(idefics3, ImageLimits(max_images=2, max_pixels=80 * 30))
    assert pipeline is not None
    tok = pipeline.encoder.tokenizer
    one = tuple(tok("a <image> b").input_ids)
    cases = [
        ((ImageRef("x[0]", data=encoded(0)),) * 3, one, "inputs: 3 images; at most 2 per request"),
        ((ImageRef("x[0]", data=encoded(0, width=81)),), one, "81x30 = 2430 pixels; at most 2400"),
        ((ImageRef("x[0]", data=encoded(0)),) * 2, one, "1 image placeholders .* for 2 images"),
    ]
    try:
        for refs, ids, says in cases:
            with pytest.raises(ImageError, match=says):
                await pipeline.prepare(refs, ids, "inputs")
        ids, images = await pipeline.prepare((ImageRef("x[0]", data=encoded(1, width=80)),),
                                             one, "inputs")
        # <s> a space, then <fake><row_1_col_1> 4x<image> <fake><row_1_col_2> 4x<image> \n \n
        # <fake><global-img> 4x<image> <fake>
        assert [(i.offset, i.length) for i in images] == [(5, 4), (11, 4), (19, 4)]
        assert all(ids[i.offset : i.offset + 4] == (pipeline.image_token_id,) * 4 for i in images)
        assert len({i.content_hash for i in images}) == 3  # each tile its own cache key
    finally:
        pipeline.close()


def test_the_shard_refuses_a_tile_it_cannot_place_and_serves_on(idefics3, ref):
    """A tile of the wrong size, or with a placeholder count other than the tower's, is
    INVALID_ARGUMENT before any state changes; the next request is served."""
    import numpy as np
    from shard_driver import RouterSim, engine_call
    from tokenwire.shard.v1 import shard_pb2 as pb

    from shard.errors import InvalidRequestError
    from tests.helpers.transformers_backend import backend_shard

    shard = backend_shard(idefics3)
    image_id = ref.processor.image_token_id
    prompt = [1, 5, *[image_id] * 4, 7, 8]
    # (not all zeros: transformers takes an all-zero tile for padding and drops it)
    pixels = np.full((3, 56, 56), 0.5, dtype=np.float32).tobytes()
    good = pb.ImageInput(content_hash=b"t" * 32, offset=2, length=4, shape=[3, 56, 56],
                         pixel_values=pixels)
    for says, change in {
        "has 5 placeholder tokens; the model's encoder takes 4 for it": {"length": 5},
        "the model's encoder takes no such shape": {"shape": [3, 28, 28]},
    }.items():
        image = pb.ImageInput()
        image.CopyFrom(good)
        if "shape" in change:
            del image.shape[:]
            image.shape.extend(change["shape"])
            image.pixel_values = bytes(4 * 3 * 28 * 28)
        else:
            image.length = change["length"]
        sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
        sim.add(1, prompt, 2, images=[image])
        with pytest.raises(InvalidRequestError, match=says):
            sim.prefill([(1, 0)])
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(2, prompt, 2, images=[good])
    sim.prefill([(2, 0)])
    sim.run_to_completion()
    assert len(sim.done[2].generated) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)  # two processes importing transformers on a shared host
async def test_two_ranks_with_images_match_transformers(idefics3, ref):
    """The language model split over two gloo ranks (the vision tower and connector on each),
    two images (8 tiles) in the prompt: what transformers generates, fewer weights per rank."""
    from shard.testing.ranks import run_ranks
    from tests.helpers.transformers_backend import backend_shard, held_weights
    from tests.helpers.vision import vision_rank

    text, specs = TWO
    pipeline = ImagePipeline.load(idefics3, ImageLimits())
    assert pipeline is not None
    ids, images = await pipeline.prepare(_refs(specs), tuple(ref.processor.tokenizer(text)
                                                             .input_ids), "inputs")
    pipeline.close()
    job = {"device": "cpu", "dir": str(idefics3), "ids": list(ids), "steps": N,
           "images": [(i.content_hash, i.shape, i.pixel_values, i.offset, i.length)
                      for i in images]}
    res = run_ranks(2, job, vision_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    assert res["tokens"] == ref.greedy(text, specs, N)
    assert res["params"] < held_weights(backend_shard(idefics3))


async def test_a_step_with_more_tiles_than_the_encoder_cache_holds(idefics3, ref):
    """Two images are 8 tiles: with room for 2 in the encoder cache, one prefill step still
    places every tile it encoded (and a tile it found cached) and equals transformers."""
    from shard_driver import RouterSim, engine_call
    from tokenwire.shard.v1 import shard_pb2 as pb

    from tests.helpers.transformers_backend import backend_shard

    text, specs = TWO
    pipeline = ImagePipeline.load(idefics3, ImageLimits())
    assert pipeline is not None
    ids, images = await pipeline.prepare(_refs(specs), tuple(ref.processor.tokenizer(text)
                                                             .input_ids), "inputs")
    pipeline.close()
    shard = backend_shard(idefics3)
    cache = shard.runner.encoder_cache
    cache.capacity = 2
    want = ref.greedy(text, specs, N)
    for rid in (1, 2):  # the second time, the 2 tiles still cached are hits
        sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
        sim.add(rid, list(ids), N, images=[
            pb.ImageInput(content_hash=i.content_hash, offset=i.offset, length=i.length,
                          shape=list(i.shape), pixel_values=i.pixel_values) for i in images])
        sim.prefill([(rid, 0)])
        sim.run_to_completion()
        assert sim.done[rid].generated == want
    assert cache.hits == 2 and len(cache) == 2
