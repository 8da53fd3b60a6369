"""Mixture-of-experts layers: one `FusedMoE` (stacked experts, one loader, one fused kernel) that
every MoE family reuses, and the sparse block around it (router, optional gated shared expert).

Routing variants are options (`MoeRouting`: softmax before or after top-k, renormalized or
not); checkpoint names are options (`ExpertNames`: Mixtral's w1/w3/w2, Qwen's
gate_proj/up_proj/down_proj). Experts are stored stacked:

    w13 [E_local, 2 * I_local, H]  rows 0..I_local-1: gate, I_local..: up
    w2  [E_local, H, I_local]

Tensor parallelism: every expert's intermediate dimension is split over the ranks (gate/up rows,
down columns), so each rank's output is a partial sum that the layer's caller reduces with the
MLP's usual all-reduce (or the fused all-reduce + norm). Expert parallelism would instead give
each rank a range of experts (`expert_range`): routed ids outside it are dropped by the layout
(shard/kernels/moe_align.py) and their slots contribute zero here, so the same all-reduce would
sum the ranks' outputs; only the loader reads by range today (TP shards every expert).

fp8 (--quantize fp8): each expert's gate/up and down weights are quantized per output channel
at load time (one expert in host/device float at a time) and run through the same kernel.

Routing statistics: each layer adds its step's routed-token counts per expert into a device
buffer of a shared `RoutingStats` (no host sync; inside CUDA graphs too); the shard reads the
sums at a step's existing sync point (shard/engine).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed.groups import Dist
from shard.kernels.moe_align import MoeRouting, align_by_expert, grouped_moe_torch, route
from shard.kernels.setting import Setting
from shard.layers import decode_linear
from shard.layers.linear import MergedColumnParallelLinear, PushedPartial, RowParallelLinear
from shard.layers.norm import RMSNorm
from shard.layers.weights import WeightLoader, Weights
from shard.quantization.fp8 import FP8_DTYPE, quantize_fp8_per_channel
from shard.quantization.methods import QuantizeMethod

if TYPE_CHECKING:  # a Triton module: the layers import it where a CUDA path runs
    from shard.kernels.moe_router import NormedLogits

__all__ = ["ExpertNames", "FusedMoE", "MoeRouting", "RoutingStats", "SparseMoeBlock"]

# Rows per block of the CPU path's batched matmuls (the CUDA kernel picks its own).
_CPU_BLOCK_M = 8

# Opt-in: decode-sized CUDA steps on one rank run the residual add + RMSNorm before the sparse
# block, its router GEMV and the routing in one launch (shard/kernels/moe_router.py) instead of
# three. Off by default: measured on an H100 (2026-11-28, Qwen3-30B-A3B shape, batch 1,
# benchmarks/MOE_B1.md) the launch alone takes 5.0 us against 7.2 us for the three it replaces,
# but the whole step is ~12 us a layer slower with it. `fused_router(True)` turns it on
# (benchmarks compare both in one process).
_FUSED_ROUTER = Setting(False)


def fused_router(on: bool) -> AbstractContextManager[None]:
    """Inside the block SparseMoeBlock.forward_add_norm takes the fused launch (on) or declines
    (off: the decoder layer runs add + norm, the router GEMV and routing apart). Capture a CUDA
    graph under the setting it is replayed with."""
    return _FUSED_ROUTER.override(on)


# On by default, where the fused router is off: decode-sized steps run the residual add + RMSNorm
# and the router GEMV in one launch without the routing (moe_router.add_rms_norm_logits), then
# the routing and the experts as the unfused form runs them (4 launches instead of 5, without
# the fused router's one-program routing tail). Measured in the whole Qwen3-30B-A3B-shaped
# batch-1 step on an H200 (round 17, benchmarks/MOE_B1.md, interleaved with it off): -1.5 us a
# layer of critical path in bf16 and in fp8. Off: the three launches. Capture a CUDA graph under
# the setting it is replayed with.
ROUTER_NORM = Setting(True)


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint names of one expert's projections: `{prefix}.{e}.{gate}.weight`, ..."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


MIXTRAL_EXPERT_NAMES = ExpertNames("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ExpertNames()


class RoutingStats:
    """Routed tokens per (MoE layer, expert), summed on the device since the last read.

    `begin_step(valid)` gives the step's real rows (CUDA-graph padding rows excluded); each
    layer adds its counts (`record`, or the CUDA layout kernel itself); `take_device()` hands
    the sums over as a device tensor and clears them (the shard copies it to the host with a
    step's sampled tokens: shard/engine/batches.py), `take()` reads them per layer (tests,
    benchmarks)."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        # [layers, experts]; rows 16-byte aligned (an even row stride), as the layout kernel's
        # compiled variant expects of every layer's row
        padded = num_experts + num_experts % 2
        self.counts = torch.zeros(num_layers, padded, dtype=torch.int64,
                                  device=device)[:, :num_experts]
        self._valid: torch.Tensor | None = None  # [num_tokens] int64, 1 for real rows

    def begin_step(self, valid: torch.Tensor) -> None:
        self._valid = valid.to(torch.int64)

    def valid_rows(self, n: int) -> torch.Tensor | None:
        """[n] int64, 1 for the step's real rows; None when unknown (every row counts)."""
        if self._valid is not None and self._valid.shape[0] == n:
            return self._valid
        return None

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [n, k]: add 1 per real row to each chosen expert of `layer`."""
        n, k = topk_ids.shape
        valid = self.valid_rows(n)
        ones = valid[:, None].expand(-1, k) if valid is not None else torch.ones(
            n, k, dtype=torch.int64, device=topk_ids.device)
        self.counts[layer].scatter_add_(0, topk_ids.reshape(-1).long(), ones.reshape(-1))

    def take_device(self) -> torch.Tensor:
        """[num_experts] int64, the counts of all layers summed since the last take, as a new
        device tensor; clears them (stream-ordered: no host sync)."""
        out = self.counts.sum(dim=0)
        self.counts.zero_()
        return out

    def take(self) -> list[list[int]]:
        """[layer][expert] counts since the last take; clears them."""
        out = self.counts.tolist()
        self.counts.zero_()
        return out


class ReplicatedLinear(nn.Module, WeightLoader):
    """y = x @ W.T with the whole W on every rank (routers, the shared expert's gate: a few
    rows)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load(self, weights: Weights, prefix: str) -> None:
        self.weight.data = weights.get(f"{prefix}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.shape[0] < 16:  # the shared expert's gate (1 row): torch's own
            return F.linear(x, self.weight)
        # The router: F.linear, or the decode GEMV where tuning found it faster for this shape
        # and batch (at batch 1 it is one of a decode layer's ~10 kernels: every us counts)
        return decode_linear.linear(x, self.weight)


class FusedMoE(nn.Module, WeightLoader):
    """The routed experts of one layer: x [n, H] and router logits [n, E] -> this rank's share
    of sum_j w_j * expert_{e_j}(x) [n, H] (not reduced over ranks)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, routing: MoeRouting,
                 dist: Dist, names: ExpertNames = QWEN_EXPERT_NAMES,
                 expert_range: tuple[int, int] | None = None):
        super().__init__()
        if intermediate % dist.world_size:
            raise ValueError(f"moe_intermediate_size {intermediate} not divisible by "
                             f"{dist.world_size} ranks")
        self.num_experts, self.hidden, self.routing, self.names = (
            num_experts, hidden, routing, names)
        self.inter_local = intermediate // dist.world_size
        self.dist = dist
        # Experts this rank holds: all of them under tensor parallelism.
        self.expert_range = expert_range or (0, num_experts)
        local = self.expert_range[1] - self.expert_range[0]
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.inter_local, hidden),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden, self.inter_local), requires_grad=False)
        # fp8: per expert and output channel, float32 ([E, 2I], [E, H]); None for 16-bit weights
        # (buffers: memory reports count them)
        self.scale13: torch.Tensor | None
        self.scale2: torch.Tensor | None
        self.register_buffer("scale13", None, persistent=False)
        self.register_buffer("scale2", None, persistent=False)
        self.stats: RoutingStats | None = None
        self.layer_index = 0
        self._warm = False

    def attach_stats(self, stats: RoutingStats, layer_index: int) -> None:
        self.stats, self.layer_index = stats, layer_index

    def load(self, weights: Weights, prefix: str) -> None:
        """Reads `{prefix}.{e}.{gate,up,down}.weight` expert by expert into the stacked weights:
        one expert's slices exist outside them at a time (never a host copy of the layer)."""
        fp8 = self._fp8(weights)
        lo, hi = self.expert_range
        i, h = self.inter_local, self.hidden
        kw = {"device": weights.device}
        w13 = torch.empty(hi - lo, 2 * i, h, dtype=FP8_DTYPE if fp8 else weights.dtype, **kw)
        w2 = torch.empty(hi - lo, h, i, dtype=w13.dtype, **kw)
        s13 = torch.empty(hi - lo, 2 * i, dtype=torch.float32, **kw) if fp8 else None
        s2 = torch.empty(hi - lo, h, dtype=torch.float32, **kw) if fp8 else None
        for local, e in enumerate(range(lo, hi)):
            gate_up, down = self._read_expert(weights, prefix, e)  # [2I_local, H], [H, I_local]
            if fp8:
                w13[local], s13[local] = quantize_fp8_per_channel(gate_up)
                w2[local], s2[local] = quantize_fp8_per_channel(down)
            else:
                w13[local], w2[local] = gate_up, down
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.scale13, self.scale2 = s13, s2

    def _read_expert(self, weights: Weights, prefix: str, e: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate/up rows [2I_local, H] (this rank's gate rows, then its up rows) and
        down columns [H, I_local], from one tensor per expert and projection (the hub's
        layout) or from transformers 5's stacked `gate_up_proj` [E, 2I, H] / `down_proj`
        [E, H, I] (what it saves for some families)."""
        if weights.has(f"{prefix}.gate_up_proj"):
            i, r = self.inter_local, self.dist.rank
            full = i * self.dist.world_size  # I: the up rows start there
            name = f"{prefix}.gate_up_proj"
            gate_up = torch.cat([weights.get_part(name, e, 0, r * i, (r + 1) * i),
                                 weights.get_part(name, e, 0, full + r * i, full + (r + 1) * i)])
            return gate_up, weights.get_part(f"{prefix}.down_proj", e, 1, r * i, (r + 1) * i)
        n = self.names
        gate_up = torch.cat([weights.get_sharded(f"{prefix}.{e}.{n.gate}.weight", dim=0),
                             weights.get_sharded(f"{prefix}.{e}.{n.up}.weight", dim=0)])
        return gate_up, weights.get_sharded(f"{prefix}.{e}.{n.down}.weight", dim=1)

    @staticmethod
    def _fp8(weights: Weights) -> bool:
        quant = weights.quant
        if quant is None:
            return False
        if quant.checkpoint is not None:
            raise NotImplementedError("pre-quantized checkpoints are not supported for MoE "
                                      "experts by the native code; use --model-impl transformers")
        if quant.flag is not QuantizeMethod.FP8:
            raise NotImplementedError(f"--quantize {quant.flag.value}: MoE experts support "
                                      "--quantize fp8 only")
        return True

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [n, H], router_logits [n, E] -> [n, H], this rank's partial sum."""
        if x.is_cuda:
            return self._forward_cuda(x, router_logits)
        topk_weights, topk_ids = route(router_logits, self.routing)  # [n, k] each
        if self.stats is not None:
            self.stats.record(self.layer_index, topk_ids)
        topk_ids = self._local_ids(topk_ids)
        layout = align_by_expert(topk_ids, self.w13.shape[0], _CPU_BLOCK_M)
        return grouped_moe_torch(x, self.w13, self.w2, topk_weights, layout,
                                 self.routing.top_k, self.scale13, self.scale2)

    def forward_routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       router_logits: torch.Tensor) -> torch.Tensor:
        """x [n, H] with its routing already computed (weights [n, k] float32, ids [n, k]
        int32; moe_router's fused launch) -> [n, H], this rank's partial, through the decode
        kernels (the caller checked `decode_sized`). router_logits [n, E]: only for the
        first eager call's warm-up of every variant."""
        from shard.kernels import moe_decode

        if x.is_cuda and not self._warm and not torch.cuda.is_current_stream_capturing():
            self._warm_up(x, router_logits)
        cfg = moe_decode.decode_config_for(x.shape[0] * self.routing.top_k,
                                           self.scale13 is not None)
        assert cfg is not None
        stats = self.stats
        return moe_decode.moe_decode(
            x, self.w13, self.w2, self.routing.top_k, self.scale13, self.scale2, cfg,
            topk_weights=topk_weights, topk_ids=topk_ids,
            count_into=stats.counts[self.layer_index] if stats is not None else None,
            valid=stats.valid_rows(x.shape[0]) if stats is not None else None)

    def decode_sized(self, n: int) -> bool:
        """Whether n tokens take the decode kernels on CUDA (every expert on this rank)."""
        from shard.kernels import moe_decode

        return (self.expert_range == (0, self.num_experts) and moe_decode.decode_config_for(
            n * self.routing.top_k, self.scale13 is not None) is not None)

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's stacked rows; other ranks' experts become ids past
        the end, which the layout drops."""
        lo, local = self.expert_range[0], self.w13.shape[0]
        if lo == 0 and local == self.num_experts:
            return topk_ids
        ids = topk_ids - lo
        return torch.where((ids < 0) | (ids >= local), local, ids)

    def _forward_cuda(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Up to moe_decode.DECODE_MAX_SLOTS routed slots: the decode kernels (routing
        in its own launch or inside gate/up, as the table says; statistics counted). Past that: routing (1 launch), layout (1 launch up to
        moe_route.ALIGN_MAX_SLOTS, with the statistics), the two grouped GEMMs and the sum over
        each token's k slots. No host sync either way."""
        from shard.kernels import fused_moe, moe_decode, moe_route

        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not self._warm and not capturing:  # (CPU tensors: the kernels' interpreter tests)
            self._warm_up(x, router_logits)
        whole = self.expert_range == (0, self.num_experts)
        decode_cfg = moe_decode.decode_config_for(x.shape[0] * self.routing.top_k,
                                                 self.scale13 is not None)
        if decode_cfg is not None and whole:
            # Decode-sized: routing, gate/up, down and the sum over the k slots in 2 launches
            # (shard/kernels/moe_decode.py), weight-streaming instead of padded MMA tiles.
            stats = self.stats
            return moe_decode.decode_layer(
                x, router_logits, self.w13, self.w2, self.routing, self.scale13, self.scale2,
                decode_cfg,
                count_into=stats.counts[self.layer_index] if stats is not None else None,
                valid=stats.valid_rows(x.shape[0]) if stats is not None else None)
        topk_weights, topk_ids = moe_route.route(router_logits, self.routing)  # [n, k] each
        local = self.w13.shape[0]
        cfg = fused_moe.config_for(topk_ids.numel(), local)
        if topk_ids.numel() <= moe_route.ALIGN_MAX_SLOTS and whole:
            stats = self.stats
            layout = moe_route.align(
                topk_ids, local, cfg.block_m,
                count_into=stats.counts[self.layer_index] if stats is not None else None,
                valid=stats.valid_rows(x.shape[0]) if stats is not None else None)
        else:
            if self.stats is not None:
                self.stats.record(self.layer_index, topk_ids)
            topk_ids = self._local_ids(topk_ids)
            layout = align_by_expert(topk_ids, local, cfg.block_m)
        return fused_moe.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.scale13,
                                   self.scale2, cfg, layout, all_local=whole)


    def _warm_up(self, x: torch.Tensor, router_logits: torch.Tensor) -> None:
        """Compiles every kernel variant a later CUDA-graph capture can launch (a capture cannot
        compile): each GEMM config of the table, the layout kernel for each of their row block
        sizes (with statistics as this layer keeps them), the routing kernel."""
        from shard.kernels import fused_moe, moe_decode, moe_route

        moe_decode.warm_up(x, self.w13, self.w2, self.routing, self.scale13, self.scale2,
                           self.stats.counts[self.layer_index] if self.stats is not None
                           else None)
        fused_moe.warm_up(x, self.w13, self.w2, self.routing.top_k, self.scale13, self.scale2)
        moe_route.route(router_logits[:1], self.routing)
        ids = torch.zeros(1, self.routing.top_k, dtype=torch.int32, device=x.device)
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int64, device=x.device)
        valid = torch.ones(1, dtype=torch.int64, device=x.device)
        for block_m in sorted({cfg.block_m for _, cfg in fused_moe.CONFIGS}):
            if self.stats is not None:
                moe_route.align(ids, self.w13.shape[0], block_m, counts, valid)
            else:
                moe_route.align(ids, self.w13.shape[0], block_m)
        self._warm = True


