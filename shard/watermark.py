"""The Kirchenbauer et al. (2023) "green list" watermark, as TGI applies it.

For each sampled position, the previous token id seeds a pseudo-random permutation of the vocabulary;
its first ``gamma * vocab`` entries are the *green list* and get ``+delta`` added to their logits.
A detector that knows the key recounts green tokens in a text and computes a z-score
(:meth:`Watermark.z_score`).

The permutation is drawn on the CPU with a CPU ``torch.Generator`` on purpose: CPU and CUDA
generators give different permutations for the same seed, and a watermark must be detectable
whatever device generated the text. Building the mask costs one ``randperm(vocab)`` per
watermarked row on the host and one host-to-device copy; no device-to-host synchronisation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

# A fixed large prime, the hash key of the reference implementation. Changing it changes every
# green list, so detectors built against older outputs would stop working: keep it constant.
DEFAULT_HASH_KEY = 15485863


@dataclass(frozen=True)
class Watermark:
    """Green-list watermark parameters.

    gamma: fraction of the vocabulary in each green list (0 < gamma < 1).
    delta: logit bias added to green tokens.
    hash_key: multiplier of the previous token id in the generator seed.
    """

    gamma: float = 0.5
    delta: float = 2.0
    hash_key: int = DEFAULT_HASH_KEY

    def green_size(self, vocab_size: int) -> int:
        """Number of green tokens per list."""
        return int(vocab_size * self.gamma)

    def green_ids(self, prev_token: int, vocab_size: int) -> torch.Tensor:
        """Green-list token ids (CPU, int64, [green_size]) following ``prev_token``."""
        generator = torch.Generator(device="cpu")
        # Seed must be a non-negative 64-bit value; the mask keeps large ids from overflowing.
        generator.manual_seed((self.hash_key * prev_token) & 0x7FFF_FFFF_FFFF_FFFF)
        perm = torch.randperm(vocab_size, generator=generator)  # [vocab]
        return perm[: self.green_size(vocab_size)]

    def green_mask(
        self, prev_tokens: list[int], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """Boolean mask [len(prev_tokens), vocab_size]: True where the token is green."""
        mask = torch.zeros(len(prev_tokens), vocab_size, dtype=torch.bool)
        for row, prev in enumerate(prev_tokens):
            mask[row, self.green_ids(prev, vocab_size)] = True
        if device.type != "cuda":
            return mask.to(device)
        # Pinned + non_blocking: queued behind the forward pass instead of waiting for it.
        return mask.pin_memory().to(device, non_blocking=True)

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
        green = 0
        for prev, tok in itertools.pairwise(token_ids):
            green += int(bool((self.green_ids(prev, vocab_size) == tok).any()))
        expected = self.gamma * scored
        return (green - expected) / math.sqrt(scored * self.gamma * (1.0 - self.gamma))
