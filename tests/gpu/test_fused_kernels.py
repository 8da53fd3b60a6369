"""Fused CUDA kernels equal their unfused forms (`pytest -m gpu tests/gpu`): the rotary
embedding with the KV-cache store (shard.kernels.elementwise.rotary_store_kv), fp8 gate/up with
SiLU-and-mul (Fp8Linear.forward_silu_mul), and decode attention with rotary and the cache store
in its split kernel (attention_decode.rotary_store_decode_attention: bit-equal to rotary_store_kv +
paged_decode_attention, eagerly, in a CUDA graph, and through the model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotary_store_kv_equals_rotary_then_store(cache_dtype):
    from shard.kernels.attention_decode import store_kv
    from shard.layers.rotary import RotaryEmbedding
    from shard.kernels.elementwise import rotary, rotary_store_kv

    heads, kv_heads, head_dim, n = 16, 4, 128, 5
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 500000.0},
                           torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # q/k/v as column slices of one merged projection output, as the model passes them.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(n, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 7, 300, 1023, 4095], device="cuda")
    slots = torch.tensor([3, -1, 40, 17, 63], device="cuda")  # -1: a graph padding row
    scales = None
    if cache_dtype != torch.bfloat16:
        scales = (torch.rand(kv_heads, device="cuda", generator=gen) + 0.01,
                  torch.rand(kv_heads, device="cuda", generator=gen) + 0.01)
    caches = [tuple(torch.zeros(4, 16, kv_heads, head_dim, device="cuda").to(cache_dtype)
                    for _ in range(2)) for _ in range(2)]
    q_ref, k_ref = rotary(positions, q, k, rope.cos, rope.sin)
    store_kv(k_ref, v, *caches[0], slots, *(scales or (None, None)))
    fp8_max = float(torch.finfo(cache_dtype).max) if scales else 0.0
    q_got = rotary_store_kv(positions, q, k, v, rope.cos, rope.sin, *caches[1], slots,
                            *(scales or (None, None)), fp8_max)
    assert torch.equal(q_got, q_ref)
    for want, got in zip(caches[0], caches[1]):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    assert caches[1][0].float().abs().sum() > 0  # something was stored


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_fp8_gate_up_silu_equals_linear_then_silu_mul(rows):
    """Batches on the GEMV path (1, 8) take the SiLU epilogue: equal to forward() then silu_mul
    up to bf16 rounding (the two may be tuned to different tiles, i.e. summation orders); 32
    takes the W8A8 path + silu_mul, exactly the two-step form."""
    from shard.quantization.fp8 import Fp8Linear
    from shard.kernels.elementwise import silu_mul

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate = Fp8Linear.from_float(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02)
    up = Fp8Linear.from_float(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02)
    merged = Fp8Linear.merge_rows(gate, up)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    g, u = merged(x).chunk(2, dim=-1)
    want, got = silu_mul(g, u), merged.forward_silu_mul(x)
    if rows > 16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def _decode_step(cache_dtype: torch.dtype, seq_lens: list[int], seed: int,
                 num_blocks: int | None = None) -> SimpleNamespace:
    """One decode step at the Llama-3-8B attention shape (32 heads, 8 KV heads, head_dim 128):
    unrotated q/k/v as column views of one merged projection output (as the model passes them),
    positions, slots (-1 and seq_len 0: a CUDA-graph padding row), shuffled block tables, a
    random starting cache and, for fp8 caches, per-KV-head scales."""
    from shard.layers.rotary import RotaryEmbedding

    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = len(seq_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen)
    q, k, v = qkv.to(torch.bfloat16).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    per = max(-(-max(seq_lens) // page), 1)  # blocks per sequence
    num_blocks = num_blocks or n * per + 3
    tables = torch.randperm(num_blocks, device="cuda", generator=gen)[: n * per].view(n, per)
    tables = tables.to(torch.int32)
    slots = [int(tables[i, (s - 1) // page]) * page + (s - 1) % page if s else -1
             for i, s in enumerate(seq_lens)]
    cache = torch.randn(2, num_blocks, page, kv_heads, head_dim, device="cuda", generator=gen)
    scales = (None, None)
    if cache_dtype != torch.bfloat16:
        scales = (torch.rand(kv_heads, device="cuda", generator=gen) + 0.05,
                  torch.rand(kv_heads, device="cuda", generator=gen) + 0.05)
    return SimpleNamespace(
        q=q.view(n, heads, head_dim), k=k.view(n, kv_heads, head_dim),
        v=v.view(n, kv_heads, head_dim),
        positions=torch.tensor([max(s - 1, 0) for s in seq_lens], device="cuda"),
        slots=torch.tensor(slots, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        tables=tables, cache=cache.to(cache_dtype), scales=scales,
        rope=RotaryEmbedding(head_dim, 8192, {"rope_type": "default", "rope_theta": 500000.0},
                             torch.device("cuda")),
        scale=head_dim**-0.5,
    )


def _assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_equal_but_mma_order(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 attention outputs of the fused kernel and the unfused pair: the same values in and the
    same math, but two compilations. With q joined in registers (the fused kernel) rather than
    loaded from memory, some outputs come out one bf16 step apart, deterministically: measured
    on an H200, 0-54 of 16384 per case, only with bf16 caches (benchmarks/QUANT_TP.md, ninth
    session). So: under 1% of the outputs, each within bf16 rounding. (A stale or missing new
    K/V row, or a wrong merge, moves most outputs by ~1e-2 or more.)"""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    diff = (got.float() - want.float()).abs().flatten()
    worst = int(diff.argmax())
    note = (f"{int((diff > 0).sum())} of {diff.numel()} outputs differ, worst by "
            f"{float(diff[worst]):.3g} at {float(want.flatten()[worst]):.3g}")
    print(note)
    assert (diff > 0).float().mean() < 0.01, note
    torch.testing.assert_close(got, want, atol=4e-3, rtol=2**-6, msg=note)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("seq_lens", [[300], [300, 0, 1000, 17]], ids=["batch1", "padded"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotary_store_decode_attention_equals_two_kernels(cache_dtype, seq_lens, num_splits,
                                                          window):
    from shard.kernels.attention_decode import paged_decode_attention, rotary_store_decode_attention
    from shard.kernels.elementwise import rotary_store_kv

    d = _decode_step(cache_dtype, seq_lens, seed=len(seq_lens) + num_splits)
    fused_cache, want_cache = d.cache.clone(), d.cache.clone()
    fp8_max = float(torch.finfo(cache_dtype).max) if d.scales[0] is not None else 0.0
    q_rot = rotary_store_kv(d.positions, d.q, d.k, d.v, d.rope.cos, d.rope.sin, *want_cache,
                            d.slots, *d.scales, fp8_max)
    want = paged_decode_attention(q_rot, *want_cache, d.tables, d.seq_lens, d.scale, window,
                                  num_splits, k_scale=d.scales[0], v_scale=d.scales[1])
    got = rotary_store_decode_attention(d.q, d.k, d.v, d.positions, d.rope.cos, d.rope.sin,
                                        *fused_cache, d.slots, d.tables, d.seq_lens, d.scale,
                                        window, num_splits, k_scale=d.scales[0],
                                        v_scale=d.scales[1])
    _assert_equal_but_mma_order(got, want)
    _assert_same_bytes(fused_cache, want_cache)
    assert not torch.equal(fused_cache.view(torch.uint8), d.cache.view(torch.uint8))  # stored
    for i, s in enumerate(seq_lens):
        if s == 0:
            assert not got[i].any()  # padding row: zeros


@pytest.mark.parametrize("by_split", [False, True], ids=["block-merge", "merge-by-split"])
@pytest.mark.parametrize("seq_lens", [[1024], [1024, 0, 700, 33]], ids=["batch1", "padded"])
def test_last_split_merges_under_stress(seq_lens, by_split):
    """The split that finishes last merges its (sequence, KV head) (the split kernel's ticket
    protocol). 16 splits, 60 launches queued back to back with new queries and read after one
    sync: each equals one split's result (no merge) to rounding, and every ticket counter is
    back at zero. A merge that read a split's partial before it was written, or an earlier
    launch's, would be off by a whole split's weight (~1/16 of the output)."""
    from shard.kernels import attention_decode

    d = _decode_step(torch.bfloat16, seq_lens, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    results = []
    with attention_decode.merge_by_split(by_split):
        for _ in range(60):
            q = torch.randn(d.q.shape, device="cuda", generator=gen).to(torch.bfloat16)
            split = attention_decode.paged_decode_attention(q, *d.cache, d.tables, d.seq_lens,
                                                         d.scale, None, 16)
            whole = attention_decode.paged_decode_attention(q, *d.cache, d.tables, d.seq_lens,
                                                         d.scale, None, 1)
            results.append((split, whole))
    torch.cuda.synchronize()
    for i, (split, whole) in enumerate(results):
        torch.testing.assert_close(split, whole, atol=2e-3, rtol=1e-2, msg=f"launch {i}")
    assert not torch.equal(results[0][0], results[1][0])  # new queries, new outputs
    assert attention_decode._TICKETS.all_zero(d.q.device)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_stamps_change_nothing_and_follow_the_points(num_splits):
    """The split kernel with its %globaltimer stamps (benchmarks/attention_stamps.py): the same
    output and cache bytes as without; every program's stamps rise in STAMP_POINTS' order, and
    with several splits exactly one program per (sequence, KV head) merges, after its ticket."""
    from shard.kernels.attention_decode import rotary_store_decode_attention
    from shard.kernels.stamps import STAMP_SLOTS

    d = _decode_step(torch.bfloat16, [300, 700], seed=3)
    caches = (d.cache.clone(), d.cache.clone())
    programs = 2 * d.k.shape[1] * num_splits
    stamps = torch.zeros(programs, STAMP_SLOTS, dtype=torch.int64, device="cuda")
    outs = [rotary_store_decode_attention(d.q, d.k, d.v, d.positions, d.rope.cos, d.rope.sin,
                                          *cache, d.slots, d.tables, d.seq_lens, d.scale, None,
                                          num_splits, stamps=st)
            for cache, st in zip(caches, (None, stamps), strict=True)]
    _assert_same_bytes(outs[0], outs[1])
    _assert_same_bytes(caches[0], caches[1])
    s = stamps.cpu()
    passed = [0, 1, 2, 3, 7] if num_splits == 1 else [0, 1, 2, 3, 4, 5]
    assert bool((s[:, passed] > 0).all())
    assert bool((s[:, passed].diff(dim=1) >= 0).all())
    if num_splits > 1:
        merged = s[:, 6] > 0
        assert int(merged.sum()) == programs // num_splits
        assert bool((s[merged, 6] >= s[merged, 5]).all())
        assert not bool((s[:, 7] > 0).any())


@pytest.mark.parametrize("seq_lens", [[300], [300, 0, 1000, 17]], ids=["batch1", "padded"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fused_decode_backend_in_cuda_graph_equals_two_kernels(cache_dtype, seq_lens):
    """CudaAttentionBackend.rotate_write_and_attend_decode captured in a CUDA graph (static
    inputs, the backend's own split count), replayed for two different steps: output and cache
    equal rotate_and_write_kv + attend run eagerly."""
    from shard.attention.base import AttentionMetadata
    from shard.attention.cuda_backend import CudaAttentionBackend
    from shard.quantization.kv_cache import KvScales

    backend = CudaAttentionBackend("cuda")
    first = _decode_step(cache_dtype, seq_lens, seed=1)
    n, width = len(seq_lens), first.tables.shape[1] + 4
    kv_scales = None if first.scales[0] is None else KvScales(*first.scales)
    # Static buffers the graph reads; capture-time contents write and read nothing. q/k/v are
    # column views of one merged projection buffer, as in the model.
    heads, kv_heads, head_dim = first.q.shape[1], first.k.shape[1], first.q.shape[2]
    qkv = torch.zeros(n, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(n, -1, head_dim) for t in (q, k, v))
    positions = torch.zeros(n, dtype=torch.int64, device="cuda")
    slots = torch.full((n,), -1, dtype=torch.int64, device="cuda")
    lens = torch.zeros(n, dtype=torch.int32, device="cuda")
    tables = torch.zeros(n, width, dtype=torch.int32, device="cuda")
    cache = torch.zeros_like(first.cache)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"), seq_lens=lens,
        block_tables=tables, slot_mapping=slots, max_query_len=1, max_seq_len=width * 16,
        query_lens_host=[1] * n, seq_lens_host=[1] * n)

    def fused() -> torch.Tensor:
        return backend.rotate_write_and_attend_decode(first.rope, positions, q, k, v, *cache,
                                                      meta, first.scale, None, kv_scales)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: Triton compilation
        fused()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused()

    for seed, lens_now in ((2, seq_lens), (3, [s // 3 for s in seq_lens])):
        d = _decode_step(cache_dtype, lens_now, seed, num_blocks=cache.shape[1])
        for dst, src in ((q, d.q), (k, d.k), (v, d.v), (positions, d.positions), (slots, d.slots),
                         (lens, d.seq_lens), (cache, d.cache)):
            dst.copy_(src)
        tables.zero_()
        tables[:, : d.tables.shape[1]] = d.tables
        graph.replay()
        want_cache = d.cache.clone()
        q_rot = backend.rotate_and_write_kv(first.rope, positions, q, k, v, *want_cache, slots,
                                            kv_scales)
        want = backend.attend(q_rot, *want_cache, meta, first.scale, None, kv_scales)
        torch.cuda.synchronize()
        _assert_equal_but_mma_order(out, want)
        _assert_same_bytes(cache, want_cache)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3fn"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window
def test_model_decode_takes_fused_path_and_equals_unfused(tmp_path, monkeypatch, arch,
                                                          kv_cache_dtype):
    """A tiny bf16 model's decode steps through the fused kernel (LlamaAttention.forward) give
    logits bit-equal to the two-kernel path (the backend's fuse_rotary_into_decode switched off)."""
    from shard.attention.cuda_backend import CudaAttentionBackend
    from shard.distributed.groups import Dist
    from shard.server.loader import Shard, ShardConfig
    from shard.runner.model_runner import StepInputs
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(tmp_path / arch, TinyModelSpec(arch=arch))
    prompts = [list(range(1, 30)), [7] * 60, [3, 4]]
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(prompts))]  # 128 positions
    calls: list[int] = []  # one entry per call of the fused decode method
    method = CudaAttentionBackend.rotate_write_and_attend_decode

    def spy(self: CudaAttentionBackend, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return method(self, *args, **kwargs)

    def run(fuse: bool = True) -> tuple[list[torch.Tensor], int]:
        """Prefill, then 20 decode steps: the logits of every step, and how many times the
        fused decode method ran during the decode steps."""
        # Key rotation (the fp8 default) takes the unfused path by design; this test is about
        # the fused kernel, so fp8 runs here store keys unrotated.
        shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16", device="cuda",
                                  attention_backend="triton", kv_cache_dtype=kv_cache_dtype,
                                  kv_cache_rotation="none"),
                      Dist())
        runner = shard.runner
        runner.attention.fuse_rotary_into_decode = fuse
        runner.allocate_kv_cache(32)
        prefill = StepInputs([], [], [], [], [], [])
        for p, t in zip(prompts, tables):
            prefill.logits_indices.append(len(prefill.token_ids) + len(p) - 1)
            prefill.token_ids.extend(p)
            prefill.positions.extend(range(len(p)))
            prefill.query_lens.append(len(p))
            prefill.seq_lens.append(len(p))
            prefill.block_tables.append(t)
        logits = [runner.execute(prefill)]
        lens = [len(p) for p in prompts]
        before = len(calls)
        for step in range(20):  # fixed tokens: both runs compute the same thing
            ids = [(step * 31 + i * 7) % 500 + 1 for i in range(len(prompts))]
            logits.append(runner.execute(StepInputs(
                ids, lens, [1] * len(prompts), [n + 1 for n in lens], tables,
                list(range(len(prompts))))))
            lens = [n + 1 for n in lens]
        return [x.float().cpu() for x in logits], len(calls) - before

    monkeypatch.setattr(CudaAttentionBackend, "rotate_write_and_attend_decode", spy)
    fused, decode_calls = run()
    assert decode_calls == len(calls) == 20 * 2  # each decode step's 2 layers, no prefill
    unfused, unfused_calls = run(fuse=False)
    assert unfused_calls == 0
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("seq_lens", [[300], [300, 0, 1000, 17]], ids=["batch1", "padded"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fused_decode_with_head_norms_equals_norm_launch_then_two_kernels(cache_dtype, seq_lens,
                                                                         offset):
    """q/k per-head RMSNorms inside the fused decode kernel (HeadNorms) against the separate
    qk_rms_norm launch before the unfused pair: the new K/V rows and the outputs within bf16
    rounding (the fused norm adds the sum of squares' two halves apart: an fp32 reassociation,
    which can move a normalized value by one bf16 step). A missing or misapplied norm or
    weight moves them by far more (the weights are drawn in [0.5, 1.5))."""
    from shard.kernels.attention_decode import paged_decode_attention, rotary_store_decode_attention
    from shard.kernels.elementwise import rotary_store_kv
    from shard.kernels.head_norms import HeadNorms
    from shard.kernels.qk_norm import qk_rms_norm

    d = _decode_step(cache_dtype, seq_lens, seed=7 + len(seq_lens))
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.rand(2, d.q.shape[-1], device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    norms = HeadNorms(w[0], w[1], 1e-6, offset)
    fused_cache, want_cache = d.cache.clone(), d.cache.clone()
    fp8_max = float(torch.finfo(cache_dtype).max) if d.scales[0] is not None else 0.0
    q, k = qk_rms_norm(d.q, d.k, w[0], w[1], 1e-6, offset)
    q_rot = rotary_store_kv(d.positions, q, k, d.v, d.rope.cos, d.rope.sin, *want_cache,
                            d.slots, *d.scales, fp8_max)
    want = paged_decode_attention(q_rot, *want_cache, d.tables, d.seq_lens, d.scale, None, 5,
                                  k_scale=d.scales[0], v_scale=d.scales[1])
    got = rotary_store_decode_attention(d.q, d.k, d.v, d.positions, d.rope.cos, d.rope.sin,
                                        *fused_cache, d.slots, d.tables, d.seq_lens, d.scale,
                                        None, 5, k_scale=d.scales[0], v_scale=d.scales[1],
                                        head_norms=norms)
    torch.testing.assert_close(got, want, atol=8e-3, rtol=2**-6)
    rows = d.slots[d.slots >= 0]
    for a, b in zip(fused_cache, want_cache):  # the new tokens' rows: one cache step apart
        a, b = (c.view(-1, *c.shape[2:])[rows].float() for c in (a, b))
        step = 2**-7 if cache_dtype == torch.bfloat16 else 2**-3
        assert ((a - b).abs() <= step * b.abs() + 2**-9).all()
    for i, s in enumerate(seq_lens):
        if s == 0:
            assert not got[i].any()
