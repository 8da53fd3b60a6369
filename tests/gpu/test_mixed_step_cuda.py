"""Mixed steps on the GPU (shard/attention/mixed_step.py): chunks through the prefill kernel over
the tile map, the decode rows riding in the step through the decode kernel, bf16, against the
portable torch backend and against the whole batch through the prefill kernel (the old path).

Run on a GPU machine: `pytest -m gpu tests/gpu`. tests/shard/test_mixed_step_attention.py runs the
same code under Triton's interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("window", [None, 100])
def test_mixed_step_attention_matches_torch_and_the_whole_batch_prefill_kernel(window):
    from shard.attention.cuda_backend import CudaAttentionBackend
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.kernels.attention_prefill import paged_prefill_attention
    from shard.testing.paged_batch import random_paged_step

    # Llama-3-8B heads; chunks: 300 new over 500 cached, a fresh 37; then a one-token chunk (it
    # joins the trailing one-token rows) and 200 decode rows of 1..1,500 context
    gen = torch.Generator().manual_seed(1)
    decode_ctx = torch.randint(1, 1500, (200,), generator=gen).tolist()
    q_lens = [300, 37, 1] + [1] * 200
    seq_lens = [800, 37, 90] + decode_ctx
    q, cache, meta = random_paged_step(q_lens, seq_lens, 32, 8, 128, 16, "cuda", torch.bfloat16)
    scale = 128**-0.5
    got = CudaAttentionBackend("cuda", use_flash_attn=False).attend(q, *cache, meta, scale, window)
    split, tile_map = meta.derived["cuda_mixed"]
    assert (split.prefill_seqs, split.decode_seqs) == (2, 201)
    assert tile_map.shape[1] == 5 + 1
    want = TorchAttentionBackend().attend(q.float(), cache[0].float(), cache[1].float(), meta,
                                          scale, window)
    err = (got.float() - want).abs().max().item()
    assert err < 2e-2, err
    whole = paged_prefill_attention(q, *cache, meta.block_tables, meta.query_start_loc,
                                    meta.seq_lens, meta.max_query_len, scale, window)
    assert (got.float() - whole.float()).abs().max().item() < 2e-2
