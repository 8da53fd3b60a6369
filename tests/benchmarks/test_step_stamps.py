"""benchmarks/harness/stamps.py on hand-built stamp rows: a launch's span, lag and per-point
steps, stale stamps of an earlier replay ignored, and gap / early against the launch before."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.harness.stamps import launch_phases, step_phases

POINTS = ("start", "after the PDL wait", "ids in", "stored")


def _launch(t0: int, programs: int = 3) -> np.ndarray:
    """Programs start at t0 + p ns, return from the wait at t0 + 2000 + 100 p, ids 300 later,
    stored 1000 after that (the last program 2000 after)."""
    rows = np.zeros((programs, 8), dtype=np.int64)
    for p in range(programs):
        wait = t0 + 2_000 + 100 * p
        rows[p, :4] = (t0 + p, wait, wait + 300, wait + 300 + (2_000 if p == programs - 1
                                                                 else 1_000))
    return rows


def test_launch_span_lag_and_steps() -> None:
    r = launch_phases(_launch(10_000), POINTS)
    assert r["release"] == pytest.approx(12.0)
    assert r["span"] == pytest.approx((200 + 300 + 2_000) / 1e3)
    assert r["critical"]["lag"] == pytest.approx(0.2)
    assert r["critical"]["ids in -> stored"] == pytest.approx(2.0)
    assert r["mean"]["after the PDL wait -> ids in"] == pytest.approx(0.3)
    assert r["mean"]["ids in -> stored"] == pytest.approx(4.0 / 3)


def test_stale_stamps_of_an_earlier_replay_are_ignored() -> None:
    rows = _launch(10_000)
    rows[2, 2:4] = (5_000, 9_000)  # the last program returned before "ids in" this time
    r = launch_phases(rows, POINTS)
    assert r["end"] == pytest.approx(max(rows[0, 3], rows[1, 3]) / 1e3)
    assert r["mean"]["ids in -> stored"] == pytest.approx(1.0)


def test_step_gap_and_early_against_the_launch_before() -> None:
    a, b = _launch(10_000), _launch(13_000)  # b starts 0.5 us before a's end (13.5 us)
    r = step_phases([("a", a, POINTS), ("b", b, POINTS), ("a", _launch(30_000), POINTS)])
    assert r["a"]["count"] == 2 and r["b"]["count"] == 1
    assert r["b"]["early"] == pytest.approx(14.5 - 13.0)
    assert r["b"]["gap"] == pytest.approx(15.0 - 14.5)
    assert r["a"]["gap"] == pytest.approx(32.0 - 17.5)  # only the second a has one
