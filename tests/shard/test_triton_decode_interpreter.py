"""shard/kernels/attention_decode.py's fused rotary decode mode (rotary_store_decode_attention)
under Triton's interpreter on CPU tensors (no GPU).

Two checks per case: (a) bit-equal output and cache bytes against the unfused Triton pair
(shard.kernels.elementwise.rotary_store_kv, then paged_decode_attention), interpreted too; (b) against the
portable torch path (shard.layers.rotary on CPU + shard/attention/torch_backend.py) to a tolerance,
since that path rounds to the model dtype after every op.

Interpreter limits (triton 3.6-3.9), patched in the prelude so that it rounds like the GPU: its fp32
-> bf16 casts truncate, its fp32 -> fp8 casts drop the carry of a round-up into the exponent
(7.9 -> 4.0), and its tl.dot multiplies bf16 operands as raw 16-bit integers (see
tests/shard/test_triton_gemv_interpreter.py). It runs programs one after another, so it does not
exercise the kernel's CTA barrier: tests/gpu/test_fused_kernels.py checks the real thing, CUDA
graphs included.

Triton reads TRITON_INTERPRET when a kernel is defined, hence a fresh process per check.
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import (
    BF16_DOT_PRELUDE,
    INT_MASK_PRELUDE,
    INTERPRETER_MARKS,
    run_interpreted,
)

# (INT_MASK_PRELUDE: the early tile's reload, Q_IN_REGISTERS, gets an int32 mask)
_PRELUDE = BF16_DOT_PRELUDE + INT_MASK_PRELUDE + textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    def _torch_cast(src, dst_type, torch_dtype, torch_bits):  # fp32 -> round to nearest even
        x = torch.from_numpy(np.array(src.data, dtype=np.float32, copy=True))
        data = x.to(torch_dtype).view(torch_bits).numpy()
        return interpreter.TensorHandle(data.view(interpreter._get_np_dtype(dst_type)),
                                        dst_type.scalar)

    _cast = interpreter.InterpreterBuilder.cast_impl
    _fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def _cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return _torch_cast(src, dst_type, torch.bfloat16, torch.int16)
        return _cast(self, src, dst_type)

    def _create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return _torch_cast(src, dst_type, torch.float8_e4m3fn, torch.uint8)
        return _fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.cast_impl = _cast_impl
    interpreter.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp

    # The interpreter runs programs in grid order. Running them in reverse order too shows that
    # the program which stores the new token is the one that reads it (any other one would
    # store it after the reader ran in one of the two orders).
    _set_grid_idx = interpreter.InterpreterBuilder.set_grid_idx
    REVERSED = [False]

    def _maybe_reversed_grid_idx(self, x, y, z):
        if REVERSED[0]:
            nx, ny, nz = self.grid_dim
            x, y, z = nx - 1 - x, ny - 1 - y, nz - 1 - z
        _set_grid_idx(self, x, y, z)

    interpreter.InterpreterBuilder.set_grid_idx = _maybe_reversed_grid_idx

    from shard.attention.base import AttentionMetadata
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.kernels.attention_decode import (
        paged_decode_attention, rotary_store_decode_attention)
    from shard.quantization.kv_cache import KvScales
    from shard.layers.rotary import RotaryEmbedding
    from shard.kernels.elementwise import rotary_store_kv
    from shard.kernels.head_norms import HeadNorms
    from shard.kernels.qk_norm import qk_rms_norm

    HEADS, KV_HEADS, PAGE, BLOCKS = 8, 2, 16, 40
    EPS = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}  # rounding
    TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # output vs torch

    def case(dtype, cache_dtype, head_dim, seq_lens, num_splits, window, seed, norm_offset=None):
        '''One decode step of len(seq_lens) sequences (seq_len 0: a graph padding row, slot -1)
        through the fused kernel and the unfused pair, from the same starting cache. With
        norm_offset, q/k per-head RMSNorms (weights offset by it) inside the fused kernel against
        the separate qk_rms_norm launch before the pair.'''
        gen = torch.Generator().manual_seed(seed)
        n = len(seq_lens)
        rope = RotaryEmbedding(head_dim, 512, {"rope_type": "default", "rope_theta": 10000.0},
                               torch.device("cpu"))
        # q/k/v: column views of one merged projection output, as LlamaAttention passes them.
        width = (HEADS + 2 * KV_HEADS) * head_dim
        qkv = torch.randn(n, width, generator=gen).to(dtype)
        q, k, v = qkv.split([HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], -1)
        q, k, v = (t.view(n, -1, head_dim) for t in (q, k, v))
        per = max(-(-max(seq_lens) // PAGE), 1)
        perm = torch.randperm(BLOCKS, generator=gen)[: n * per].view(n, per)
        tables = perm.to(torch.int32)
        positions = torch.tensor([max(s - 1, 0) for s in seq_lens])
        slots = torch.tensor([int(tables[i, (s - 1) // PAGE]) * PAGE + (s - 1) % PAGE
                              if s else -1 for i, s in enumerate(seq_lens)])
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        cache = torch.randn(2, BLOCKS, PAGE, KV_HEADS, head_dim, generator=gen).to(dtype)
        scales = None
        if cache_dtype != dtype:  # fp8: per-KV-head scales
            scales = (torch.rand(KV_HEADS, generator=gen) + 0.05,
                      torch.rand(KV_HEADS, generator=gen) + 0.05)
            cache = (cache.float() / 2).to(cache_dtype)
        fused_cache, reversed_cache, pair_cache = cache.clone(), cache.clone(), cache.clone()
        scale = head_dim ** -0.5
        sc = scales or (None, None)
        norms = None
        if norm_offset is not None:
            w = (torch.rand(2, head_dim, generator=gen) + 0.5).to(dtype)
            norms = HeadNorms(w[0], w[1], 1e-6, norm_offset)
        got = rotary_store_decode_attention(
            q, k, v, positions, rope.cos, rope.sin, *fused_cache, slots, tables, lens, scale,
            window, num_splits, k_scale=sc[0], v_scale=sc[1], head_norms=norms)
        REVERSED[0] = True
        try:
            got_reversed = rotary_store_decode_attention(
                q, k, v, positions, rope.cos, rope.sin, *reversed_cache, slots, tables, lens,
                scale, window, num_splits, k_scale=sc[0], v_scale=sc[1], head_norms=norms)
        finally:
            REVERSED[0] = False
        if norms is not None:  # the separate launch, then the pair as below
            q, k = qk_rms_norm(q, k, norms.q_weight, norms.k_weight, norms.eps, norm_offset)
        fp8_max = float(torch.finfo(cache_dtype).max) if scales else 0.0
        q_rot = rotary_store_kv(positions, q, k, v, rope.cos, rope.sin, *pair_cache, slots,
                                *sc, fp8_max)
        want = paged_decode_attention(q_rot, *pair_cache, tables, lens, scale, window,
                                      num_splits, k_scale=sc[0], v_scale=sc[1])
        what = (dtype, cache_dtype, head_dim, seq_lens, num_splits, window)
        assert got.shape == (n, HEADS, head_dim) and got.dtype == dtype, what
        if norms is None:
            assert torch.equal(got, want) and torch.equal(got_reversed, want), what
            for c in (fused_cache, reversed_cache):
                assert torch.equal(c.view(torch.uint8), pair_cache.view(torch.uint8)), what
        else:  # the sum of squares adds in another fp32 order: one rounding step apart at most
            for a, b in ((got, want), (got_reversed, want), *((c, pair_cache) for c in
                                                             (fused_cache, reversed_cache))):
                bound = 2 * EPS[dtype] * b.float().abs().amax(-1, keepdim=True)
                assert ((a.float() - b.float()).abs() <= bound).all(), what
            assert torch.equal(got, got_reversed), what
        assert not torch.equal(fused_cache.view(torch.uint8), cache.view(torch.uint8)), what
        for i, s in enumerate(seq_lens):
            if s == 0:
                assert not got[i].any(), what  # padding row: zeros
        torch_reference(got, fused_cache, cache, q, k, v, positions, rope, slots, tables,
                        seq_lens, scale, window, scales, what)

    def torch_reference(got, fused_cache, cache, q, k, v, positions, rope, slots, tables,
                        seq_lens, scale, window, scales, what):
        '''The portable path over the real (non-padding) rows, to a tolerance: the new tokens'
        cache entries against shard.layers.rotary + the torch write, then the output against torch
        attention of the torch-rotated q over the fused kernel's cache.'''
        rows = torch.tensor([i for i, s in enumerate(seq_lens) if s])
        qr, kr = rope(positions[rows], q[rows], k[rows])
        ref_cache = cache.clone()
        backend = TorchAttentionBackend()
        kv_scales = KvScales(*scales) if scales else None
        backend.write_kv(kr, v[rows], *ref_cache, slots[rows], kv_scales)
        for a, b in zip(fused_cache, ref_cache):
            a = a.view(-1, *a.shape[2:])[slots[rows]].float()  # [rows, num_kv_heads, head_dim]
            b = b.view(-1, *b.shape[2:])[slots[rows]].float()
            if scales:  # at most one e4m3 step apart (3 mantissa bits; subnormal step 2^-9)
                assert ((a - b).abs() <= b.abs() / 8 + 2**-9).all(), what
            else:
                bound = 2 * EPS[q.dtype] * b.abs().amax(-1, keepdim=True)
                assert ((a - b).abs() <= bound).all(), what
        m = len(rows)
        lens = [seq_lens[i] for i in rows]
        meta = AttentionMetadata(
            query_start_loc=torch.arange(m + 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables[rows],
            slot_mapping=slots[rows], max_query_len=1, max_seq_len=max(lens),
            query_lens_host=[1] * m, seq_lens_host=lens)
        ref = backend.attend(qr, *fused_cache, meta, scale, window, kv_scales).float()
        err = float((got[rows].float() - ref).norm() / ref.norm())
        assert err <= TOL[q.dtype], (what, err)
    """
)

