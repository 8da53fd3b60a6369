"""ModelRunner: owns the model, its paged KV cache and the attention backend; turns a host-side
step description into tensors and runs one forward pass.

The CUDA-graph runner wraps `forward` for decode-only steps, and (speculative decoding) for verify
steps in which every request computes at most 1 + k tokens; everything the eager path needs
(flat input ids, positions, AttentionMetadata, logits indices) is built by `prepare`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shard.attention.base import AttentionBackend, AttentionMetadata
from shard.lora import LoraBatch
from shard.models.base import CausalLM, VisionLM
from shard.runner.images import EncoderCache, StepImage, image_embeds


@dataclass
class StepInputs:
    """One flat ragged step on the host: num_seqs sequences, num_tokens new tokens."""

    token_ids: list[int]  # [num_tokens]
    positions: list[int]  # [num_tokens]
    query_lens: list[int]  # [num_seqs] new tokens per sequence
    seq_lens: list[int]  # [num_seqs] context length incl. the new tokens
    block_tables: list[list[int]]  # [num_seqs][blocks] router-assigned block ids
    logits_indices: list[int]  # [num_logits] rows of the flat batch whose logits are needed
    # [num_seqs] LoRA slot of each sequence (-1: base model); None: no adapter in the step.
    lora_slots: list[int] | None = None
    # Image rows of prefill chunks (vision-language models); empty for text-only steps.
    images: list[StepImage] = field(default_factory=list)
    # [3, num_tokens] M-RoPE positions (Qwen2-VL prompts with images) replacing `positions`.
    rope_positions: np.ndarray | None = None


# (rows [p] int64, token ids [p] int64) on the device: inputs known only to the device.
Placeholders = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DeviceStep:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, or [3, num_tokens] (M-RoPE)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64


class ModelRunner:
    def __init__(
        self, model: CausalLM, attention: AttentionBackend, block_size: int, device: torch.device
    ):
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        self.kv_cache: Any = None
        self.num_blocks = 0
        # Vision encoder outputs by image content hash (vision-language models only).
        self.encoder_cache = EncoderCache()
        self.graphs: Any = None  # shard.runner.cuda_graphs.CudaGraphDecodeRunner once captured
        # The model's per-step LoRA slots (shard/lora) when --max-loras > 0; prepare sets it.
        self.lora: LoraBatch | None = None
        # Verify-step graphs by tokens per request (2 .. 1 + k), once captured.
        self.verify_graphs: dict[int, Any] = {}
        # How `execute` ran the last step: "decode_graph", "verify_graph" or "eager" (read by
        # benchmarks and tests: a step without drafts must replay the plain decode graph).
        self.last_path = ""

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (after warmup captured them): a CUDA device,
        a graph-safe attention backend and a model that declares itself graph-safe."""
        return (self.device.type == "cuda" and self.attention.graph_safe
                and self.model.cuda_graph_safe)

    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.graphs = None  # captured graphs hold the old pool's addresses
        self.verify_graphs = {}
        self.kv_cache = None  # drop the old pool first so its memory can be reused
        self.kv_cache = self.model.allocate_kv_cache(num_blocks, self.block_size)
        self.num_blocks = num_blocks

    def prepare(self, step: StepInputs) -> DeviceStep:
        bs = self.block_size
        n = len(step.seq_lens)
        # Block tables: one flat C-level pass over the ids, scattered into a zero-padded
        # [num_seqs, width] array under a ragged mask (no per-row Python lists).
        t_lens = np.fromiter(map(len, step.block_tables), dtype=np.int64, count=n)  # [num_seqs]
        width = int(t_lens.max(initial=0)) or 1
        flat = np.fromiter(
            itertools.chain.from_iterable(step.block_tables), dtype=np.int64,
            count=int(t_lens.sum()),
        )
        tables = np.zeros((n, width), dtype=np.int32)
        tables[np.arange(width) < t_lens[:, None]] = flat
        q_lens = np.asarray(step.query_lens, dtype=np.int64)  # [num_seqs]
        seq_lens = np.asarray(step.seq_lens, dtype=np.int64)  # [num_seqs]
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        # Slot of every new token: position p of sequence s is in block tables[s, p // bs].
        seq_of = np.repeat(np.arange(n), q_lens)  # [num_tokens]
        p = (seq_lens - q_lens)[seq_of] + np.arange(int(starts[-1])) - starts[:-1][seq_of]
        blk = p // bs
        if blk.size and not (blk < t_lens[seq_of]).all():
            raise IndexError("a sequence's block table is shorter than its length")
        slots = tables[seq_of, blk].astype(np.int64) * bs + p % bs  # [num_tokens]

        if self.lora is not None:
            if step.lora_slots is not None and any(s >= 0 for s in step.lora_slots):
                # [num_tokens]: every token row of a sequence uses its sequence's adapter
                self.lora.set_rows(np.repeat(np.asarray(step.lora_slots), q_lens).tolist(),
                                   self.device)
            else:
                self.lora.clear()

        def dev(values, dtype: torch.dtype) -> torch.Tensor:
            if not isinstance(values, np.ndarray):
                # Python ints through numpy: torch.tensor(list) costs ~1 us an element, which
                # was half of this method's time for a 1,000-row mixed step.
                values = np.asarray(values, dtype=np.int64)
            t = torch.from_numpy(values).to(dtype)
            if self.device.type == "cuda":
                # From pinned memory the copy is queued; from pageable memory it may wait for
                # the step still running on the device (overlapped steps).
                t = t.pin_memory()
            return t.to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=dev(starts, torch.int32),
            seq_lens=dev(step.seq_lens, torch.int32),
            block_tables=dev(tables, torch.int32).view(n, width),
            slot_mapping=dev(slots, torch.int64),
            max_query_len=max(step.query_lens, default=0),
            max_seq_len=max(step.seq_lens, default=0),
            query_lens_host=list(step.query_lens),
            seq_lens_host=list(step.seq_lens),
        )
        return DeviceStep(
            input_ids=dev(step.token_ids, torch.int64),
            positions=dev(step.positions if step.rope_positions is None
                          else step.rope_positions, torch.int64),
            meta=meta,
            logits_indices=dev(step.logits_indices, torch.int64),
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated (Warmup has not run)")
        return self.model.forward(input_ids, positions, self.kv_cache, meta, logits_indices)

    def capture_cuda_graphs(self, max_batch: int, max_seq_len: int) -> float:
        """Captures decode CUDA graphs (shard/runner/cuda_graphs.py) for batches up to max_batch and
        contexts up to max_seq_len; call after the final KV allocation. Returns seconds taken;
        0 when the attention backend cannot run inside a graph (it needs host-side lengths) or
        the model declares itself eager (host syncs: MoE loops, bitsandbytes)."""
        if not self.uses_cuda_graphs:
            return 0.0
        from shard.runner.cuda_graphs import CudaGraphDecodeRunner

        graphs = CudaGraphDecodeRunner(
            self.forward, self.device, self.block_size, max_batch,
            -(-max_seq_len // self.block_size), lora=self.lora,
            short_context=self.attention.short_decode_context,
        )
        seconds = graphs.capture()
        self.graphs = graphs
        return seconds

    def capture_verify_graphs(self, max_query_len: int, max_batch: int, max_seq_len: int) -> float:
        """Captures verify-step graphs (speculative decoding: up to max_query_len tokens per
        request, batches up to max_batch) in the decode graphs' memory pool; returns seconds.
        0 without CUDA graphs (CPU, or a backend that cannot run inside one)."""
        if not self.uses_cuda_graphs or self.graphs is None:
            return 0.0
        from shard.runner.cuda_graphs import CudaGraphDecodeRunner, default_buckets

        seconds = 0.0
        buckets = [b for b in default_buckets(max_batch) if b <= max_batch]
        for q in range(max_query_len, 1, -1):
            graphs = CudaGraphDecodeRunner(
                self.forward, self.device, self.block_size, max_batch,
                -(-(max_seq_len + q) // self.block_size), buckets=buckets, query_len=q,
            )
            seconds += graphs.capture(pool=self.graphs.pool)
            self.verify_graphs[q] = graphs
        return seconds

    def execute_calibrating(self, step: StepInputs) -> torch.Tensor:
        """Runs a step eagerly; a model with an fp8 KV cache records each layer's K/V range on
        the way and sets its cache scales from it (warmup's worst-case prefill)."""
        calibrating = self.model.begin_kv_calibration()
        try:
            d = self.prepare(step)
            out = self.forward(d.input_ids, d.positions, d.meta, d.logits_indices)
        finally:
            if calibrating:
                self.model.finish_kv_calibration()
        return out

    def execute(
        self, step: StepInputs, placeholders: Placeholders | None = None
    ) -> torch.Tensor:
        """Runs the step: [num_logits, vocab]. placeholders: (rows, ids), device tensors [p]:
        input token rows whose ids are only on the device (the previous step's samples, when
        steps overlap); step.token_ids holds anything at those rows."""
        # image rows and 3-D positions: always eager
        g = None if step.images or step.rope_positions is not None else self.graphs
        if (
            g is not None
            and g.can_run(step.query_lens, step.block_tables)
            and step.logits_indices == list(range(len(step.query_lens)))
        ):  # decode-only: replay the padded graph ([num_seqs, vocab], valid until next step)
            self.last_path = "decode_graph"
            return g.run(step.token_ids, step.positions, step.seq_lens, step.block_tables,
                         step.lora_slots, placeholders)
        # Verify graphs carry no LoRA slots: steps with adapter rows run eagerly.
        if (
            self.verify_graphs
            and placeholders is None
            and not step.images
            and step.rope_positions is None
            and not any(x >= 0 for x in step.lora_slots or ())
        ):
            v = self.verify_graphs.get(max(step.query_lens, default=0))
            if v is not None and v.can_run(step.query_lens, step.block_tables):
                # Short rows (verify steps): the padded graph, then this step's logits rows.
                self.last_path = "verify_graph"
                logits, rows = v.run_ragged(step.token_ids, step.positions, step.query_lens,
                                            step.seq_lens, step.block_tables)
                pick = torch.from_numpy(rows[np.asarray(step.logits_indices, dtype=np.int64)])
                return logits.index_select(0, pick.to(self.device, non_blocking=True))
        self.last_path = "eager"
        d = self.prepare(step)
        if placeholders is not None:
            d.input_ids.index_copy_(0, placeholders[0], placeholders[1])
        if step.images:
            return self._forward_images(d, step.images)
        return self.forward(d.input_ids, d.positions, d.meta, d.logits_indices)

    def image_token_count(self, shape: tuple[int, ...]) -> int | None:
        """Embedding rows the model's vision encoder yields for pixel values of this shape
        (None: not a shape it takes, or a text-only model)."""
        if not self.model.supports_images:
            return None
        model: VisionLM = self.model  # type: ignore[assignment]
        return model.image_token_count(shape)

    def _forward_images(self, d: DeviceStep, images: list[StepImage]) -> torch.Tensor:
        """An eager step whose chunks hold image placeholders: the images' embeddings (encoded
        now or found in the encoder cache) replace the placeholder rows' token embeddings."""
        model: VisionLM = self.model  # type: ignore[assignment]  # supports_images: checked
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated (Warmup has not run)")
        embeds = image_embeds(images, model, self.encoder_cache, self.device)
        return model.forward(d.input_ids, d.positions, self.kv_cache, d.meta, d.logits_indices,
                             image_embeds=embeds)  # type: ignore[call-arg]
