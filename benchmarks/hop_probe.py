"""Probe: what one dependent launch costs on this GPU, whatever it computes (issue 39's floor).

A batch-1 MoE decode layer is ten dependent launches (benchmarks/MOE_B1.md); the bars ask for
<= 5-10 us a layer beyond the bytes. This measures the floor of one such hop: a CUDA graph of
LAUNCHES back-to-back launches of a kernel that does (almost) nothing, each launch depending on
the previous one, timed per launch, for
- PDL on / off (programmatic dependent launch, shard/kernels/pdl.py: trigger at start, wait);
- programs per launch: 1, 64 (the decode attention's at batch 1), 4 x SMs (a GEMV's);
- what each program does after the wait: nothing; reads one value the previous launch wrote
  (a dependent L2 round trip) and writes one; that plus the split-merge ticket (the stores
  published with an acq_rel atomic, the last program reading the others' values back:
  shard/kernels/tickets.py's pattern).

`python -m benchmarks.hop_probe --out DIR` writes DIR/hop_probe.json and prints a table: us
per launch, the median of REPS graph replays.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor
from shard.kernels.tickets import TicketCounters

LAUNCHES = 480  # a 48-layer step's ten launches a layer
REPS = 20
MAX_PROGRAMS = 4096
_TICKETS = TicketCounters("hop_probe", 1)


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, ticket_ptr, merged_at, PDL: tl.constexpr,
                READ: tl.constexpr, TICKET: tl.constexpr, BLOCK: tl.constexpr):
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    v = 1.0
    if READ:  # the previous launch's output: a dependent round trip
        v = tl.load(src_ptr + pid, cache_modifier=".cg") + 1.0
    tl.store(dst_ptr + pid, v)
    if TICKET:
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            tl.store(ticket_ptr, 0)
            offs = tl.arange(0, BLOCK)
            vals = tl.load(dst_ptr + offs, mask=offs < tl.num_programs(0), other=0.0,
                           cache_modifier=".cg")
            tl.store(dst_ptr + merged_at, tl.sum(vals, 0))


def _chain(bufs: list[torch.Tensor], tickets: torch.Tensor, programs: int, use_pdl: bool,
           read: bool, ticket: bool) -> None:
    opts = pdl.launch_options(bufs[0].device) if use_pdl else {"PDL": False}
    for i in range(LAUNCHES):
        _hop_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], tickets, MAX_PROGRAMS, READ=read,
                                 TICKET=ticket, BLOCK=triton.next_power_of_2(programs),
                                 num_warps=4, **opts)


def run() -> dict:
    from benchmarks.moe_bench import _graph_ms

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bufs = [torch.zeros(MAX_PROGRAMS + 1, device=dev) for _ in range(2)]
    tickets = _TICKETS.take(dev, 1)
    rows = []
    for programs in (1, 64, 4 * sms):
        for use_pdl in (False, True):
            for read, ticket in ((False, False), (True, False), (True, True)):
                case = functools.partial(_chain, bufs, tickets, programs, use_pdl, read, ticket)
                ms = _graph_ms(case, iters=REPS)
                rows.append({"programs": programs, "pdl": use_pdl, "read": read,
                             "ticket": ticket, "us_per_launch": ms * 1e3 / LAUNCHES})
    assert _TICKETS.all_zero(dev)
    return {"device": torch.cuda.get_device_name(dev), "launches": LAUNCHES, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hop_probe")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    res = run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hop_probe.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}: us per launch, {LAUNCHES} dependent launches in one CUDA graph")
    for r in res["rows"]:
        work = "ticket" if r["ticket"] else "read" if r["read"] else "nothing"
        print(f"  programs {r['programs']:5d}  pdl {'on ' if r['pdl'] else 'off'}  {work:8s}"
              f"  {r['us_per_launch']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