# Model-dtype caches: bf16, fp16 and fp32 (the tiny test models), head_dim 64 and 48 (HALF_PAD >
# HALF, BLOCK_D > head_dim), batch 1 (one tile, and three: the first tile loaded before the PDL
# wait, the new token in a later one) and a batch with a padding row, one split and several (the
# new token in a later split, empty splits), with and without a sliding window.
_MODEL_DTYPE_CHECK = textwrap.dedent(
    """
    import itertools

    options = ((torch.bfloat16, torch.float16, torch.float32), (64, 48),
               ([37], [150], [70, 0, 130, 1]), (1, 3), (None, 20))
    # Every pair of option values meets in at least one case (a greedy covering array: 9 cases
    # instead of the 72 of the full product, which took ~80 s of the interpreter);
    # tests/gpu/test_fused_kernels.py runs the compiled kernel over the full product of windows,
    # splits and batches (bf16 and fp8 caches).
    uncovered = {(a, x, b, y) for a, b in itertools.combinations(range(len(options)), 2)
                 for x in range(len(options[a])) for y in range(len(options[b]))}

    def covers(idx):
        return {(a, idx[a], b, idx[b]) for a, b in itertools.combinations(range(len(idx)), 2)}

    chosen = []
    while uncovered:
        best = max(itertools.product(*(range(len(o)) for o in options)),
                   key=lambda idx: len(covers(idx) & uncovered))
        chosen.append(best)
        uncovered -= covers(best)
    for seed, idx in enumerate(chosen, start=1):
        dtype, head_dim, seq_lens, num_splits, window = (o[i] for o, i in zip(options, idx))
        case(dtype, dtype, head_dim, seq_lens, num_splits, window, seed)
    """
)

