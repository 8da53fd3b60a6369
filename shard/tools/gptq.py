"""GPTQ: error-compensating quantization of one linear weight from its input statistics.

Round-to-nearest (RTN) rounds every weight on its own. GPTQ (Frantar et al., 2022, "GPTQ:
Accurate Post-Training Quantization for Generative Pre-trained Transformers") quantizes the
columns (input features) of W [out, in] one after another and, after each, moves the column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
squared output error, H = X^T X over calibration inputs X [tokens, in]. The result minimizes
||X W^T - X Q^T|| far better than RTN wherever the inputs are correlated, which they are in
every trained transformer.

This module is the algorithm only (no model, no files): `HessianAccumulator` collects H from the
inputs a layer sees, `gptq_quantize` turns (W, H, a grid) into the quantized weight. The grids
are `Fp8RowGrid` (float8_e4m3fn, one scale per output channel: what tokenwire's fp8 checkpoints
store) and `Nf4BlockGrid` (bitsandbytes' NormalFloat4 code book, one absmax scale per 64
consecutive input features of a row: what `--quantize bitsandbytes-nf4` computes at load time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shard.quantization.fp8 import FP8_MAX  # the serving side's e4m3 range (448)

_MIN_SCALE = 1e-12


class HessianAccumulator:
    """Running H = (2 / n) * sum over tokens of x x^T for one layer's inputs, float32 [in, in]."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0
        self.owner: str | None = None  # the one caller that adds, where several share it

    def add(self, x: torch.Tensor) -> None:
        """x [..., in]: a batch of the layer's inputs."""
        x = x.detach().reshape(-1, self.h.shape[0]).float()  # [n, in]
        n = x.shape[0]
        if n == 0:
            return
        # Running mean, so the magnitude of H does not depend on how many tokens were seen.
        self.h.mul_(self.tokens / (self.tokens + n))
        self.tokens += n
        x = x * (2.0 / self.tokens) ** 0.5
        self.h.addmm_(x.t(), x)


class Grid(Protocol):
    """A quantization grid GPTQ rounds onto, column by column."""

    def prepare(self, w: torch.Tensor) -> None:
        """Called once with the float weight [out, in] (original column order) before any column
        is quantized: per-row / per-block scales that are fixed up front are computed here."""
        ...

    def begin_column(self, w: torch.Tensor, col: int) -> None:
        """Called before quantizing original column `col`, with the current (error-updated)
        weight [out, in] in original order; grids whose scales follow the updated weights set
        them here."""
        ...

    def quantize(self, column: torch.Tensor, col: int) -> torch.Tensor:
        """column [out] float32 (original column `col`) -> its quantized value [out] float32."""
        ...


