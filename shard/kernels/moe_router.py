"""The residual add, the RMSNorm, the router GEMV and the top-k routing of a decode-sized MoE step
in ONE launch (CUDA; also under TRITON_INTERPRET=1 on CPU tensors).

Why: at batch 1 a MoE layer's MLP half was five kernels after the o_proj GEMV: add + RMSNorm
(shard/kernels/elementwise.py), the router GEMV ([E, H], 0.5 MB for Qwen3-30B-A3B), routing
(softmax + top-k, shard/kernels/moe_route.py), then the experts' two decode launches
(shard/kernels/moe_decode.py). The first three read ~0.5 MB together yet cost ~1.7 + ~3 + 3.7 us
a layer on an H200 (benchmarks/raw/round11/moe_final/MOE.md): each is a launch with its own
start and tail (the routing launch is not even a programmatic dependent) and one or two
dependent memory round trips. Here they are one kernel:

- grid (n, cdiv(E, ROWS)): program (t, j) owns router rows j*ROWS .. j*ROWS+ROWS-1 of token t.
  It loads its [ROWS, H] slice of the router weight BEFORE the PDL wait (no kernel of the step
  writes weights, so those loads overlap the previous kernel's tail), then the token's delta
  and residual rows, s = x + delta rounded to the model dtype, RMSNorm(s) as
  elementwise.add_rms_norm computes it (the same rounding points, the row's sum of squares as
  one tl.sum), and its ROWS logits (fp32 dot, rounded to the model dtype as the GEMV's output
  is; summed in another order than the GEMV's, so a logit may differ by one rounding step).
  Program (t, 0) stores normed h and s (the experts and the next layer read them).
- Each program stores its logits, then takes a ticket (an acq_rel atomic on a per-token
  counter); the program that takes the last one reads the token's whole logits row back (past
  the L1), runs the family's routing (moe_route.route_values: the same code as the routing
  launch) and writes weights [n, k] float32 and ids [n, k] int32, then resets the counter.
  (The split-merge pattern of shard/kernels/attention_decode.py.)
So a step's MoE half is 3 launches (this, gate/up, down+sum) instead of 5. Shapes are static
(no host sync) and the tickets are allocated once per device: CUDA-graph safe.

ROUTE False (add_rms_norm_logits): the same launch without the tickets and the routing: it stores
h, s and the logits only, and the routing stays its own launch (as FusedMoE.forward runs it).
Why: measured in the whole step the one-program routing tail made the fused form slower
(benchmarks/MOE_B1.md, rounds 14-15), while the add + norm launch it saves costs ~1.4 us a
layer on an H200. This middle form (4 launches) is the default (shard.layers.moe.ROUTER_NORM):
-1.5 us a layer of the step's critical path, bf16 and fp8 (round 17).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.elementwise import _add_normed_row
from shard.kernels.moe_align import MoeRouting
from shard.kernels.moe_route import route_values
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor
from shard.kernels.setting import Setting
from shard.kernels.tickets import TicketCounters

# Largest hidden size served (the row and a [ROWS, H] weight slice sit in registers).
MAX_HIDDEN = 8192
MAX_ROWS = 1024  # tokens per launch (ticket counters); decode-sized steps are far below


@dataclass(frozen=True)
class RouterConfig:
    """Tiling of the fused launch: router rows per program (E / rows programs per token) and
    warps. Fewer rows: more programs in flight, each with a shorter weight stream, but more
    tickets before the last one routes."""

    rows: int
    num_warps: int


_OVERRIDE: Setting[RouterConfig | None] = Setting(None)


def config_override(config: RouterConfig | None) -> AbstractContextManager[None]:
    """Launches made inside the block use `config` (None: default_config): benchmarks compare
    tilings in one process (shard/kernels/setting.py)."""
    return _OVERRIDE.override(config)


def default_config(hidden: int, num_experts: int) -> RouterConfig:
    """ROWS x next_pow2(H) weight elements per program at most 8192 (64 fp32 registers a thread
    at 4 warps): 4 rows at H 2048 (Qwen3-30B-A3B: 32 programs per token), 2 at 4096."""
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(8, 8192 // block_h, triton.next_power_of_2(num_experts)))
    return RouterConfig(rows, 8 if block_h >= 4096 else 4)


@triton.jit
def _add_norm_route_kernel(
    d_ptr,  # [n, H] delta (the attention's o_proj output)
    x_ptr,  # [n, H] residual stream
    nw_ptr,  # [H] RMSNorm weight
    rw_ptr,  # [E, H] router weight
    h_ptr,  # [n, H] out: RMSNorm(x + delta)
    res_ptr,  # [n, H] out: x + delta
    logits_ptr,  # [n, E] out: router logits (model dtype)
    topw_ptr,  # [n, TOP_K] out: routing weights fp32
    ids_ptr,  # [n, TOP_K] out: expert ids int32
    ticket_ptr,  # [>= n] int32, zero between launches
    H,
    E,
    stride_d,
    stride_x,
    stride_rw,
    eps,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    SOFTMAX_FIRST: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next_pow2(E)
    BLOCK_H: tl.constexpr,  # next_pow2(H)
    ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
    OFFSET: tl.constexpr = 0.0,  # Llama's norm (the callers check weight_offset == 0)
    ROUTE: tl.constexpr = True,  # False: logits only (topw/ids/ticket pointers unused)
):
    let_dependents_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_e = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    erows = pid_e * ROWS + tl.arange(0, ROWS)
    emask = erows < E
    # The router weight is no kernel's output: its slice streams in during the previous
    # kernel's tail (PDL).
    w = tl.load(rw_ptr + erows[:, None].to(tl.int64) * stride_rw + offs_h[None, :],
                mask=emask[:, None] & hmask[None, :], other=0.0)  # [ROWS, BLOCK_H]
    wait_for_predecessor(PDL)
    dt = res_ptr.dtype.element_ty
    # elementwise._add_rms_norm_kernel's arithmetic: the sum rounded to the dtype, then the norm
    s, h = _add_normed_row(d_ptr, x_ptr, t, stride_d, stride_x, nw_ptr, offs_h, hmask, H, eps,
                           dt, OFFSET)  # [BLOCK_H] dtype each
    if pid_e == 0:
        tl.store(res_ptr + t * H + offs_h, s, mask=hmask)
        tl.store(h_ptr + t * H + offs_h, h, mask=hmask)
    logit = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)  # [ROWS]
    tl.store(logits_ptr + t * E + erows, logit.to(logits_ptr.dtype.element_ty), mask=emask)
    if ROUTE:
        # Every thread's logits precede the ticket; the acq_rel atomic publishes them to (and,
        # for the last program, acquires the others' from) the whole GPU.
        tl.debug_barrier()
        ticket_at = ticket_ptr + t
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            tl.store(ticket_at, 0)  # every program of this token has taken its ticket
            offs_e = tl.arange(0, BLOCK_E)
            valid = offs_e < E
            row = tl.load(logits_ptr + t * E + offs_e, mask=valid, other=-float("inf"),
                          cache_modifier=".cg").to(tl.float32)  # other SMs wrote it: past L1
            row = tl.where(valid, row, -float("inf"))
            top_v, top_i = route_values(row, offs_e, valid, TOP_K, K_POW2, SOFTMAX_FIRST,
                                        RENORMALIZE, False)
            ks = tl.arange(0, K_POW2)
            tl.store(topw_ptr + t * TOP_K + ks, top_v, mask=ks < TOP_K)
            tl.store(ids_ptr + t * TOP_K + ks, top_i, mask=ks < TOP_K)


# One counter per token of a launch (shard/kernels/tickets.py).
_TICKETS = TicketCounters("moe_router", MAX_ROWS)


@dataclass(frozen=True)
class NormedLogits:
    """add_rms_norm_logits's outputs."""

    normed: torch.Tensor  # [n, H] RMSNorm(x + delta), the experts' input
    residual: torch.Tensor  # [n, H] x + delta, the residual stream
    logits: torch.Tensor  # [n, E] router logits, model dtype