# fp8 e4m3 caches with per-KV-head scales (the store divides and saturates). Batch, splits and
# window as a pairwise covering set (the 4 cases of a two-level orthogonal array: every pair of
# values meets once) instead of the full product's 8, as the model-dtype check does; the window is
# 20 (it was 50), shorter than the 37-, 70- and 130-token sequences, so that each windowed case
# really drops tokens (50 left [37] whole). tests/gpu/test_fused_kernels.py runs the full product compiled.
_FP8_CHECK = textwrap.dedent(
    """
    seed = 100
    for seq_lens, num_splits, window in (([37], 1, None), ([37], 4, 20),
                                         ([70, 0, 130, 1], 1, 20), ([70, 0, 130, 1], 4, None)):
        seed += 1
        case(torch.bfloat16, torch.float8_e4m3fn, 64, seq_lens, num_splits, window, seed)
    """
)

# q/k per-head RMSNorms inside the fused kernel (Qwen3: weight offset 0; Gemma 3: 1.0, rounded
# once), one split and several, a padding row, head_dim with and without padded halves.
_QK_NORM_CHECK = textwrap.dedent(
    """
    case(torch.bfloat16, torch.bfloat16, 64, [37], 1, None, 201, norm_offset=0.0)
    case(torch.float32, torch.float32, 48, [70, 0, 130, 1], 3, 20, 202, norm_offset=1.0)
    """
)

