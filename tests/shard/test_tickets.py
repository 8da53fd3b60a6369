"""shard/kernels/tickets.py: the split-merge kernels' counters are allocated once, zeroed, grow
without moving the allocations graphs may hold, and report whether launches reset them."""

from __future__ import annotations

import torch

from shard.kernels.tickets import TicketCounters


def test_counters_grow_without_moving_and_report_resets() -> None:
    counters = TicketCounters("test", 8)
    cpu = torch.device("cpu")
    first = counters.take(cpu, 3)
    assert first.numel() == 8 and first.dtype == torch.int32 and not first.any()
    assert counters.take(cpu, 8).data_ptr() == first.data_ptr()  # the same allocation
    bigger = counters.take(cpu, 20)
    assert bigger.numel() == 20 and bigger.data_ptr() != first.data_ptr()
    assert counters.take(cpu, 5).data_ptr() == bigger.data_ptr()  # the newest serves from now
    assert counters.all_zero(cpu)
    first[2] = 1  # an older allocation a captured graph still uses, left non-zero
    assert not counters.all_zero(cpu)
    first.zero_()
    assert counters.all_zero(cpu) and counters.all_zero(torch.device("meta"))
