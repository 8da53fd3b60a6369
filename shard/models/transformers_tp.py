"""Puts tokenwire's tensor-parallel linears into a transformers model, by its tp plan.

transformers configs name how each projection splits over ranks (`base_model_tp_plan`, module
patterns with `*` for the layer index -> style). Every `nn.Linear` the plan names becomes one of
tokenwire's linears, so that tensor parallelism, `--quantize` and LoRA apply as on the native
path; each reads its slice from the loaded model's own tensors (`StateWeights`: transformers has
already renamed and fused legacy checkpoint layouts, e.g. per-expert MoE weights, on load):
- colwise: a column-parallel layer (output rows split); key/value projections follow the
  native head layout (shard/models/heads.py: split, or replicated when KV heads < ranks);
- rowwise: a row-parallel layer (input columns split, one all-reduce, bias once);
- colwise_gather_output / rowwise_split_input (the model slices or norms the full projection,
  e.g. Phi-3's packed qkv, OLMo 2's q/k norms): replicated tokenwire linears;
- packed_colwise_halves (a packed gate/up projection the model chunks in two, see
  transformers_support.tp_plan): each half split column-wise, this rank's halves side by side;
- packed_colwise + rowwise on MoE experts (3-D `gate_up_proj` [E, 2I, H] and `down_proj`
  [E, H, I] of a `moe_tp_experts` module): each rank keeps its share of every expert's
  intermediate features (gate and up halves each split) and the experts' output is all-reduced.
Styles that only concern training (replicated_with_grad_allreduce) or embeddings (kept whole on
every rank) change nothing here; any other style fails at start-up under tensor parallelism.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from shard.distributed.groups import Dist
from shard.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from shard.layers.weights import Weights
from shard.models.heads import HeadPartition
from shard.quantization.loading import LinearQuantization

COLWISE = {"colwise"}
ROWWISE = {"rowwise"}
REPLICATED = {"colwise_gather_output", "rowwise_split_input"}
PACKED = "packed_colwise_halves"
IGNORED = {"replicated_with_grad_allreduce", "embedding_rowwise", "packed_colwise",
           "moe_tp_experts"}
KV_PROJECTIONS = ("k_proj", "v_proj")


class StateWeights(Weights):
    """Weights over an in-memory {name: tensor} (a loaded transformers model's state), with the
    same slicing, casting and device placement as the checkpoint reader."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 dist: Dist, quant: LinearQuantization | None = None):
        self.device, self.dtype, self.dist, self.quant = device, dtype, dist, quant
        self._state = state

    def has(self, name: str) -> bool:
        return name in self._state

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Another tensor to read by name (e.g. one half of a packed projection)."""
        self._state[name] = tensor

    def names(self) -> list[str]:
        return list(self._state)

    def _slice(self, name: str) -> _TensorSlice:
        if name not in self._state:
            raise KeyError(f"weight {name!r} not found in the model")
        return _TensorSlice(self._state[name])

    def get(self, name: str, raw: bool = False) -> torch.Tensor:
        t = self._slice(name)[:]
        return t.to(self.device) if raw else self._finish(t)


class _TensorSlice:
    """A tensor seen through safetensors' slice interface (get_shape, [a:b], [:, a:b])."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.t.detach()[index]


def plan_style(plan: dict[str, str], name: str) -> str | None:
    """The plan's style for module `name` (relative to the base model), or None."""
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


def attention_split(plan: dict[str, str]) -> bool:
    """Whether the plan splits the attention projections' heads over ranks (colwise q/k/v)."""
    return any(style in COLWISE for pattern, style in plan.items()
               if "attn" in pattern or "attention" in pattern)


def localize_heads(attention: nn.Module, heads: int, kv_heads: int, split: HeadPartition) -> None:
    """Head counts an attention module keeps as attributes (StableLM reshapes by them, where
    most models reshape by -1) become this rank's."""
    for attr, whole, local in (("num_heads", heads, split.local_heads),
                               ("num_attention_heads", heads, split.local_heads),
                               ("num_key_value_heads", kv_heads, split.local_kv_heads),
                               ("num_kv_heads", kv_heads, split.local_kv_heads)):
        if getattr(attention, attr, None) == whole:
            setattr(attention, attr, local)
    if isinstance(getattr(attention, "num_key_value_groups", None), int):
        attention.num_key_value_groups = split.local_heads // split.local_kv_heads


class ColumnLinear(MergedColumnParallelLinear):
    """A column-parallel linear standing in for one nn.Linear: a one-part merged layer (the
    part named as the module, so LoRA adapters target it by its checkpoint name); returns one
    tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out_local]
        shape = x.shape[:-1]
        outs = super().forward(x.reshape(-1, x.shape[-1]))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # packed halves
        return y.view(*shape, -1)


class RowLinear(RowParallelLinear):
    """RowParallelLinear over inputs of any leading shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_local] -> [..., out]
        shape = x.shape[:-1]
        return super().forward(x.reshape(-1, x.shape[-1])).view(*shape, -1)


