"""benchmarks/harness/kernel_profile.py's critical-path attribution on made-up timelines: kernels
that overlap as programmatic dependent launches do, an idle gap, and kernels told apart by their
neighbours."""

from __future__ import annotations

import pytest

from benchmarks.harness.kernel_profile import exposed_by_kernel, label_by_neighbours


def test_overlapping_kernels_are_charged_what_they_add_after_their_predecessor() -> None:
    # a: 0-10; b starts early (PDL) at 6, ends 14: charged 4; c inside b (6-12): nothing;
    # idle 14-20; d 20-25: charged 5, whatever order the spans come in
    spans = [("d", 20.0, 25.0), ("b", 6.0, 14.0), ("a", 0.0, 10.0), ("c", 7.0, 12.0)]
    charged, idle = exposed_by_kernel(spans)
    assert charged == {"a": 10.0, "b": 4.0, "d": 5.0}
    assert idle == 6.0
    assert sum(charged.values()) + idle == 25.0  # the timeline, once


def test_same_kernel_twice_a_layer_is_told_apart_by_its_neighbours() -> None:
    spans = [("norm", 0, 1), ("gemv", 1, 5), ("attn", 5, 9), ("gemv", 9, 12), ("norm", 12, 13),
             ("gemv", 13, 14), ("route", 14, 16)]
    labelled = label_by_neighbours(spans, str.upper)
    names = [name for name, _, _ in labelled]
    assert names[1] == "NORM > GEMV > ATTN" and names[3] == "ATTN > GEMV > NORM"
    assert names[5] == "NORM > GEMV > ROUTE"
    assert names[0].startswith("^ > ") and names[-1].endswith(" > $")
    charged, _ = exposed_by_kernel(labelled)
    assert charged["ATTN > GEMV > NORM"] == pytest.approx(3.0)