class GatedMLP(nn.Module):
    """silu(gate(x)) * up(x) -> down, tensor parallel (the shared expert): this rank's partial."""

    def __init__(self, hidden: int, intermediate: int, dist: Dist):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}, False, dist, merge=True)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, dist)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H] partial
        return self.down_proj.partial(self.gate_up_proj.forward_silu_mul(x))


class SparseMoeBlock(nn.Module):
    """Router -> FusedMoE, plus a shared expert scaled by sigmoid(shared_expert_gate(x))
    (Qwen2-MoE) where shared_intermediate is set. Module names equal the checkpoint's (`gate`,
    `experts`, `shared_expert`, `shared_expert_gate`); same call as the dense MLPs."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, routing: MoeRouting,
                 dist: Dist, names: ExpertNames, shared_intermediate: int = 0):
        super().__init__()
        self.dist = dist
        self.gate = ReplicatedLinear(hidden, num_experts)
        self.experts = FusedMoE(num_experts, hidden, intermediate, routing, dist, names)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, dist) if shared_intermediate \
            else None
        self.shared_expert_gate = ReplicatedLinear(hidden, 1) if shared_intermediate else None
        # forward_add_norm's launches compiled: True, with the routing (fused_router); False,
        # without (ROUTER_NORM)
        self._router_warm: set[bool] = set()

    def forward(self, x: torch.Tensor, reduce: bool = True, push: bool = False) -> torch.Tensor:
        """x [n, H] -> [n, H]; with reduce=False this rank's un-reduced share (push: ignored,
        the experts' output is not a GEMV's)."""
        y = self.experts(x, self.gate(x))
        return self._reduce(self._add_shared(x, y), reduce)

    def _add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            # sigmoid(g) * partial sums to sigmoid(g) * the whole shared expert over the ranks
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

    def _reduce(self, y: torch.Tensor, reduce: bool) -> torch.Tensor:
        return self.dist.all_reduce(y) if reduce else y

    def forward_add_norm(self, delta: torch.Tensor | PushedPartial, x: torch.Tensor,
                         norm: RMSNorm, push: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layer's `h, x = reduce_add_rms_norm(dist, delta, x, norm); y = self(h,
        reduce=False)` as (x, y), where a fused launch is on (fused_router, ROUTER_NORM) and
        serves the step (CUDA, one rank, a decode-sized batch, Llama's norm): see
        forward_add_norm_fused. None where it does not: the caller runs the unfused form.
        push: ignored (as in forward)."""
        if not ((_FUSED_ROUTER.value or ROUTER_NORM.value) and isinstance(delta, torch.Tensor)
                and x.is_cuda):
            return None
        if (_FUSED_ROUTER.value not in self._router_warm and x.shape[0]
                and not torch.cuda.is_current_stream_capturing()
                and self.fused_router_serves(delta[:1], x[:1], norm)):
            # At the first eager call, whatever its size (warm-up's prefill, when graphs are
            # off): a later decode step then finds the kernel compiled (no compile while serving)
            self._warm_router(delta, x, norm)
        if not self.fused_router_serves(delta, x, norm):
            return None
        return self.forward_add_norm_fused(delta, x, norm)

    def fused_router_serves(self, delta: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> bool:
        """Whether the fused launch (fused_router's or ROUTER_NORM's) computes this step's add
        + norm + router GEMV (+ routing): one rank (under tensor parallelism the all-reduce
        comes first), Llama's norm, [n, H] rows with unit column stride, n tokens the decode
        kernels take (moe_decode.DECODE_MAX_SLOTS)."""
        from shard.kernels import moe_router

        if x.dim() != 2 or delta.shape != x.shape or x.stride(1) != 1 or delta.stride(1) != 1:
            return False
        n, hidden = x.shape
        return (self.dist.world_size == 1 and norm.weight_offset == 0
                and moe_router.applies(hidden, n) and self.experts.decode_sized(n))

    def forward_add_norm_fused(self, delta: torch.Tensor, x: torch.Tensor, norm: RMSNorm
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_add_norm's fused path (the caller checked fused_router_serves; also run on
        CPU tensors by the interpreter tests). -> (x + delta, this rank's MLP output).
        fused_router: add + norm + router GEMV + routing in one kernel
        (shard/kernels/moe_router.py), then the experts' decode kernels on that routing; else
        (ROUTER_NORM) add + norm + router GEMV in one kernel, then the experts as forward runs
        them (the routing launch and the decode kernels)."""
        from shard.kernels import moe_router

        r = self._router_launch(delta, x, norm)
        if isinstance(r, moe_router.NormedRouting):
            y = self.experts.forward_routed(r.normed, r.weights, r.ids, r.logits)
        else:
            y = self.experts(r.normed, r.logits)
        return r.residual, self._add_shared(r.normed, y)

    def _router_launch(self, delta: torch.Tensor, x: torch.Tensor, norm: RMSNorm
                       ) -> NormedLogits:
        """The launch the settings select: with the routing (fused_router) or without."""
        from shard.kernels import moe_router

        args = (delta, x, norm.weight, norm.eps, self.gate.weight)
        if _FUSED_ROUTER.value:
            return moe_router.add_rms_norm_route(*args, self.experts.routing)
        return moe_router.add_rms_norm_logits(*args)

    def _warm_router(self, delta: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> None:
        """Compiles the launch the settings select (and allocates the routing form's tickets)
        eagerly (a CUDA-graph capture can do neither): one row, outputs dropped."""
        self._router_launch(delta[:1], x[:1], norm)
        self._router_warm.add(_FUSED_ROUTER.value)
