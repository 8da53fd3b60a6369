"""Ticket counters of the split-merge pattern, shared by the kernels that use it.

Why: several decode kernels end without a second launch by the same pattern (the decode
attention's split merge, the MoE router's routing tail, the MoE split down launch's sum): each
program of a group stores its partial, takes a ticket with an acq_rel atomic on the group's
counter, and the program that takes the last one reads the others' partials, writes the result
and resets the counter to zero. So the counters must be zero between launches, and since a
CUDA graph bakes their address in, they are allocated once per device and never moved: an
allocation grows (outside a capture only) and the older ones stay alive for the graphs that
hold them. Launches on a device share a kernel's counters, so they must run one after another
(the engine's one stream per device).
"""

from __future__ import annotations

import torch


class TicketCounters:
    """One kernel's int32 counters per device (see the module docstring)."""

    def __init__(self, owner: str, minimum: int) -> None:
        self._owner = owner  # named in the error a capture-time allocation raises
        self._minimum = minimum  # counters of the first allocation
        self._held: dict[torch.device, list[torch.Tensor]] = {}

    def take(self, device: torch.device, count: int) -> torch.Tensor:
        """At least `count` zeroed counters on `device`: the newest allocation, or a larger one
        (raises while a CUDA graph is being captured: run the launch eagerly first)."""
        held = self._held.setdefault(device, [])
        if held and held[-1].numel() >= count:
            return held[-1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self._owner}: {count} ticket counters needed while capturing a CUDA graph, "
                f"{held[-1].numel() if held else 0} allocated; run the launch eagerly first "
                f"(warm-up)")
        held.append(torch.zeros(max(count, self._minimum), dtype=torch.int32, device=device))
        return held[-1]

    def all_zero(self, device: torch.device) -> bool:
        """Whether every counter allocated on `device` is back at zero (each launch's last
        programs reset theirs)."""
        return all(not bool(t.any()) for t in self._held.get(device, []))
