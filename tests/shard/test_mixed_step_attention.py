"""Mixed steps on the CUDA attention backend (shard/attention/mixed_step.py): the prefill chunks go
to the prefill kernel over a flat tile map, the trailing decode rows to the decode kernel.

The host-side split and tile map are checked directly; the backend's `attend` on a mixed batch
runs under Triton's interpreter on CPU tensors (float32), against the portable torch backend.
tests/gpu/test_mixed_step_cuda.py checks the compiled kernels in bf16.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from shard.attention.mixed_step import prefill_tile_map, split_trailing_decodes
from tests.helpers.triton_interpreter import INTERPRETER_MARKS, run_interpreted


@pytest.mark.parametrize(
    "query_lens, prefill_seqs, prefill_tokens",
    [
        ([20, 30, 1, 1, 1], 2, 50),  # chunks, then decode rows
        ([20, 1, 30, 1], 3, 51),  # a one-token chunk among the chunks stays a chunk
        ([1, 1, 1], 0, 0),  # all one-token rows
        ([5, 7], 2, 12),  # no decode rows
    ],
)
def test_trailing_one_token_rows_split_off(query_lens, prefill_seqs, prefill_tokens):
    split = split_trailing_decodes(query_lens)
    assert (split.prefill_seqs, split.prefill_tokens) == (prefill_seqs, prefill_tokens)
    assert split.decode_seqs == len(query_lens) - prefill_seqs


def test_tile_map_lists_every_tile_once_heaviest_first():
    query_lens, seq_lens, block_m = [100, 3, 64, 130], [100, 53, 264, 130], 64
    tiles = prefill_tile_map(query_lens, seq_lens, block_m)
    assert tiles.dtype == np.int32 and tiles.shape == (2, 2 + 1 + 1 + 3)
    pairs = sorted(zip(tiles[0].tolist(), tiles[1].tolist()))
    assert pairs == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2)]
    # keys attended per tile: context + rows up to the tile's last
    ctx = np.asarray(seq_lens) - np.asarray(query_lens)
    keys = [ctx[s] + min((t + 1) * block_m, query_lens[s]) for s, t in zip(*tiles.tolist())]
    assert keys == sorted(keys, reverse=True)
    assert (tiles[0, 0], tiles[1, 0]) == (2, 0)  # 200 cached + 64


_CHECK = textwrap.dedent(
    """
    from shard.attention.cuda_backend import CudaAttentionBackend
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.testing.paged_batch import random_paged_step

    # chunks: 70 new tokens over 30 cached (two 64-row tiles), a 1-token chunk, 9 fresh;
    # then three decode rows
    q_lens = [70, 1, 9, 1, 1, 1]
    seq_lens = [100, 40, 9, 33, 17, 60]
    q, cache, meta = random_paged_step(q_lens, seq_lens, 4, 2, 32, 16)
    backend = CudaAttentionBackend("cpu", use_flash_attn=False, num_sms=2)
    reference = TorchAttentionBackend()
    for window in (None, 24):
        want = reference.attend(q, *cache, meta, 0.2, window)
        got = backend.attend(q, *cache, meta, 0.2, window)
        err = float((got - want).abs().max())
        assert err < 2e-5, (window, err)
    split, tile_map = meta.derived["cuda_mixed"]
    assert (split.prefill_seqs, split.prefill_tokens, split.decode_seqs) == (3, 80, 3)
    assert tile_map.shape == (2, 4)
    # warmup's mixed steps reach every decode variant a mixed step can pick, whatever the heads:
    # its split count and whether the batch-1 early tile is on (the kernel's EARLY_TILE)
    for sms in (2, 132):
        backend._num_sms = sms
        rows = backend.mixed_warmup_decode_rows()
        for kv_heads in (1, 8):
            def variant(r):
                return backend._mixed_decode_splits(r, kv_heads), r == 1
            assert {variant(r) for r in rows} == {variant(r) for r in range(1, 300)}
        assert backend._mixed_decode_splits(1, 8) == (16 if sms == 132 else 1)
    """
)


@INTERPRETER_MARKS[0]
@INTERPRETER_MARKS[1]
def test_mixed_batch_attention_in_interpreter():
    run_interpreted(_CHECK)
