"""No Triton compile in the middle of serving mixed steps (issue 44: on a fresh machine each one
stalled its step for 0.5-1.7 s): after the warm-up's mixed steps (shard/runner/warmup.py's
shapes: one 16-token chunk on a one-block table, then each of the backend's
mixed_warmup_decode_rows counts of decode rows), mixed steps of
other shapes (more chunks, wider block tables, decode rows at every alignment) launch only
kernel variants already built. shard.runtime.KernelCompileWatch counts the compiles.

Run on a GPU machine: `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_mixed_steps_after_warmup_compile_nothing():
    from shard.attention.cuda_backend import CudaAttentionBackend
    from shard.runtime import KernelCompileWatch
    from shard.testing.paged_batch import random_paged_step

    backend = CudaAttentionBackend("cuda", use_flash_attn=False)
    page, scale = 16, 128**-0.5

    def attend(q_lens: list[int], seq_lens: list[int]) -> None:
        q, cache, meta = random_paged_step(q_lens, seq_lens, 32, 8, 128, page, "cuda",
                                           torch.bfloat16)
        backend.attend(q, *cache, meta, scale, None)

    watch = KernelCompileWatch()
    assert watch.install()
    try:
        for rows in backend.mixed_warmup_decode_rows():  # as run_warmup's mixed steps
            attend([page] + [1] * rows, [page] + [page] * rows)
        torch.cuda.synchronize()
        watch.serving()
        gen = torch.Generator().manual_seed(0)
        for chunks, rows in [(2, 1), (3, 3), (5, 140), (1, 201), (4, 2), (7, 133)]:
            q_lens = torch.randint(1, 300, (chunks,), generator=gen).tolist()
            cached = torch.randint(0, 700, (chunks,), generator=gen).tolist()
            ctx = torch.randint(2, 1500, (rows,), generator=gen).tolist()
            q_lens[0] = max(q_lens[0], 2)  # a chunk, not a decode row
            attend(q_lens + [1] * rows, [c + n for c, n in zip(cached, q_lens)] + ctx)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert watch.while_serving == [], [(c.kernel, c.specialization) for c in watch.while_serving]
