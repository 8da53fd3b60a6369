"""CUDA graphs for decode steps: one self-contained recipe (example 8 of ../shared/DESIGN.md).

- static device buffers sized for the largest bucket (input ids, positions, slot mapping, sequence
  lengths, block tables at the widest table a request can have, the logits);
- batch-size buckets; graphs captured largest first into ONE memory pool, so smaller graphs reuse
  the larger ones' intermediate memory;
- on replay the step is padded up to the next bucket: padding rows have sequence length 0 (the
  decode kernel writes zeros for them) and slot -1 (the K/V store skips them), so they touch no
  real cache block;
- the host fills one pinned staging buffer and issues ONE host-to-device copy; unpacking it into
  the typed static buffers is the first part of the captured graph;
- prefill and mixed steps, larger batches and wider block tables run eagerly;
- with LoRA slots (--max-loras > 0) each bucket is captured twice: without adapters (the base
  path, untouched) and with the batched LoRA kernels reading each row's slot from a static
  buffer (-1 for base rows and padding), so a step mixing adapters replays a graph too.
- verify steps of speculative decoding (each request computes its last token plus up to k draft
  tokens) replay graphs of a fixed `query_len` Q = 1 + k per request: request i's tokens sit at
  rows [i * Q, i * Q + q_i) of the flat batch, its sequence length is declared as start_i + Q so
  that the attention kernel places them at their true positions (causal attention keeps the
  padding tokens after them invisible to them), and padding tokens are written nowhere (slot -1)
  and read at position 0. The logits of all n * Q rows come back; the caller picks its rows.

The graph bakes in the KV cache's addresses: capture after the final KV allocation.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shard.attention.base import AttentionMetadata
from shard.lora import LoraBatch

log = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 64, every 32 up to 256, every 64 beyond (and max_batch)."""
    sizes = [1, 2, 4, 8]
    b = 16
    while b <= max_batch:
        sizes.append(b)
        b += 16 if b < 64 else 32 if b < 256 else 64
    sizes = [s for s in sizes if s <= max_batch]
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def fits_short_graph(limit: int, seq_lens: list[int]) -> bool:
    """Whether a decode step of these context lengths replays its bucket's short-context graph
    (limit: the bound that graph was captured with, 0: none)."""
    return limit > 0 and max(seq_lens) <= limit