def swap_linears(
    model: nn.Module,
    base_prefix: str,  # the base model's attribute ("model", "gpt_neox", ...)
    plan: dict[str, str],
    weights: StateWeights,
    heads: HeadPartition,
) -> int:
    """Replaces the planned nn.Linear modules of `model` by tokenwire linears loaded from
    `weights`; slices MoE experts. Returns how many linears were replaced."""
    dist, world = weights.dist, weights.dist.world_size
    replaced = 0
    for name, module in list(model.named_modules()):
        rel = name.removeprefix(base_prefix + ".")
        style = plan_style(plan, rel) if name.startswith(base_prefix + ".") else None
        if style == "moe_tp_experts" and world > 1:
            _split_experts(name, module, dist)
            continue
        if not isinstance(module, nn.Linear) or style is None or style in IGNORED:
            continue
        leaf = name.rpartition(".")[2]
        bias = module.bias is not None
        if style in COLWISE:
            part = ((heads.kv_part, heads.kv_parts) if leaf in KV_PROJECTIONS
                    else (dist.rank, world))
            new: nn.Module = ColumnLinear(module.in_features, {leaf: module.out_features}, bias,
                                          dist, merge=False, row_blocks={leaf: part})
        elif style in ROWWISE:
            new = RowLinear(module.in_features, module.out_features, bias, dist)
        elif style == PACKED:
            half = module.out_features // 2
            for k in range(2):  # the halves under names of their own, split like any column
                for kind in ("weight", "bias") if bias else ("weight",):
                    whole = weights.get(f"{name}.{kind}", raw=True)
                    weights.add(f"{name}_{k}.{kind}", whole[k * half : (k + 1) * half])
            new = ColumnLinear(module.in_features, {f"{leaf}_{k}": half for k in range(2)}, bias,
                               dist, merge=True)
        elif style in REPLICATED:
            new = ColumnLinear(module.in_features, {leaf: module.out_features}, bias, dist,
                               merge=False, row_blocks={leaf: (0, 1)})
        elif world > 1:
            raise ValueError(f"tensor-parallel style {style!r} of {name} is not supported")
        else:
            continue
        new.load(weights, name)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        replaced += 1
    return replaced


def _split_experts(name: str, experts: nn.Module, dist: Dist) -> None:
    """This rank's share of every expert's intermediate features; the module's output becomes
    a partial sum, all-reduced by a forward hook."""
    params = dict(experts.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or getattr(experts, "is_transposed", False):
        raise ValueError(f"{name}: MoE experts of this layout cannot be split over ranks "
                         f"(parameters {sorted(params)})")
    gate_up, down = params["gate_up_proj"].data, params["down_proj"].data  # [E,2I,H], [E,H,I]
    inter = down.shape[2]
    if inter % dist.world_size:
        raise ValueError(f"{name}: {inter} expert features not divisible by {dist.world_size}")
    local = inter // dist.world_size
    lo, hi = dist.rank * local, (dist.rank + 1) * local
    experts.gate_up_proj = nn.Parameter(
        torch.cat([gate_up[:, lo:hi], gate_up[:, inter + lo : inter + hi]], dim=1).contiguous(),
        requires_grad=False,
    )  # [E, 2 * local, H]: [gate share; up share], as chunk(2) in the experts' forward expects
    experts.down_proj = nn.Parameter(down[:, :, lo:hi].contiguous(), requires_grad=False)
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = local
    experts.register_forward_hook(lambda _m, _i, out: dist.all_reduce(out))