@dataclass
class Fp8RowGrid:
    """float8_e4m3fn with one scale per output row: scale = clip * row absmax / 448, fixed from
    the original weight (RTN's scale when clip = 1). Values beyond the range saturate."""

    clip: float = 1.0
    scale: torch.Tensor | None = None  # [out] float32, set by prepare

    def prepare(self, w: torch.Tensor) -> None:
        self.scale = (w.abs().amax(dim=1) * self.clip / FP8_MAX).clamp_min(_MIN_SCALE)

    def begin_column(self, w: torch.Tensor, col: int) -> None:
        pass

    def quantize(self, column: torch.Tensor, col: int) -> torch.Tensor:
        assert self.scale is not None
        q = (column / self.scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.float() * self.scale

    def codes(self, wq: torch.Tensor) -> torch.Tensor:
        """The stored fp8 weight [out, in] of a weight this grid quantized (exact)."""
        assert self.scale is not None
        return (wq / self.scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def nf4_code_book() -> torch.Tensor:
    """bitsandbytes' 16 NormalFloat4 values in [-1, 1] (float32, ascending), from the library."""
    import bitsandbytes.functional as bnbf

    return bnbf.get_4bit_type("nf4", device="cpu").float()


@dataclass
class Nf4BlockGrid:
    """NormalFloat4 with one absmax scale per block of `blocksize` consecutive input features of a
    row (bitsandbytes' layout when in_features % blocksize == 0).

    Exactness with bitsandbytes' own load-time rounding: bitsandbytes takes a block's absmax as
    its scale and rounds value / absmax to the nearest code. So that its absmax equals this
    grid's scale s, every block holds one value of exactly +-s: the element that was the block's
    largest when its scale was set is rounded to the code +-1, whatever GPTQ's updates did to it
    (the error of that choice is compensated like any other). Scales are representable in
    `scale_dtype` (the dtype the shard loads in), so that value survives the checkpoint cast.

    static (act-order): scales are fixed from the original weight in `prepare`, since columns are
    then not visited block by block; otherwise each block's scales come from the error-updated
    weight when its first column is reached (better)."""

    blocksize: int = 64
    static: bool = False
    scale_dtype: torch.dtype = torch.bfloat16
    code: torch.Tensor | None = None  # [16] float32
    scale: torch.Tensor | None = None  # [out, in / blocksize] float32
    anchor: torch.Tensor | None = None  # [out, in / blocksize] int64: column forced to +-1

    def prepare(self, w: torch.Tensor) -> None:
        out, cols = w.shape
        if cols % self.blocksize:
            raise ValueError(
                f"nf4 GPTQ: in_features {cols} is not a multiple of the block size {self.blocksize}"
            )
        self.code = nf4_code_book().to(w.device)
        self.scale = torch.zeros(out, cols // self.blocksize, dtype=torch.float32, device=w.device)
        self.anchor = torch.zeros_like(self.scale, dtype=torch.int64)
        if self.static:
            for b in range(cols // self.blocksize):
                self._set_block(w, b)

    def _set_block(self, w: torch.Tensor, b: int) -> None:
        assert self.scale is not None and self.anchor is not None
        lo = b * self.blocksize
        block = w[:, lo : lo + self.blocksize]  # [out, blocksize]
        amax, where = block.abs().max(dim=1)
        # Representable in the load dtype: the +-s anchor value must reach bitsandbytes unchanged.
        s = amax.to(self.scale_dtype).float().clamp_min(_MIN_SCALE)
        self.scale[:, b] = s
        self.anchor[:, b] = where + lo

    def begin_column(self, w: torch.Tensor, col: int) -> None:
        if not self.static and col % self.blocksize == 0:
            self._set_block(w, col // self.blocksize)

    def quantize(self, column: torch.Tensor, col: int) -> torch.Tensor:
        assert self.scale is not None and self.code is not None and self.anchor is not None
        b = col // self.blocksize
        s = self.scale[:, b]  # [out]
        idx = self.nearest(column / s)  # [out] int64
        q = self.code[idx]
        forced = self.anchor[:, b] == col
        # The anchor element: +-1 by its sign (+1 for an exact zero, i.e. an all-zero block).
        q = torch.where(forced, torch.where(column < 0, -1.0, 1.0), q)
        return q * s

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code of each value of x (ties to the lower code)."""
        assert self.code is not None
        return (x[..., None] - self.code).abs().argmin(dim=-1)


@dataclass(frozen=True)
class GptqSettings:
    """damp: fraction of the mean Hessian diagonal added to it (numerical stability; the paper's
    1 %); block: columns per lazy-update block; act_order: quantize columns in decreasing
    order of their Hessian diagonal (largest input energy first)."""

    damp: float = 0.01
    block: int = 128
    act_order: bool = False


def gptq_quantize(
    weight: torch.Tensor,  # [out, in], any float dtype
    hessian: torch.Tensor,  # [in, in] float32 from HessianAccumulator
    grid: Grid,
    settings: GptqSettings = GptqSettings(),
) -> torch.Tensor:  # [out, in] float32, every value on the grid
    """The quantized weight; grids that need it (Nf4BlockGrid with act_order) must be built
    with static scales."""
    w = weight.detach().float().clone()
    out, cols = w.shape
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    grid.prepare(w)
    perm = torch.arange(cols, device=w.device)
    if settings.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
    h = h[perm][:, perm]
    h.diagonal().add_(settings.damp * float(torch.diag(h).mean()))
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to the later ones.
    u = _inverse_cholesky(h)  # [in, in]
    w_perm = w[:, perm]  # working copy in processing order
    q_perm = torch.zeros_like(w_perm)
    inverse = torch.argsort(perm)
    for start in range(0, cols, settings.block):
        stop = min(start + settings.block, cols)
        err = torch.zeros(out, stop - start, dtype=torch.float32, device=w.device)
        for i in range(start, stop):
            col = int(perm[i])
            if not settings.act_order:
                # Scales that follow the updated weights see them in original order (== here).
                grid.begin_column(w_perm, col)
            column = w_perm[:, i]
            q = grid.quantize(column, col)
            q_perm[:, i] = q
            e = (column - q) / u[i, i]  # [out]
            # Spread this column's error over the rest of the block now, and the rest of the
            # matrix once per block (the lazy batch update of the paper).
            w_perm[:, i + 1 : stop] -= e[:, None] * u[i, i + 1 : stop][None, :]
            err[:, i - start] = e
        w_perm[:, stop:] -= err @ u[start:stop, stop:]
    return q_perm[:, inverse]


def _inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of h^-1, adding more damping if h is not positive definite."""
    extra = 0.0
    mean = float(torch.diag(h).mean())
    for _ in range(6):
        try:
            lower = torch.linalg.cholesky(h + extra * mean * torch.eye(h.shape[0], device=h.device))
            inv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inv, upper=True)
        except torch.linalg.LinAlgError:
            extra = 0.01 if extra == 0.0 else extra * 10
    raise ValueError("GPTQ: the Hessian is not positive definite even with 10x damping")


def rtn_quantize(weight: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Round-to-nearest onto the same grid (the baseline GPTQ improves on), [out, in] float32."""
    w = weight.detach().float().clone()
    grid.prepare(w)
    q = torch.empty_like(w)
    for col in range(w.shape[1]):
        grid.begin_column(w, col)
        q[:, col] = grid.quantize(w[:, col], col)
    return q
