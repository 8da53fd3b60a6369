"""Fallback for any `transformers` AutoModelForCausalLM architecture we have no own code for.

Correct, not fast: its "KV cache" is a paged pool of TOKEN IDS laid out exactly like a real KV
cache (same router-owned blocks and slots). Each step writes the new tokens into their slots, then
recomputes every sequence's whole context with the reference model and keeps the logits of the new
tokens. It is replicated, not sharded, under tensor parallelism (every rank computes the same).
"""

from __future__ import annotations

import torch

from shard.attention.base import AttentionMetadata
from shard.models.base import LoadContext
from shard.quantization.kv_cache import KvScales


class HFFallbackForCausalLM:
    attention_name = "transformers"  # attention runs inside the reference model
    supports_lora = False  # its linears are transformers' own

    def __init__(self, ctx: LoadContext):
        import transformers

        cfg = ctx.config
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(ctx.model_dir), dtype=ctx.dtype, trust_remote_code=False
        )
        self.model.to(ctx.device).eval()
        self.device = ctx.device
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings: int = (
            cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048
        )
        self.sliding_window: int | None = cfg.get("sliding_window")

    def begin_kv_calibration(self) -> bool:
        return False  # its cache holds token ids: nothing to calibrate

    def finish_kv_calibration(self, headroom: float | None = None) -> list[KvScales]:
        return []

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * 8  # one int64 token id per slot

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] (implied by the context; unused)
        kv_cache: torch.Tensor,  # [num_blocks, block_size] int64 token ids
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        block_size = kv_cache.shape[1]
        kv_cache.view(-1).index_copy_(0, meta.slot_mapping, input_ids)
        wanted = set(logits_indices.tolist())
        rows: dict[int, torch.Tensor] = {}
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            needed = [r for r in range(start, start + q_len) if r in wanted]
            if needed:
                num_blocks = -(-seq_len // block_size)
                blocks = meta.block_tables[i, :num_blocks].long()
                context = kv_cache[blocks].flatten()[:seq_len]  # [seq_len]
                logits = self.model(input_ids=context.unsqueeze(0)).logits[0]  # [seq_len, vocab]
                for r in needed:
                    rows[r] = logits[seq_len - q_len + (r - start)]
            start += q_len
        return torch.stack([rows[r] for r in logits_indices.tolist()]).float()
