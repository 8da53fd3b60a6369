"""Images through the router's engine and a real shard (gRPC, transformers backend): a tiny
random LLaVA (CLIP tower + projector + Llama) greedy-decodes what transformers' generate does
with one and two images, chunked prefill cutting through image placeholders, a text-only request
in the same batches, a repeated image served from the encoder cache, and two prompts with the
same text but different images never sharing prefix-cache K/V."""

from __future__ import annotations

import pytest

from service.engine.backend import WarmupBudgets
from service.engine.contracts import SamplingConfig, StoppingConfig, ValidatedRequest
from service.generation.images.pipeline import ImagePipeline
from service.generation.images.refs import ImageError, ImageLimits, ImageRef
from tests.helpers.spec_engine import ShardServer, router_engine, token_ids
from tests.helpers.vision import HfReference, encoded, tiny_llava

N = 8  # new tokens per request
BUDGETS = WarmupBudgets(max_input_tokens=96, max_total_tokens=128, max_batch_prefill_tokens=96,
                        max_batch_size=8)
# Steps of at most 12 prefill tokens: images (4 placeholders each) straddle chunk boundaries.
STEP_TOKENS = 12
LONG = "the quick brown fox jumps over the lazy dog and keeps running far away " * 2
# The image's 4 placeholders sit at [62, 66): across the 16-token block boundary at 64, so a
# prefix-cache hit on this prompt ends inside the image (the shard embeds its last 2 rows only).
ONE = f"{LONG}see <image> and say what you see"
TWO = "first <image> then <image> which one is brighter"
TEXT = "no picture here, only words and more words"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return tiny_llava(tmp_path_factory)


async def _validated(pipeline: ImagePipeline, ref: HfReference, rid: str, text: str,
                     seeds: list[int]) -> ValidatedRequest:
    ids = tuple(ref.processor.tokenizer(text).input_ids)  # one image token per image
    refs = tuple(ImageRef(f"images[{i}]", data=encoded(s)) for i, s in enumerate(seeds))
    ids, images = await pipeline.prepare(refs, ids, "inputs")
    # The expansion is transformers' own: the processor's input ids, token for token.
    assert list(ids) == ref.inputs(text, seeds)["input_ids"][0].tolist()
    return ValidatedRequest(request_id=rid, input_ids=ids, sampling=SamplingConfig(),
                            stopping=StoppingConfig(max_new_tokens=N, ignore_eos_token=True),
                            images=images)


async def test_greedy_with_images_matches_transformers(llava, tmp_path):
    import asyncio

    ref = HfReference(llava)
    pipeline = ImagePipeline.load(llava, ImageLimits())
    assert pipeline is not None
    server = ShardServer(llava, tmp_path, kv_cache_memory_mb=2, model_impl="transformers")
    cache = server.shard.runner.encoder_cache
    cases = {"one": (ONE, [0]), "two": (TWO, [1, 2]), "text": (TEXT, []),
             "other": (ONE, [6]), "again": (ONE, [0]), "repeat": (TWO, [6, 6])}
    want = {name: ref.greedy_logprobs(text, seeds, N) for name, (text, seeds) in cases.items()}
    got: dict[str, list[int]] = {}
    try:
        async with router_engine(server.url, BUDGETS, 0,
                                 max_batch_prefill_tokens=STEP_TOKENS) as engine:

            async def run(name: str) -> None:
                text, seeds = cases[name]
                req = await _validated(pipeline, ref, name, text, seeds)
                events = [ev async for ev in engine.submit(req)]
                got[name] = token_ids(events)
                # Tokens equal; log-probabilities too (a wrong embedding row shows here even
                # where the argmax survives it).
                assert got[name] == want[name][0], name
                assert [e.token.logprob for e in events] == pytest.approx(want[name][1],
                                                                         abs=2e-4), name

            # One batch mixing one image, two images and text only.
            await asyncio.gather(run("one"), run("two"), run("text"))
            # Each image encoded once; an image cut by a chunk boundary is a hit the 2nd time.
            assert cache.misses == 3
            # Same text as "one", another image: its image blocks must not hit "one"'s K/V.
            await run("other")
            hits = cache.hits
            # "one" again: prefix-cache hit; and one image twice in a prompt (encoded once).
            await run("again")
            await run("repeat")
            assert cache.hits > hits
    finally:
        server.stop()
        pipeline.close()
    assert cache.misses == 4  # images 0, 1, 2, 6: each encoded once
    assert want["other"][0] != want["one"][0]  # the image changes the output


