"""Batch limits and tuning buckets of the Triton GEMVs (shard/kernels/gemv.py).

Kept apart from the kernels so that code deciding whether a GEMV may run (shard/layers/decode_linear.py)
imports without Triton, which is not a CPU dependency.
"""

from __future__ import annotations

# Largest batch (rows of x) served by the GEMV: one 16-row MMA tile (see shard/kernels/gemv.py).
GEMV_MAX_M = 16
# Tuning buckets: a batch of M rows is tuned as the next power of two (CUDA-graph decode buckets
# are 1, 2, 4, 8, 16 already).
M_BUCKETS = (1, 2, 4, 8, 16)


def m_bucket(m: int) -> int:
    """Tuning bucket of a batch of m rows (1 <= m <= GEMV_MAX_M): the next power of two."""
    return 1 << max(m - 1, 0).bit_length()
