"""The Kirchenbauer et al. (2023) "green list" watermark, as TGI applies it.

For each sampled position, the previous token id (times a fixed hash key) selects a pseudo-random
permutation of the vocabulary; its first ``int(gamma * vocab)`` entries are the *green list* and
get ``+delta`` added to their logits. A detector that knows the key recounts green tokens in a
text and computes a z-score (:meth:`Watermark.z_score`).

Where TGI draws the permutation with ``torch.randperm`` from a generator seeded by
``hash_key * prev``, the permutation here is the sort order of a keyed integer hash of
``(hash_key * prev, token)``. Same construction (a seeded uniform permutation, an exact gamma
fraction), but integer arithmetic is bit-identical on CPU and CUDA, so a watermark is detectable
whatever device generated or checks the text, and all watermarked rows of a batch are computed in
one vectorised pass on the logits' device (no per-row host work, no host synchronisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A fixed large prime, the hash key of the reference implementation. Changing it changes every
# green list, so detectors built against older outputs would stop working: keep it constant.
DEFAULT_HASH_KEY = 15485863


_MASK32 = 0xFFFF_FFFF
# Multiplier of a well-mixing 32-bit integer hash; below 2**31 so that a 32-bit value times it
# stays inside int64 (no signed overflow, identical results on every device).
_MIX = 0x045D_9F3B


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of int64 values in [0, 2**32) to [0, 2**32), elementwise."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


@dataclass(frozen=True)
class Watermark:
    """Green-list watermark parameters.

    gamma: fraction of the vocabulary in each green list (0 < gamma < 1).
    delta: logit bias added to green tokens.
    hash_key: multiplier of the previous token id in each list's seed.
    """

    gamma: float = 0.5
    delta: float = 2.0
    hash_key: int = DEFAULT_HASH_KEY

    def green_size(self, vocab_size: int) -> int:
        """Number of green tokens per list."""
        return int(vocab_size * self.gamma)

    def green_mask(
        self, prev_tokens: list[int] | torch.Tensor, vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """Boolean mask [len(prev_tokens), vocab_size] on ``device``: True where green.

        Row i ranks every token by hash(seed_i, token) with seed_i = hash(hash_key * prev_i);
        the ``green_size`` lowest ranks are green. Sort keys are made unique by appending the
        token id (hash * vocab + token < 2**52), so the list is exactly ``green_size`` long and
        does not depend on how a sort breaks ties.
        """
        if isinstance(prev_tokens, torch.Tensor):
            prev = prev_tokens.to(device=device, dtype=torch.long)
        else:
            prev = torch.tensor(prev_tokens, dtype=torch.long)
            prev = (
                prev.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else prev
            )
        seeds = _hash32((prev * self.hash_key) & _MASK32)[:, None]  # [n, 1]
        tokens = torch.arange(vocab_size, device=device)  # [vocab]
        keys = _hash32(seeds ^ tokens) * vocab_size + tokens  # [n, vocab], unique per row
        green = keys.topk(self.green_size(vocab_size), dim=-1, largest=False).indices  # [n, g]
        mask = torch.zeros(prev.shape[0], vocab_size, dtype=torch.bool, device=device)
        return mask.scatter_(1, green, True)

    def green_ids(self, prev_token: int, vocab_size: int) -> torch.Tensor:
        """Sorted green-list token ids (CPU, int64, [green_size]) following ``prev_token``."""
        mask = self.green_mask([prev_token], vocab_size, torch.device("cpu"))[0]
        return mask.nonzero().squeeze(1)

    def apply(self, logits: torch.Tensor, prev_tokens: list[int]) -> torch.Tensor:
        """Returns ``logits`` [n, vocab] with ``delta`` added to each row's green list.

        Row i's list is seeded by ``prev_tokens[i]``.
        """
        mask = self.green_mask(prev_tokens, logits.shape[-1], logits.device)
        return logits + mask.to(logits.dtype) * self.delta

    def z_score(self, token_ids: list[int], vocab_size: int) -> float:
        """Detection statistic over a token sequence (the first token has no predecessor).

        Under the null hypothesis (no watermark) the number of green tokens among T scored tokens
        is Binomial(T, gamma); the z-score measures how far the observed count exceeds it.
        """
        scored = len(token_ids) - 1
        if scored <= 0:
            return 0.0
        ids = torch.tensor(token_ids, dtype=torch.long)
        mask = self.green_mask(ids[:-1], vocab_size, torch.device("cpu"))  # [scored, vocab]
        green = int(mask.gather(1, ids[1:, None]).sum())
        expected = self.gamma * scored
        return (green - expected) / math.sqrt(scored * self.gamma * (1.0 - self.gamma))