# The merge's two forms (_merge_splits: one [splits, group, head_dim] block, or one split's rows
# at a time under merge_by_split): each against float64 attention over the gathered context,
# and within fp32 summation-order rounding of each other. Split counts 3 (padded to 4, one masked split)
# and 5 (padded to 8), with empty splits ([1] and the padding row).
_MERGE_FORMS_CHECK = textwrap.dedent(
    """
    from shard.kernels.attention_decode import merge_by_split

    gen = torch.Generator().manual_seed(301)
    for seq_lens, num_splits in (([70, 0, 130, 1], 3), ([200, 9], 5)):
        n, head_dim = len(seq_lens), 64
        q = torch.randn(n, HEADS, head_dim, generator=gen)
        per = max(-(-max(seq_lens) // PAGE), 1)
        tables = torch.randperm(BLOCKS, generator=gen)[: n * per].view(n, per).to(torch.int32)
        cache = torch.randn(2, BLOCKS, PAGE, KV_HEADS, head_dim, generator=gen)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        scale = head_dim ** -0.5
        block = paged_decode_attention(q, *cache, tables, lens, scale, None, num_splits)
        with merge_by_split(True):
            by_split = paged_decode_attention(q, *cache, tables, lens, scale, None, num_splits)
        for i, length in enumerate(seq_lens):
            if length == 0:
                assert not block[i].any() and not by_split[i].any()
                continue
            slots = (tables[i].long()[:, None] * PAGE + torch.arange(PAGE)).flatten()[:length]
            k, v = (c.reshape(-1, KV_HEADS, head_dim)[slots].double() for c in cache)
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
            w = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), k) * scale, -1)
            want = torch.einsum("ht,thd->hd", w, v).float()
            for got in (block[i], by_split[i]):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(by_split, block, atol=1e-6, rtol=1e-6)
    """
)

def _run_interpreted(check: str) -> None:
    run_interpreted(_PRELUDE + check)


pytestmark = INTERPRETER_MARKS


def test_fused_rotary_decode_model_dtype_cache_in_interpreter():
    _run_interpreted(_MODEL_DTYPE_CHECK)


def test_fused_rotary_decode_fp8_cache_in_interpreter():
    _run_interpreted(_FP8_CHECK)


def test_fused_rotary_decode_with_qk_norms_in_interpreter():
    _run_interpreted(_QK_NORM_CHECK)


def test_merge_forms_equal_float64_attention_in_interpreter():
    _run_interpreted(_MERGE_FORMS_CHECK)
