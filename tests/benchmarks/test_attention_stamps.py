"""benchmarks/attention_stamps.layer_phases on hand-built stamps: a layer's phases, hop and
period come out of the right stamp points (the GPU run only fills the array)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.attention_stamps import layer_phases


def _split_layers(layers: int, programs: int) -> np.ndarray:
    """Every layer 10 us after the last: programs start 2 us before the previous layer's end,
    return from the wait 1 us after it (the first) .. +0.1 us each; q 0.5, attend 0.3, store 0.2,
    ticket 1.0; the last program merges in 0.8 (so ends last)."""
    s = np.zeros((layers, programs, 8), dtype=np.int64)
    end = 100 * (programs - 1) + 2_800  # ns after a layer's first return from the wait
    for i in range(layers):
        base = 10_000 * i  # ns: this layer's first return from the wait
        for p in range(programs):
            t1 = base + 100 * p
            s[i, p, 0] = base - (10_000 - end) - 2_000 + p  # previous layer's end - 2 us
            s[i, p, 1] = t1
            s[i, p, 2] = t1 + 500
            s[i, p, 3] = t1 + 800
            s[i, p, 4] = t1 + 1_000
            s[i, p, 5] = t1 + 2_000
            if p == programs - 1:
                s[i, p, 6] = t1 + 2_800
    return s


def test_split_phases_hop_and_period() -> None:
    programs = 4
    r = layer_phases(_split_layers(6, programs))
    end = 100 * (programs - 1) + 2_800  # ns after the layer's release
    assert r["period"] == pytest.approx(10.0)
    assert r["span"] == pytest.approx(end / 1e3)
    assert r["hop"] == pytest.approx((10_000 - end) / 1e3)
    assert r["early"] == pytest.approx(2.0)
    assert (r["q"], r["attend"], r["store"], r["ticket"]) == pytest.approx((0.5, 0.3, 0.2, 1.0))
    assert r["merge"] == pytest.approx(0.8)  # the merging program only
    assert r["lag"] == pytest.approx(0.1 * (programs - 1) / 2)
    assert r["critical lag"] == pytest.approx(0.1 * (programs - 1))
    assert r["critical merge"] == pytest.approx(0.8)


def test_one_split_ends_at_the_output_store() -> None:
    s = _split_layers(5, 2)
    s[:, :, 4:7] = 0
    s[:, :, 7] = s[:, :, 3] + 400  # output stored 0.4 us after the tiles
    r = layer_phases(s)
    assert r["store"] == pytest.approx(0.4)
    assert "ticket" not in r and "merge" not in r
    assert r["span"] == pytest.approx((100 + 800 + 400) / 1e3)


def test_an_earlier_replays_merge_stamp_is_ignored() -> None:
    """The buffer outlives replays: a program that merged in an earlier replay but not in the
    last keeps an older stamp 6, which is not this replay's merge."""
    s = _split_layers(6, 4)
    s[:, 0, 6] = s[:, 0, 5] - 1_500  # program 0 merged a replay ago (> 0 from layer 1)
    r = layer_phases(s)
    assert r["merge"] == pytest.approx(0.8)
    assert r["span"] == pytest.approx((300 + 2_800) / 1e3)