@dataclass(frozen=True)
class NormedRouting(NormedLogits):
    """add_rms_norm_route's outputs: add_rms_norm_logits's and the routing."""

    weights: torch.Tensor  # [n, k] float32
    ids: torch.Tensor  # [n, k] int32


def applies(hidden: int, n: int) -> bool:
    """Whether the fused launch serves a step of n tokens with this hidden size."""
    return 0 < n <= MAX_ROWS and hidden <= MAX_HIDDEN


def add_rms_norm_route(
    delta: torch.Tensor,  # [n, H]
    x: torch.Tensor,  # [n, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    router_weight: torch.Tensor,  # [E, H]
    routing: MoeRouting,
    config: RouterConfig | None = None,
) -> NormedRouting:
    """(RMSNorm(x + delta), x + delta, router logits of the normed row, the routing) in one
    launch: elementwise.add_rms_norm, then x @ router_weight.T, then moe_route.route."""
    n, k = x.shape[0], routing.top_k
    weights = torch.empty((n, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((n, k), dtype=torch.int32, device=x.device)
    r = _launch(delta, x, norm_weight, eps, router_weight, config, (routing, weights, ids))
    return NormedRouting(r.normed, r.residual, r.logits, weights, ids)


def add_rms_norm_logits(
    delta: torch.Tensor,  # [n, H]
    x: torch.Tensor,  # [n, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    router_weight: torch.Tensor,  # [E, H]
    config: RouterConfig | None = None,
) -> NormedLogits:
    """(RMSNorm(x + delta), x + delta, router logits of the normed row) in one launch (ROUTE
    False): elementwise.add_rms_norm, then x @ router_weight.T; the caller routes. No tickets:
    safe to capture in a CUDA graph without an eager call first."""
    return _launch(delta, x, norm_weight, eps, router_weight, config, None)


# ROUTE False's placeholder routing constexprs: one compiled variant whatever the family's routing
_NO_ROUTING = MoeRouting(1, False)


def _launch(
    delta: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    config: RouterConfig | None,
    route: tuple[MoeRouting, torch.Tensor, torch.Tensor] | None,  # (routing, weights, ids) out
) -> NormedLogits:
    """The launch behind add_rms_norm_route (route given: ROUTE True, the routing into its
    weights [n, k] and ids [n, k]) and add_rms_norm_logits (None: ROUTE False)."""
    n, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert applies(hidden, n), (n, hidden)
    assert x.stride(1) == 1 and delta.stride(1) == 1 and router_weight.stride(1) == 1
    cfg = config or _OVERRIDE.value or default_config(hidden, num_experts)
    dev = x.device
    normed = torch.empty((n, hidden), dtype=x.dtype, device=dev)
    residual = torch.empty((n, hidden), dtype=x.dtype, device=dev)
    logits = torch.empty((n, num_experts), dtype=x.dtype, device=dev)
    if route is None:
        # ROUTE False reads none of topw/ids/ticket: any tensor at hand stands in (no ticket
        # counters: nothing to allocate, also while capturing)
        routing, weights, ids, tickets = _NO_ROUTING, logits, logits, logits
    else:
        (routing, weights, ids), tickets = route, _TICKETS.take(dev, n)
    k = routing.top_k
    _add_norm_route_kernel[(n, triton.cdiv(num_experts, cfg.rows))](
        delta, x, norm_weight, router_weight, normed, residual, logits, weights, ids, tickets,
        hidden, num_experts, delta.stride(0), x.stride(0), router_weight.stride(0), eps,
        TOP_K=k, K_POW2=triton.next_power_of_2(k), SOFTMAX_FIRST=routing.softmax_first,
        RENORMALIZE=routing.renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_H=triton.next_power_of_2(hidden), ROWS=cfg.rows, ROUTE=route is not None,
        num_warps=cfg.num_warps, **pdl.launch_options(dev),
    )
    return NormedLogits(normed, residual, logits)
