"""shard/attention/triton_decode.py's paged decode attention under Triton's interpreter on CPU
tensors (no GPU): the fused split-KV merge (the last split of each (sequence, KV head) merges,
FUSED_MERGE) against the two-kernel path and a float32 torch reference.

Triton reads TRITON_INTERPRET when a kernel is defined, hence a fresh process per check.
Interpreter limits (triton 3.6): its fp32 -> bf16 casts truncate (bf16 outputs are checked to
atol 2e-2 against the reference) and its tl.dot multiplies bf16 operands as raw 16-bit integers,
so the check widens them to fp32 first (exact). The interpreter runs programs one at a time in
grid order; the check rotates the split index per (sequence, KV head) so that the merging
program is not always the last split. Real concurrency (ticket ordering, L1 bypass) is covered
by tests/gpu/test_decode_attention_fused_merge.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
REPO_ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    _dot = interpreter.InterpreterBuilder.create_dot

    def _widen_bf16(h):
        if h.dtype != tl.bfloat16:
            return h
        data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def _create_dot(self, a, b, d, *rest):  # bf16 dot operands are exact in fp32
        return _dot(self, _widen_bf16(a), _widen_bf16(b), d, *rest)

    interpreter.InterpreterBuilder.create_dot = _create_dot

    # Program (x, y, z) runs as split (z + x + y + 1) % num_splits: a bijection per (x, y), so
    # every split still runs once, but the ticket holder that merges varies.
    _set_idx = interpreter.InterpreterBuilder.set_grid_idx

    def _rotated(self, x, y, z):
        _set_idx(self, x, y, (z + x + y + 1) % self.grid_dim[2])

    interpreter.InterpreterBuilder.set_grid_idx = _rotated

    from shard.attention import triton_decode as td
    """
)

_FUSED_CHECK = textwrap.dedent(
    """
    def make(num_seqs, kvh, group, hd, page, lens, fp8, seed):
        g = torch.Generator().manual_seed(seed)
        per = max(1, -(-max(lens) // page))
        nblocks = num_seqs * per + 1
        kc = torch.randn(nblocks, page, kvh, hd, generator=g)  # [blocks, page, kvh, hd]
        vc = torch.randn(nblocks, page, kvh, hd, generator=g)
        q = torch.randn(num_seqs, kvh * group, hd, generator=g).to(torch.bfloat16)
        bt = torch.randperm(num_seqs * per, generator=g).view(num_seqs, per).to(torch.int32)
        sl = torch.tensor(lens, dtype=torch.int32)
        if not fp8:
            return q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), bt, sl, None, None
        ks = torch.rand(kvh, generator=g) * 0.1 + 0.02  # |k / ks| < ~250: no e4m3 saturation
        vs = torch.rand(kvh, generator=g) * 0.1 + 0.02
        kq = (kc / ks[:, None]).to(torch.float8_e4m3fn)
        vq = (vc / vs[:, None]).to(torch.float8_e4m3fn)
        return q, kq, vq, bt, sl, ks, vs

    def reference(q, kc, vc, bt, sl, scale, window, ks, vs):  # [num_seqs, heads, hd] fp32
        num_seqs, nh, hd = q.shape
        _, page, kvh, _ = kc.shape
        out = torch.zeros(num_seqs, nh, hd)
        for i in range(num_seqs):
            n = int(sl[i])
            if n == 0:
                continue
            pos = torch.arange(max(n - window, 0) if window else 0, n)
            slots = bt[i, pos // page].long() * page + pos % page
            k = kc.view(-1, kvh, hd)[slots].float()  # [n, kvh, hd]
            v = vc.view(-1, kvh, hd)[slots].float()
            if ks is not None:
                k, v = k * ks[None, :, None], v * vs[None, :, None]
            k = k.repeat_interleave(nh // kvh, 1)
            v = v.repeat_interleave(nh // kvh, 1)
            s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
            out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
        return out

    def within_ulp(a, b):  # bf16 tensors equal to one unit in the last place
        a, b = a.float(), b.float()
        return bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2**-7).all())

    merge_kernel = td._decode_merge_kernel
    cases = [
        # num_seqs, kvh, group, hd, page, seq_lens, splits, window, fp8
        (1, 2, 4, 64, 16, [300], 4, None, False),
        (3, 2, 3, 32, 16, [0, 5, 200], 8, None, False),  # padding row; splits 1..7 of 5 empty
        (2, 1, 8, 64, 8, [40, 130], 5, 50, False),  # sliding window
        (2, 2, 2, 32, 16, [90, 0], 3, None, True),  # fp8 cache with per-KV-head scales
        (2, 4, 1, 48, 16, [17, 1], 16, None, False),  # no GQA; head_dim < BLOCK_D
    ]
    for num_seqs, kvh, group, hd, page, lens, splits, window, fp8 in cases:
        q, kc, vc, bt, sl, ks, vs = make(num_seqs, kvh, group, hd, page, lens, fp8, 0)
        scale = hd**-0.5
        what = (num_seqs, kvh, group, hd, lens, splits, window, fp8)
        args = (q, kc, vc, bt, sl, scale, window)
        kw = dict(num_splits=splits, block_n=16, k_scale=ks, v_scale=vs)
        ref = reference(q, kc, vc, bt, sl, scale, window, ks, vs)
        two = td.paged_decode_attention(*args, **kw)
        tickets = torch.zeros(num_seqs * kvh + 3, dtype=torch.int32)
        td._decode_merge_kernel = None  # the fused path must not launch the merge kernel
        try:
            outs = [td.paged_decode_attention(*args, **kw, tickets=tickets) for _ in range(2)]
            assert not tickets.any(), (what, tickets)  # reset by each call's last split
        finally:
            td._decode_merge_kernel = merge_kernel
        for fused in outs:
            assert fused.dtype == torch.bfloat16 and fused.shape == q.shape, what
            assert within_ulp(fused, two), (what, (fused.float() - two.float()).abs().max())
            assert (fused.float() - ref).abs().max() < 2e-2, what
        assert torch.equal(outs[0], outs[1]), what  # the merge order is fixed: deterministic
        assert not outs[0][sl == 0].any(), what  # padding rows stay zeros

    # Too small a buffer falls back to the merge kernel (and is left alone); one split ignores it.
    q, kc, vc, bt, sl, _, _ = make(2, 2, 4, 32, 16, [70, 33], False, 1)
    args = (q, kc, vc, bt, sl, 32**-0.5)
    small = torch.zeros(3, dtype=torch.int32)
    two = td.paged_decode_attention(*args, num_splits=4, block_n=16)
    assert torch.equal(td.paged_decode_attention(*args, num_splits=4, block_n=16, tickets=small),
                       two)
    one = td.paged_decode_attention(*args, num_splits=1, block_n=16)
    assert torch.equal(td.paged_decode_attention(*args, num_splits=1, block_n=16,
                                                 tickets=torch.zeros(4, dtype=torch.int32)), one)
    assert not small.any()
    """
)


def _run_interpreted(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-c", _PRELUDE + check],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-4000:]


pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (not a CPU dependency)"),
    pytest.mark.skipif(
        np.lib.NumpyVersion(np.__version__) >= "2.4.0",
        reason="triton 3.6's interpreter cannot take runtime loop bounds with numpy >= 2.4",
    ),
]


def test_fused_split_merge_equals_two_kernels_and_reference_in_interpreter():
    _run_interpreted(_FUSED_CHECK)
