"""The CUDA attention backend: Triton paged kernels, flash-attn when a user has it installed.

- write_kv: slot-mapped Triton store (negative slots are skipped, so CUDA-graph padding rows are
  harmless); rotate_and_write_kv does the rotary embedding in the same kernel;
- decode-only steps: Triton split-KV paged decode (all query heads of a KV head together);
  rotate_write_and_attend_decode does rotary, the cache store and decode attention in the split
  kernel itself (one launch fewer per layer than rotate_and_write_kv + attend, same results);
- steps with prefill chunks: flash-attn's paged varlen kernel when importable and the cache
  block size suits it (a multiple of 256), else the Triton paged prefill kernel for the chunks
  (it covers chunks that attend to already-cached blocks) and the decode kernel for the decode
  rows riding in the step (shard/attention/mixed_step.py).

Nothing here syncs with the host: the metadata's device tensors drive the kernels, and the
number of decode splits depends only on the batch size so a captured graph stays valid.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from shard.attention.base import AttentionBackend, AttentionMetadata, Rotary
from shard.attention.mixed_step import MixedSplit, prefill_tile_map, split_trailing_decodes
from shard.kernels.head_norms import HeadNorms
from shard.quantization.kv_cache import KvScales


def _scale_tensors(
    kv_scales: KvScales | None, num_kv_heads: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-KV-head scale tensors for the kernels (floats broadcast; None: no scales)."""
    if kv_scales is None:
        return None, None

    def tensor(x: float | torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        return torch.full((num_kv_heads,), float(x), dtype=torch.float32, device=device)

    return tensor(kv_scales.k_scale), tensor(kv_scales.v_scale)


# Splits of a mixed step's decode rows when they are too few to fill the SMs (see
# CudaAttentionBackend._mixed_decode_splits); default_num_splits' cap.
MIXED_DECODE_SPLITS = 16


def flash_attn_available() -> bool:
    """True when the optional flash-attn package is importable (it is never required)."""
    return importlib.util.find_spec("flash_attn") is not None


@dataclass(frozen=True)
class DecodeTiling:
    """A decode-only step's split-kernel launch (shard/kernels/attention_decode.py) where the
    step has few (sequence, KV head) programs: batch 1 of a 4-KV-head model (Qwen3-30B-A3B) is
    4, so the split count and tile decide how many programs are in flight and how long each
    one's chain of dependent loads is. None fields: the kernel's defaults."""

    max_programs: int  # applies where num_seqs * num_kv_heads <= this
    num_splits: int | None = None
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def name(self) -> str:
        return (f"s{self.num_splits or 'def'}-n{self.block_n or 'def'}-w{self.num_warps}"
                f"-st{self.num_stages}")


@dataclass(frozen=True)
class ShortDecode:
    """The decode launch of steps whose contexts all fit max_context positions, at batches up to
    max_batch (short_decode_context: the graph runner captures a graph of its own for them).
    Why: at batch 1 of 4 KV heads the kernel's 16 splits of a 512-position context with the
    64-position tile leave 8 splits busy with one tile each; 32-position tiles keep all 16 busy.
    In the Qwen3-30B-A3B step (H200, benchmarks/MOE_B1.md rounds 18-19) that tiling
    (s16-n32-w4-st3) was -2 us a layer at context 512 but lost 12-43 % alone at 4-16 K, and one
    kernel holding both tile widths lost in the step, hence a graph per context class."""

    max_context: int = 512
    max_batch: int = 1
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


class CudaAttentionBackend(AttentionBackend):
    """AttentionBackend for CUDA devices (see shard/attention/base.py for the contract)."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        use_flash_attn: bool | None = None,
        num_sms: int | None = None,  # None: the device's (Triton-interpreter tests pass one)
    ):
        from shard.kernels import attention_decode, attention_prefill  # lazy: triton on CUDA only

        self._decode = attention_decode
        self._prefill = attention_prefill
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
        self._num_sms = num_sms
        self._flash = flash_attn_available() if use_flash_attn is None else use_flash_attn
        self.name = "cuda-triton+flash-attn" if self._flash else "cuda-triton"
        # Decode reads only device tensors and its grid depends on the batch size alone, so
        # decode steps can be captured in CUDA graphs (shard/runner/cuda_graphs.py).
        self.graph_safe = True
        # Decode-only steps take rotate_write_and_attend_decode (one kernel for rotary, the cache
        # store and attention); benchmarks switch it off to compare with the two-kernel path.
        self.fuse_rotary_into_decode = True
        # ... and the per-head q/k RMSNorms before the rotation (attention_decode.HeadNorms).
        self.fuses_qk_norm_into_decode = True
        # Decode-only steps with few (sequence, KV head) programs take this tiling instead of
        # the kernel's defaults; None: the defaults everywhere. Set before any graph capture
        # (benchmarks/moe_b1_bench.py measures candidates side by side).
        self.few_program_decode: DecodeTiling | None = None
        # Decode-only steps whose contexts fit short_decode's bound take its launch (with CUDA
        # graphs: a graph of their own); None: off. On by default: the Qwen3-30B-A3B-shaped
        # batch-1 step at context 512 on an H200 (benchmarks/MOE_B1.md, round 20, three
        # interleaved pairs without the profiler): bf16 2.598-2.601 ms against 2.698-2.707,
        # fp8 1.929-1.938 against 1.971-1.986.
        self.short_decode: ShortDecode | None = ShortDecode()

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KvScales | None = None,  # fp8 caches: stored = x / scale per KV head
    ) -> None:
        k_scale, v_scale = (None, None)
        if key_cache.element_size() == 1:
            k_scale, v_scale = _scale_tensors(kv_scales, key_cache.shape[2], key.device)
        self._decode.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def rotate_and_write_kv(
        self, rotary: Rotary, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: KvScales | None = None,
    ) -> torch.Tensor:  # shapes: see AttentionBackend
        """rotary(q, k), then write_kv(k, v), as one kernel; returns the rotated query
        [num_tokens, num_heads, head_dim]. The cache holds exactly what the two steps store."""
        from shard.kernels.elementwise import rotary_store_kv

        k_scale, v_scale, fp8_max = None, None, 0.0
        if key_cache.element_size() == 1:
            k_scale, v_scale = _scale_tensors(kv_scales, key_cache.shape[2], key.device)
            fp8_max = float(torch.finfo(key_cache.dtype).max)
        return rotary_store_kv(positions, query, key, value, rotary.cos, rotary.sin, key_cache,
                               value_cache, slot_mapping, k_scale, v_scale, fp8_max)

    def rotate_write_and_attend_decode(
        self, rotary: Rotary, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, sliding_window: int | None,
        kv_scales: KvScales | None = None,  # fp8 caches: stored = x / scale per KV head
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
        warm: torch.Tensor | None = None,  # warmed into L2 by the decode kernel
        head_norms: HeadNorms | None = None,  # q/k RMSNorm per head before the rotation
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]; shapes: see AttentionBackend
        """rotate_and_write_kv then attend for a decode-only step (the caller checks
        meta.is_decode_only and one token per sequence), in one kernel plus the split merge:
        the same output and cache contents, bit for bit."""
        assert meta.is_decode_only and query.shape[0] == meta.seq_lens.shape[0]
        k_scale, v_scale = (None, None)
        if key_cache.element_size() == 1:
            k_scale, v_scale = _scale_tensors(kv_scales, key_cache.shape[2], key.device)
        return self._decode.rotary_store_decode_attention(
            query,
            key,
            value,
            positions,
            rotary.cos,
            rotary.sin,
            key_cache,
            value_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            scale,
            sliding_window,
            num_splits=self.num_decode_splits(query.shape[0], key_cache.shape[2]),
            k_scale=k_scale,
            v_scale=v_scale,
            softcap=softcap,
            warm=warm,
            head_norms=head_norms,
            **self._decode_tile_args(query.shape[0], key_cache.shape[2], meta.max_seq_len),
        )

    def num_decode_splits(self, num_seqs: int, num_kv_heads: int) -> int:
        tiling = self._few_program_tiling(num_seqs, num_kv_heads)
        if tiling is not None and tiling.num_splits is not None:
            return tiling.num_splits
        return self._decode.default_num_splits(num_seqs, num_kv_heads, self._num_sms)

    def _few_program_tiling(self, num_seqs: int, num_kv_heads: int) -> DecodeTiling | None:
        t = self.few_program_decode
        return t if t is not None and num_seqs * num_kv_heads <= t.max_programs else None

    def short_decode_context(self, num_seqs: int) -> int:
        s = self.short_decode
        if s is None or num_seqs > s.max_batch or self.few_program_decode is not None:
            return 0
        return s.max_context

    def _decode_tile_args(self, num_seqs: int, num_kv_heads: int,
                          max_seq_len: int) -> dict[str, int]:
        """block_n / num_warps / num_stages of few_program_decode where it applies, else of
        short_decode where the step's contexts fit its bound ({}: the kernel's defaults)."""
        t = self._few_program_tiling(num_seqs, num_kv_heads)
        if t is None:
            short = self.short_decode_context(num_seqs)
            if short and max_seq_len <= short and self.short_decode is not None:
                s = self.short_decode
                return {"block_n": s.block_n, "num_warps": s.num_warps,
                        "num_stages": s.num_stages}
            return {}
        args = {"num_warps": t.num_warps, "num_stages": t.num_stages}
        if t.block_n is not None:
            args["block_n"] = t.block_n
        return args

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: KvScales | None = None,  # fp8 caches: read value = stored * scale
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
        warm: torch.Tensor | None = None,  # decode-only steps: warmed into L2 by the kernel
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        k_scale, v_scale = (None, None)
        if key_cache.element_size() == 1:
            k_scale, v_scale = _scale_tensors(kv_scales, key_cache.shape[2], query.device)
        if meta.is_decode_only and query.shape[0] == meta.seq_lens.shape[0]:
            return self._decode.paged_decode_attention(
                query,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                sliding_window,
                num_splits=self.num_decode_splits(query.shape[0], key_cache.shape[2]),
                k_scale=k_scale,
                v_scale=v_scale,
                softcap=softcap,
                warm=warm,
                **self._decode_tile_args(query.shape[0], key_cache.shape[2], meta.max_seq_len),
            )
        if self._flash and key_cache.shape[1] % 256 == 0 and k_scale is None:
            return self._flash_prefill(query, key_cache, value_cache, meta, scale, sliding_window,
                                       softcap)
        return self._attend_mixed(query, key_cache, value_cache, meta, scale, sliding_window,
                                  k_scale, v_scale, softcap)

    def _attend_mixed(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """A step with prefill chunks: the chunks through the prefill kernel over their tiles,
        the trailing one-token rows through the decode kernel (shard/attention/mixed_step.py)."""
        split, tile_map = self._mixed_plan(meta, query.shape[2], query.device)
        out = torch.empty_like(query)
        p, t = split.prefill_seqs, split.prefill_tokens
        if p:
            self._prefill.paged_prefill_attention(
                query[:t], key_cache, value_cache, meta.block_tables[:p],
                meta.query_start_loc[: p + 1], meta.seq_lens[:p], meta.max_query_len, scale,
                sliding_window, out=out[:t], k_scale=k_scale, v_scale=v_scale, softcap=softcap,
                tile_map=tile_map,
            )
        if split.decode_seqs:
            self._decode.paged_decode_attention(
                query[t:], key_cache, value_cache, meta.block_tables[p:], meta.seq_lens[p:],
                scale, sliding_window,
                num_splits=self._mixed_decode_splits(split.decode_seqs, key_cache.shape[2]),
                out=out[t:], k_scale=k_scale, v_scale=v_scale, softcap=softcap,
            )
        return out

    def _mixed_decode_splits(self, num_seqs: int, num_kv_heads: int) -> int:
        """Split count for the decode rows of a mixed step: one once a (sequence, KV head)
        program per SM exists, else MIXED_DECODE_SPLITS. Two values only, unlike decode-only
        steps (default_num_splits, fixed per captured graph): Triton compiles a kernel per split
        count, and a compile in the middle of serving stalls that step for seconds; warmup runs
        both (mixed_warmup_decode_rows)."""
        return 1 if num_seqs * num_kv_heads >= self._num_sms else MIXED_DECODE_SPLITS

    def mixed_warmup_decode_rows(self) -> list[int]:
        # One row: MIXED_DECODE_SPLITS splits with the batch-1 early tile (the kernel's
        # EARLY_TILE); two rows: the same splits without it; one per SM: one split, whatever the
        # KV heads. (tests/gpu/test_kernel_compiles_cuda.py: nothing else compiles in serving.)
        return [1, 2, self._num_sms]

    def _mixed_plan(
        self, meta: AttentionMetadata, head_dim: int, device: torch.device
    ) -> tuple[MixedSplit, torch.Tensor]:
        """The step's split and its chunks' tile map ([2, num_tiles] int32 on the device), made
        at the first layer and kept in meta.derived for the others."""
        plan = meta.derived.get("cuda_mixed")
        if plan is None:
            split = split_trailing_decodes(meta.query_lens_host)
            p = split.prefill_seqs
            block_m = self._prefill.prefill_tiles(head_dim)[0]
            tiles = prefill_tile_map(meta.query_lens_host[:p], meta.seq_lens_host[:p], block_m)
            tile_map = torch.from_numpy(tiles)
            if device.type == "cuda":  # from pinned memory the copy does not wait for the device
                tile_map = tile_map.pin_memory().to(device, non_blocking=True)
            plan = meta.derived["cuda_mixed"] = (split, tile_map)
        return plan

    def _flash_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        # flash-attn >= 2.6 reads a paged cache through block_table (block size % 256 == 0).
        from flash_attn import flash_attn_varlen_func

        cu_k = torch.zeros(meta.seq_lens.shape[0] + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        return flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            meta.query_start_loc,
            cu_k,
            meta.max_query_len,
            meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            softcap=softcap or 0.0,  # flash-attn's soft-capping (0: none)
            block_table=meta.block_tables,
        )
