"""The packed GGUF snapshot (every GGUF type kept packed, one dequantized) and the W8A8-int8
checkpoint split over two gloo ranks, in one pair of rank processes (each start-up costs
seconds): greedy tokens equal their float references' on one rank. Row-parallel slices of the
GGUF linears cut nothing (groups of 16 / 32 inside 128-feature halves); W8A8 ranks quantize
their own slice of each token (the trained model's choices are confident enough for exact
tokens)."""

from __future__ import annotations

from shard.distributed.groups import Dist
from shard.testing.ranks import run_ranks
from shard.testing.tiny import greedy_tokens, load_tiny
from tests.helpers.int_checkpoints import GREEDY_STEPS, short_greedy_rank


def test_two_gloo_ranks_generate_the_one_rank_float_tokens(gguf_llama, w8a8_checkpoint):
    models = {"gguf": (gguf_llama.packed, gguf_llama.plain), "w8a8": w8a8_checkpoint}
    dirs = {name: str(packed) for name, (packed, _) in models.items()}
    res = run_ranks(2, {"device": "cpu", "tiny_dirs": dirs}, short_greedy_rank, timeout_s=400)
    assert "error" not in res, res.get("error")
    for name, (_, plain) in models.items():
        want = greedy_tokens(load_tiny(plain, "cpu", Dist()), GREEDY_STEPS)
        assert res["tiny_tokens"][name] == want, name