async def test_the_pipeline_refuses_bad_images_naming_them(llava):
    """The router's checks on the real processor: placeholders must match the images, formats
    and pixel counts are checked before decoding, corrupt data is a clear error."""
    pipeline = ImagePipeline.load(llava, ImageLimits(max_images=2, max_pixels=40 * 30))
    assert pipeline is not None
    tok = pipeline.encoder.tokenizer
    one = tuple(tok("a <image> b").input_ids)
    gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x00;"
    cases = [
        ((), one, r"inputs: the prompt has 1 image placeholders \('<image>'\) for 0 images"),
        ((ImageRef("x[0]", data=encoded(0)),) * 2, one, "for 2 images"),
        ((ImageRef("x[0]", data=encoded(0)),) * 3, one, "inputs: 3 images; at most 2 per request"),
        ((ImageRef("x[0]", data=gif),), one, "x\\[0\\]: unsupported image format GIF"),
        ((ImageRef("x[0]", data=encoded(0, width=41)),), one, "41x30 = 1230 pixels; at most 1200"),
        ((ImageRef("x[0]", data=encoded(0)[:200]),), one, "x\\[0\\]: the image could not be"),
        ((ImageRef("x[0]", data=b"\x89PNG nope"),), one, "x\\[0\\]: the image could not be"),
    ]
    try:
        for refs, ids, says in cases:
            with pytest.raises(ImageError, match=says):
                await pipeline.prepare(refs, ids, "inputs")
        ids, images = await pipeline.prepare((ImageRef("x[0]", data=encoded(0)),), one, "inputs")
        assert [(i.offset, i.length, i.shape) for i in images] == [(3, 4, (3, 28, 28))]
        assert ids.count(pipeline.image_token_id) == 4
    finally:
        pipeline.close()


def test_the_shard_refuses_images_it_cannot_place_and_serves_on(llava):
    """Images the shard cannot use (wrong placeholder count or pixel shape, outside the prompt,
    short pixel data) are INVALID_ARGUMENT before any state changes;
    the next request is served."""
    from shard_driver import RouterSim, engine_call
    from tokenwire.shard.v1 import shard_pb2 as pb

    from shard.errors import InvalidRequestError
    from tests.helpers.transformers_backend import backend_shard

    shard = backend_shard(llava)
    pixels = bytes(4 * 3 * 28 * 28)
    good = pb.ImageInput(content_hash=b"h" * 32, offset=2, length=4, shape=[3, 28, 28],
                         pixel_values=pixels)
    prompt = [1, 5, 512, 512, 512, 512, 7, 8]
    bad = {
        "has 5 placeholder tokens; the model's encoder takes 4 for it": {"length": 5},
        "has 4 placeholder tokens; the model's encoder takes no such shape":
            {"shape": [3, 14, 28], "pixel_values": bytes(4 * 3 * 14 * 28)},
        "outside len\\(input_ids\\)=8": {"offset": 5},
        "pixel_values has 12 bytes": {"pixel_values": bytes(12)},
    }
    for says, change in bad.items():
        image = pb.ImageInput()
        image.CopyFrom(good)
        for k, v in change.items():
            if k == "shape":
                del image.shape[:]
                image.shape.extend(v)
            else:
                setattr(image, k, v)
        sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
        sim.add(1, prompt, 2, images=[image])
        with pytest.raises(InvalidRequestError, match=says):
            sim.prefill([(1, 0)])
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    sim.add(2, prompt, 2, images=[good])
    sim.prefill([(2, 0)])
    sim.run_to_completion()
    assert len(sim.done[2].generated) == 2


# LLaVA's template on the hub (llava-hf): images first, from the parts' types, then the text.
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ c['text'] }}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


async def test_chat_templates_place_images_their_own_way(llava, tmp_path):
    """A template that renders image parts gets the content as parts (it writes the image
    token itself); any other gets the image token in the text at the image's place."""
    from service.generation.chat_template import ChatTemplate
    from service.generation.openai import ChatMessage

    refs = ((2, ImageRef("messages[0].content[1].image_url", url="u")),)
    messages = (ChatMessage("user", "hi there", images=refs),
                ChatMessage("assistant", "ok"))
    image_id = 512
    chatml = ChatTemplate(llava)  # the tiny model's ChatML knows no image parts
    prompt, ids = await chatml.render(messages, (), "<image>")
    assert prompt.startswith("<|im_start|>user\nhi<image> there<|im_end|>")
    assert ids.count(image_id) == 1
    path = tmp_path / "llava.jinja"
    path.write_text(LLAVA_HF_TEMPLATE)
    hub = ChatTemplate(llava, path)
    prompt, ids = await hub.render(messages, (), "<image>")
    assert prompt == "USER: <image>\nhi thereASSISTANT: okASSISTANT:"  # trim_blocks, as HF
    assert ids.count(image_id) == 1
    chatml.close()
    hub.close()


@pytest.mark.slow
@pytest.mark.timeout(600)  # two processes importing transformers on a shared host
async def test_two_ranks_with_an_image_match_transformers(llava):
    """The language model split over two gloo ranks (each with the whole vision tower) with an
    image in the prompt generates what transformers does, holding fewer weights per rank."""
    from shard.testing.ranks import run_ranks
    from tests.helpers.transformers_backend import backend_shard, held_weights
    from tests.helpers.vision import vision_rank

    ref = HfReference(llava)
    pipeline = ImagePipeline.load(llava, ImageLimits())
    assert pipeline is not None
    ids = tuple(ref.processor.tokenizer(TWO).input_ids)
    refs = tuple(ImageRef(f"images[{i}]", data=encoded(s)) for i, s in enumerate([1, 2]))
    ids, images = await pipeline.prepare(refs, ids, "inputs")
    pipeline.close()
    job = {"device": "cpu", "dir": str(llava), "ids": list(ids), "steps": N,
           "images": [(i.content_hash, i.shape, i.pixel_values, i.offset, i.length)
                      for i in images]}
    res = run_ranks(2, job, vision_rank, timeout_s=500)
    assert "error" not in res, res.get("error")
    assert res["tokens"] == ref.greedy(TWO, [1, 2], N)
    assert res["params"] < held_weights(backend_shard(llava))
