"""shard/kernels/int_tuning.py's tuned choices as the tuning cache stores them: a choice survives
its JSON round trip, and a stored choice that is no longer a candidate (candidate lists changed,
or a K tile that does not fit the weight's groups) is refused, so the cache retunes it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from shard.kernels import int_gemm, int_gemv
from shard.kernels.int_gemv import GemvConfig
from shard.kernels.int_tuning import IntTuning


def _tuning(group: int, k: int) -> IntTuning:
    return IntTuning(
        {b: int_gemv.candidates(b, group, k)[-1] for b in (1, 2, 4, 8, 16)},
        {b: int_gemm.candidates(b, group, k)[-1] for b in int_gemm.GEMM_M_BUCKETS},
    )


def test_round_trip() -> None:
    tuned = _tuning(128, 4096)
    raw = json.loads(json.dumps(tuned.encode()))
    assert IntTuning.decode(raw, group_size=128, in_features=4096) == tuned


def test_stale_or_misfit_choice_is_refused() -> None:
    raw = json.loads(json.dumps(_tuning(128, 4096).encode()))
    raw["gemv"]["1"]["block_n"] = 24  # no such candidate
    with pytest.raises(ValueError, match="batch 1"):
        IntTuning.decode(raw, group_size=128, in_features=4096)
    # 256-wide GEMV tiles hold several groups of 32 only when K is a multiple of 256
    misfit = json.loads(json.dumps(_tuning(32, 4096).encode()))
    misfit["gemv"]["1"] = int_gemv.GemvConfig(8, 256, 4, 3).as_dict()
    IntTuning.decode(misfit, group_size=32, in_features=4096)
    with pytest.raises(ValueError, match="not a candidate"):
        IntTuning.decode(misfit, group_size=32, in_features=4064)


def test_a_candidate_with_a_wrong_result_is_not_chosen() -> None:
    """The tuner checks each GEMV candidate's output before timing it (the lop3 tiles' unpack is
    inline PTX that no CPU test executes): a wrong one is never picked, however fast."""
    import math

    from shard.kernels.int_tuning import _fastest

    times = {"fast_but_wrong": 1.0, "right": 2.0}
    best, timings = _fastest(times.__getitem__, list(times),
                             check=lambda c: "max error 1" if c == "fast_but_wrong" else None)
    assert best == "right" and timings == {"fast_but_wrong": math.inf, "right": 2.0}


def test_tuner_reference_is_the_dequantized_weight() -> None:
    import torch

    from shard.kernels.int_tuning import IntWeightView, _dequantized
    from shard.quantization.int_weights import PackedInt, UnpackedInt

    for bits, group in ((4, 32), (8, 48), (4, 96)):  # equal groups (what the kernels serve)
        q = torch.randint(0, 2**bits, (6, 96), dtype=torch.uint8)
        groups = -(-96 // group)
        scales, zeros = torch.rand(6, groups).half(), torch.randint(0, 2**bits, (6, groups)).half()
        packed = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(96) // group, bits))
        view = IntWeightView(packed.qweight, packed.scales, packed.zeros, packed.group_size, bits,
                             True, None, None)
        assert torch.equal(_dequantized(view), packed.dequantize(torch.float32))


def test_multi_group_candidates_fit_the_bucket_and_groups() -> None:
    """The wide / diag tiles (int_gemv_wide.py) are offered where they apply: wide at batch 1
    only, diag while its x' has at most 32 MMA rows (bucket x groups per tile: BLOCK_K 256 up to
    16 rows, 512 up to 8), tiles of whole power-of-two groups >= 32 and no K tail; none for
    per-channel weights or a group that is not a power of two."""
    from shard.kernels.int_gemv_wide import MAX_DIAG_ROWS, diag_rows

    for bucket in (1, 2, 4, 8, 16):
        pool = int_gemv.candidates(bucket, 128, 4096)
        wide = [c for c in pool if c.wide]
        diag = [c for c in pool if c.diag]
        assert bool(wide) == (bucket == 1)
        # diag from 2 rows on: at batch 1 it ran 2-3x slower than wide (H100), so not timed
        assert bool(diag) == (bucket > 1)
        assert all(diag_rows(bucket, c.block_k, 128) <= MAX_DIAG_ROWS for c in diag)
        assert all(c.block_k % 128 == 0 and 4096 % c.block_k == 0 for c in wide + diag)
    assert {c.block_k for c in int_gemv.candidates(16, 128, 4096) if c.diag} == {256}
    assert any(c.block_k == 2048 for c in int_gemv.candidates(1, 128, 14336) if c.wide)
    # down_proj's K = 14336 is 7 x 2048; a K of 4096 + 128 fits no tile of several groups
    assert not any(c.wide or c.diag for c in int_gemv.candidates(1, 128, 4224))
    for group, k in ((4096, 4096), (96, 4608), (16, 4096)):  # per-channel, not pow2, < 32
        assert not any(c.wide or c.diag for c in int_gemv.candidates(1, group, k)), (group, k)
    # groups of 32 (GGUF-like): 8 groups in a 256-wide tile, so diag's x' has 32 rows at 4
    assert any(c.wide for c in int_gemv.candidates(1, 32, 4096))
    assert any(c.diag for c in int_gemv.candidates(2, 32, 4096))
    assert {c.block_k for c in int_gemv.candidates(4, 32, 4096) if c.diag} == {256}
    assert not any(c.diag for c in int_gemv.candidates(8, 32, 4096))


def test_batch_one_pool_is_pruned_and_keeps_its_fallbacks() -> None:
    """Batch 1's candidates (each compiled and timed at a linear's first start-up) were pruned
    from ~106 to what came within 15 % of the best on some Llama-3-8B linear (H100) plus the
    fallbacks: the untuned default (the first) is unchanged, the inline-PTX wide tiles are in,
    and shapes no wide tile serves still get word / join / halves tiles (per-channel, a K tail
    off the 256 grid, groups of 64 at BLOCK_K 128) or the halves / join tiles (K % 32 != 0)."""
    pool = int_gemv.candidates(1, 128, 4096)
    assert len(pool) <= 60, len(pool)
    assert pool[0] == GemvConfig(256, 128, 8, 3, 1, words=True)
    assert any(c.ptx for c in pool) and all(c.stages <= 1 and not c.persist
                                            for c in pool if c.ptx)
    assert not any(c.diag or (c.use_dot and not c.lop3) for c in pool)
    for group, k in ((4096, 4096), (128, 4224), (64, 4096), (32, 4128), (128, 4112)):
        fallback = [c for c in int_gemv.candidates(1, group, k) if not (c.wide or c.diag)]
        assert fallback, (group, k)