class CudaGraphDecodeRunner:
    """Captures `forward` for decode-only batches and replays it with padded inputs."""

    def __init__(
        self,
        forward: ForwardFn,
        device: torch.device,
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        buckets: list[int] | None = None,
        lora: LoraBatch | None = None,
        query_len: int = 1,  # tokens per request: 1 for decode, 1 + k for verify steps
        # Batch size -> positions up to which a decode step takes the attention backend's
        # short-context launch (AttentionBackend.short_decode_context; 0: none): those buckets
        # get a second graph, captured with max_seq_len at that bound, replayed when every
        # context of the step fits it. Plain decode graphs only (not LoRA, not verify).
        short_context: Callable[[int], int] | None = None,
    ):
        self.forward = forward
        self.device = device
        self.block_size = block_size
        self.buckets = buckets or default_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.query_len = q = query_len
        # Verify steps declare sequences up to Q - 1 positions longer than their real length.
        self.width = max(max_blocks_per_seq, 1)
        b, w = self.max_batch, self.width
        # LoRA slots (decode runners only: verify runners run adapters eagerly, see ModelRunner).
        assert lora is None or q == 1, "LoRA graphs are captured for decode runners only"
        self.lora = lora
        t = b * q  # token rows
        # Staging layout (int64): ids[t] | positions[t] | slots[t] | seq_lens[b] | tables[b*w]
        # | lora slots[t] (with LoRA)
        self._n_staged = 3 * t + b + b * w + (t if lora is not None else 0)
        # Two pinned staging buffers, used in turn: with overlapping steps the host fills the
        # next step's buffer while the previous step's copy may not have run yet.
        self._hosts = [
            torch.zeros(self._n_staged, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self._copied: list[Any] = [None, None]  # event after the last copy out of each buffer
        self._turn = 0
        self._host = self._hosts[0]
        self._host_np = self._host.numpy()
        self._staged = torch.zeros(self._n_staged, dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((b, w), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device) * q
        self.logits_indices = torch.arange(t, dtype=torch.int64, device=device)
        self.lora_slots = torch.full((t,), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # The same buckets with the LoRA kernels on (with LoRA slots only).
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        # (No entry where the bucket's own graph is captured within the bound: it takes the short
        # launch itself, see AttentionBackend.short_decode_context.)
        self.short_limits = {n: limit for n in self.buckets
                             if 0 < (limit := short_context(n) if short_context else 0)
                             < self.width * block_size}
        self.short_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.short_outputs: dict[int, torch.Tensor] = {}
        self.last_short = False  # whether the last replay was a short-context graph

    # ---- capture ----------------------------------------------------------------------------

    def _unpack(self, n: int) -> None:
        """Device-side copies from the staging buffer into the typed buffers (first n rows)."""
        b, w, s, q = self.max_batch, self.width, self._staged, self.query_len
        t, big = n * q, b * q
        self.input_ids[:t].copy_(s[0:t])
        self.positions[:t].copy_(s[big : big + t])
        self.slot_mapping[:t].copy_(s[2 * big : 2 * big + t])
        self.seq_lens[:n].copy_(s[3 * big : 3 * big + n])
        tables = 3 * big + b
        self.block_tables[:n].copy_(s[tables : tables + n * w].view(n, w))
        if self.lora is not None:  # q == 1: one slot per request
            at = tables + b * w
            self.lora_slots[:n].copy_(s[at : at + n])

    def _meta(self, n: int, short: bool = False) -> AttentionMetadata:
        q = self.query_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[: n * q],
            max_query_len=q,
            max_seq_len=self.short_limits[n] if short else self.width * self.block_size,
            query_lens_host=[q] * n,
            seq_lens_host=[1] * n,  # only the count matters to the CUDA backend
        )

    def _run(self, n: int, with_lora: bool = False, short: bool = False) -> torch.Tensor:
        self._unpack(n)
        if self.lora is not None:
            if with_lora:
                self.lora.set_device_rows(self.lora_slots[:n])
            else:
                self.lora.clear()
        t = n * self.query_len
        return self.forward(
            self.input_ids[:t], self.positions[:t], self._meta(n, short), self.logits_indices[:t]
        )

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> float:
        """Captures every bucket, largest first, into one pool (`pool`, e.g. another runner's,
        or a new one); returns seconds taken."""
        import time

        t0 = time.perf_counter()
        # Safe inputs for capture: nothing is written (slot -1), nothing is read (length 0).
        self._host_np[:] = 0
        big = self.max_batch * self.query_len
        self._host_np[2 * big : 3 * big] = -1
        if self.lora is not None:  # every row reads slot 0: the LoRA kernels run in full
            self._host_np[3 * big + self.max_batch + self.max_batch * self.width :] = 0
        self._staged.copy_(self._host)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compilation, cuBLAS handles, allocator
                for with_lora in self._variants():
                    self._run(self.max_batch, with_lora)
            # Then every bucket once: a kernel first met inside a capture (a Triton
            # specialization or split count of a smaller batch, a cuBLAS kernel loaded lazily)
            # loads its module there, which invalidates the capture.
            for n in self.buckets:
                for with_lora in self._variants():
                    self._run(n, with_lora)
                if n in self.short_limits:
                    self._run(n, short=True)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for n in sorted(self.buckets, reverse=True):
            for with_lora in self._variants():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._run(n, with_lora)
                (self.lora_outputs if with_lora else self.outputs)[n] = out
                (self.lora_graphs if with_lora else self.graphs)[n] = graph
            if n in self.short_limits:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.short_outputs[n] = self._run(n, short=True)
                self.short_graphs[n] = graph
        if self.lora is not None:
            self.lora.clear()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (batch %d..%d, %d tokens each) in %.1f s",
                 len(self.graphs) + len(self.lora_graphs) + len(self.short_graphs),
                 self.buckets[0], self.max_batch,
                 self.query_len, seconds)
        return seconds

    def _variants(self) -> tuple[bool, ...]:
        return (False, True) if self.lora is not None else (False,)

    # ---- replay -----------------------------------------------------------------------------

    def can_run(self, query_lens: list[int], block_tables: list[list[int]]) -> bool:
        n = len(query_lens)
        q = self.query_len
        return (
            bool(self.graphs)
            and 0 < n <= self.max_batch
            and (all(x == 1 for x in query_lens) if q == 1 else max(query_lens) <= q)
            and max(len(t) for t in block_tables) <= self.width
        )

    def _next_host(self) -> None:
        """Switches to the other staging buffer, once the copy that last read it has run."""
        self._turn ^= 1
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        self._host = self._hosts[self._turn]
        self._host_np = self._host.numpy()

    def _copy_queued(self) -> None:
        if self._staged.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        lora_slots: list[int] | None = None,  # [n] slot per row, -1: base model
        placeholders: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows, ids) [p]
    ) -> torch.Tensor:  # [n, vocab] — a view of a static buffer, valid until the next replay
        self._next_host()
        n = len(token_ids)
        g = self.bucket(n)
        b, w, h, bs = self.max_batch, self.width, self._host_np, self.block_size
        h[0:n] = token_ids
        h[b : b + n] = positions
        h[2 * b + n : 2 * b + g] = -1  # padding rows: no K/V write
        h[3 * b : 3 * b + n] = seq_lens
        h[3 * b + n : 3 * b + g] = 0  # padding rows: empty context
        tables = h[4 * b : 4 * b + g * w].reshape(g, w)
        # All rows at once: one flat C-level pass over the ids, scattered under a ragged mask
        # (entries past a row's length keep stale ids; seq_lens bounds what is read).
        lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)  # [n]
        flat = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lens.sum())
        )
        tables[:n][np.arange(w) < lens[:, None]] = flat
        # Slots [n] from each row's token index, seq_len - 1: its rotary position may differ
        # (M-RoPE models decode at index + rope_delta).
        idx = h[3 * b : 3 * b + n] - 1
        h[2 * b : 2 * b + n] = tables[np.arange(n), idx // bs] * bs + idx % bs
        with_lora = (
            self.lora is not None and lora_slots is not None and any(s >= 0 for s in lora_slots)
        )
        if with_lora:
            at = 4 * b + b * w
            h[at : at + n] = lora_slots
            h[at + n : at + g] = -1  # padding rows: no adapter
        # One H2D copy of the used prefix of each section is simplest as one copy of it all.
        self._staged.copy_(self._host, non_blocking=True)
        self._copy_queued()
        if placeholders is not None:  # token ids at the head of the staging buffer
            self._staged.index_copy_(0, placeholders[0], placeholders[1])
        self.last_short = False
        if with_lora:
            self.lora_graphs[g].replay()
            return self.lora_outputs[g][:n]
        if fits_short_graph(self.short_limits.get(g, 0), seq_lens):
            self.last_short = True
            self.short_graphs[g].replay()
            return self.short_outputs[g][:n]
        self.graphs[g].replay()
        return self.outputs[g][:n]

    def run_ragged(
        self,
        token_ids: list[int],  # [num_tokens] request i's tokens at query_lens[i] consecutive rows
        positions: list[int],  # [num_tokens]
        query_lens: list[int],  # [n] each <= query_len
        seq_lens: list[int],  # [n] real context lengths incl. the new tokens
        block_tables: list[list[int]],
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Replays the verify graph of a step whose requests compute up to query_len tokens.
        Returns the logits of every padded row ([bucket * query_len, vocab], a view of a static
        buffer valid until the next replay) and, for each of the step's tokens, its row there."""
        q = self.query_len
        n = len(query_lens)
        g = self.bucket(n)
        b, w, h, bs = self.max_batch, self.width, self._host_np, self.block_size
        big, t = b * q, g * q
        q_lens = np.asarray(query_lens, dtype=np.int64)  # [n]
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        seq_of = np.repeat(np.arange(n), q_lens)  # [num_tokens]
        rows = seq_of * q + np.arange(int(starts[-1])) - starts[:-1][seq_of]  # padded row
        h[0:t] = 0
        h[big : big + t] = 0  # padding tokens at position 0, written nowhere
        h[2 * big : 2 * big + t] = -1
        h[rows] = token_ids
        pos = np.asarray(positions, dtype=np.int64)
        h[big + rows] = pos
        seq = np.asarray(seq_lens, dtype=np.int64)
        h[3 * big : 3 * big + n] = seq - q_lens + q  # start + Q: true positions for the tokens
        h[3 * big + n : 3 * big + g] = 0  # padding requests: empty
        tables = h[3 * big + b : 3 * big + b + g * w].reshape(g, w)
        lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)  # [n]
        flat = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lens.sum())
        )
        tables[:n][np.arange(w) < lens[:, None]] = flat
        # Slots of real tokens, from their token indices (not their rotary positions: M-RoPE).
        idx = (seq - q_lens)[seq_of] + np.arange(int(starts[-1])) - starts[:-1][seq_of]
        h[2 * big + rows] = tables[seq_of, idx // bs] * bs + idx % bs
        self._staged.copy_(self._host, non_blocking=True)
        self.graphs[g].replay()
        return self.outputs[g], rows
