"""How a step that carries prefill chunks is cut for the attention kernels (host side only).

A mixed step is one flat ragged batch: the shard puts the prefill chunks first and the decoding
requests (one new token each) after them (shard/engine/batches.py, `launch_prefill`). Sending the
whole batch to the prefill kernel costs the decode rows dearly: each of them gets a 64-row query
tile holding one live row, one program per query head (so a GQA group reads its K/V once per query
head instead of once), and the grid spans every sequence times the longest chunk's tile count,
mostly programs that exit at once. So the trailing one-token rows go to the decode kernel, as in a
decode-only step, and the prefill kernel gets the chunks alone, over a flat list of the tiles that
exist (`prefill_tile_map`) instead of a [num_seqs, max_tiles] grid.

Everything here reads the metadata's host lists, once per step: the backend keeps the result in
`AttentionMetadata.derived` and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MixedSplit:
    """Sequences [0, prefill_seqs) are chunks (their new tokens are rows [0, prefill_tokens) of
    the flat batch); sequences [prefill_seqs, num_seqs) have one new token each (rows
    [prefill_tokens, num_tokens)) and attend like decode rows."""

    prefill_seqs: int
    prefill_tokens: int
    num_seqs: int

    @property
    def decode_seqs(self) -> int:
        return self.num_seqs - self.prefill_seqs


def split_trailing_decodes(query_lens: list[int]) -> MixedSplit:
    """The longest run of one-token sequences at the end of the batch becomes the decode part.
    A one-token chunk among the chunks (a prompt's last token, a prefix-cache hit one short of
    the end) stays with the prefill kernel: both kernels give the same attention for it."""
    n = len(query_lens)
    p = n
    while p > 0 and query_lens[p - 1] == 1:
        p -= 1
    return MixedSplit(prefill_seqs=p, prefill_tokens=sum(query_lens[:p]), num_seqs=n)


def prefill_tile_map(query_lens: list[int], seq_lens: list[int], block_m: int) -> np.ndarray:
    """[2, num_tiles] int32: row 0 the sequence, row 1 the query tile (block_m new tokens) of
    every tile that holds at least one query. Heaviest first (a tile attends to the cached
    context plus the chunk up to its last row), so that the long tiles start in the first wave
    and the short ones fill in behind them."""
    q = np.asarray(query_lens, dtype=np.int64)  # [num_seqs]
    ctx = np.asarray(seq_lens, dtype=np.int64) - q  # [num_seqs] tokens cached before the chunk
    tiles = -(-q // block_m)  # [num_seqs]
    seq = np.repeat(np.arange(len(q)), tiles)  # [num_tiles]
    first = np.cumsum(tiles) - tiles  # [num_seqs] index of each sequence's first tile
    tile = np.arange(int(tiles.sum())) - first[seq]  # [num_tiles]
    keys = ctx[seq] + np.minimum((tile + 1) * block_m, q[seq])  # [num_tiles] keys attended
    order = np.argsort(-keys, kind="stable")
    return np.stack([seq[order], tile[order]]).astype(np.int32)
