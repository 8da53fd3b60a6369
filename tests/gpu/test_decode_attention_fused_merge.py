"""Split-KV paged decode with the merge fused into the split kernel (the last split of each
(sequence, KV head) to take a ticket merges; shard/attention/triton_decode.py, FUSED_MERGE)
against the two-kernel path (split kernel + _decode_merge_kernel) and a float32 torch reference,
over repeated calls and CUDA-graph replays: the tickets buffer must come back zeroed every time.

Run on a GPU machine: `pytest -m gpu tests/gpu/test_decode_attention_fused_merge.py`. Without
CUDA every test here is skipped, and nothing GPU-only is imported at collection time.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16  # ShardConfig.block_size's default: the cache block size the engine uses


def _make(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_len: int,
    fp8: bool = False,
    seed: int = 0,
) -> dict:
    """A paged cache [blocks, BLOCK_SIZE, num_kv_heads, head_dim] with shuffled block tables room
    for max_len tokens per sequence, and per-KV-head scales for an fp8 cache."""
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    per = -(-max(max_len, 1) // BLOCK_SIZE)
    blocks = num_seqs * per + 1
    kc = torch.randn(blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev)
    vc = torch.randn(blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev)
    tables = torch.randperm(num_seqs * per, device=dev).view(num_seqs, per).to(torch.int32)
    ks = vs = None
    if fp8:  # |x / scale| < ~250: no e4m3 saturation
        ks = torch.rand(num_kv_heads, device=dev) * 0.1 + 0.02
        vs = torch.rand(num_kv_heads, device=dev) * 0.1 + 0.02
        kc = (kc / ks[:, None]).to(torch.float8_e4m3fn)
        vc = (vc / vs[:, None]).to(torch.float8_e4m3fn)
    else:
        kc, vc = kc.bfloat16(), vc.bfloat16()
    heads = num_kv_heads * group
    return {"kc": kc, "vc": vc, "tables": tables, "ks": ks, "vs": vs, "heads": heads}


def _query(num_seqs: int, num_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(num_seqs, num_heads, head_dim, device="cuda", generator=g).bfloat16()


def _reference(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    c: dict,
    seq_lens: list[int],
    window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] fp32; zeros for seq_len 0
    num_seqs, num_heads, hd = q.shape
    kvh = c["kc"].shape[2]
    out = torch.zeros(num_seqs, num_heads, hd, device=q.device)
    for i, n in enumerate(seq_lens):
        if n == 0:
            continue
        pos = torch.arange(max(n - window, 0) if window else 0, n, device=q.device)
        slots = c["tables"][i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k = c["kc"].view(-1, kvh, hd)[slots].float()  # [n, kvh, hd]
        v = c["vc"].view(-1, kvh, hd)[slots].float()
        if c["ks"] is not None:
            k, v = k * c["ks"][None, :, None], v * c["vs"][None, :, None]
        k = k.repeat_interleave(num_heads // kvh, 1)  # [n, num_heads, hd]
        v = v.repeat_interleave(num_heads // kvh, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * hd**-0.5
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def _within_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 tensors equal up to one unit in the last place (the merges sum in another order)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2**-7).all())


def _check_against_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert (out.float() - ref).abs().max().item() < 2e-2
    assert ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item() < 1e-2


def _decode(q: torch.Tensor, c: dict, seq_lens: torch.Tensor, **kw) -> torch.Tensor:
    from shard.attention.triton_decode import paged_decode_attention

    hd = q.shape[-1]
    return paged_decode_attention(
        q,
        c["kc"],
        c["vc"],
        c["tables"],
        seq_lens,
        hd**-0.5,
        k_scale=c["ks"],
        v_scale=c["vs"],
        **kw,
    )


@pytest.mark.parametrize(
    ("num_seqs", "kvh", "group", "hd", "lens", "window", "fp8"),
    [
        (1, 4, 4, 128, [1024], None, False),  # Llama-3-8B TP=2 decode: 16 heads, 4 KV heads
        (1, 4, 4, 128, [1024], None, True),  # ... with an fp8 cache and per-KV-head scales
        (8, 4, 4, 128, [1024, 1, 0, 17, 500, 1023, 64, 2048], None, False),  # padding, empty splits
        (2, 1, 8, 128, [4096, 3], None, False),  # Llama-3-70B TP=8: 8 heads, 1 KV head
        (3, 8, 1, 64, [300, 0, 129], None, False),  # no GQA, head_dim 64
        (1, 4, 4, 128, [3000], 1024, False),  # sliding window
        (2, 2, 6, 80, [777, 5], None, False),  # head_dim below BLOCK_D, group not a power of 2
    ],
)
def test_fused_merge_equals_two_kernels_and_reference(num_seqs, kvh, group, hd, lens, window, fp8):
    from shard.attention import triton_decode

    c = _make(num_seqs, kvh, group, hd, max(lens), fp8)
    q = _query(num_seqs, c["heads"], hd, 1)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = triton_decode.default_num_splits(num_seqs, kvh, sms)
    assert splits > 1  # the shapes above are all small enough to split
    two = _decode(q, c, sl, sliding_window=window)
    tickets = torch.zeros(1024, dtype=torch.int32, device="cuda")
    fused = [_decode(q, c, sl, sliding_window=window, tickets=tickets) for _ in range(3)]
    torch.cuda.synchronize()
    assert not tickets.any()
    ref = _reference(q, c, lens, window)
    _check_against_reference(two, ref)
    for out in fused:
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        assert _within_ulp(out, two)
        _check_against_reference(out, ref)
        # The merge reads the splits in a fixed order whichever program does it: deterministic.
        assert torch.equal(out, fused[0])
        assert not out[sl == 0].any()  # padding rows stay zeros


def test_fused_merge_many_programs_alternating_inputs():
    """Many (seq, KV head) groups and splits at once, inputs alternating call to call: a merge
    that read a stale partial (the previous call's, at the same address) would show."""
    lens = [2048, 1, 0, 700, 64, 1500, 33, 1024] * 2
    c = _make(len(lens), 8, 4, 128, max(lens), seed=2)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qs = [_query(len(lens), c["heads"], 128, s) for s in (3, 4)]
    want = [_decode(q, c, sl, num_splits=8) for q in qs]
    tickets = torch.zeros(1024, dtype=torch.int32, device="cuda")
    outs = [_decode(qs[i % 2], c, sl, num_splits=8, tickets=tickets) for i in range(40)]
    torch.cuda.synchronize()
    assert not tickets.any()
    for i, out in enumerate(outs):
        assert _within_ulp(out, want[i % 2]), i
        assert torch.equal(out, outs[i % 2]), i


def _decode_meta(seq_lens: torch.Tensor, tables: torch.Tensor, lens: list[int]):
    from shard.attention.base import AttentionMetadata

    n = len(lens)
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device="cuda"),
        max_query_len=1,
        max_seq_len=max(lens),
        query_lens_host=[1] * n,
        seq_lens_host=list(lens),
    )


def test_backend_decode_is_one_launch_and_leaves_tickets_zero(monkeypatch):
    from shard.attention import triton_decode
    from shard.attention.cuda_backend import CudaAttentionBackend

    lens = [1024, 0, 37]
    c = _make(len(lens), 4, 4, 128, max(lens))
    q = _query(len(lens), c["heads"], 128, 5)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    two = _decode(q, c, sl)
    be = CudaAttentionBackend(torch.device("cuda"))
    assert be.num_decode_splits(len(lens), 4) > 1
    monkeypatch.setattr(triton_decode, "_decode_merge_kernel", None)  # launching it would raise
    out = be.attend(q, c["kc"], c["vc"], _decode_meta(sl, c["tables"], lens), 128**-0.5, None)
    torch.cuda.synchronize()
    assert not be._decode_tickets.any()
    assert _within_ulp(out, two)
    _check_against_reference(out, _reference(q, c, lens))


def test_fused_merge_in_cuda_graph_replays():
    """Capture the backend's decode once (Llama-3-8B TP=2 shape, a padding row), replay it 5
    times with other lengths and queries: each replay equals eager two-kernel decode and the
    reference, and leaves the tickets zeroed for the next."""
    from shard.attention.cuda_backend import CudaAttentionBackend

    num_seqs, kvh, group, hd, max_len = 4, 4, 4, 128, 2048
    c = _make(num_seqs, kvh, group, hd, max_len, seed=6)
    be = CudaAttentionBackend(torch.device("cuda"))
    q = torch.zeros(num_seqs, c["heads"], hd, dtype=torch.bfloat16, device="cuda")
    sl = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    meta = _decode_meta(sl, c["tables"], [max_len] * num_seqs)

    def step() -> torch.Tensor:
        return be.attend(q, c["kc"], c["vc"], meta, hd**-0.5, None)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: Triton compilation, allocator
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    assert not be._decode_tickets.any()
    replays = [
        [1024, 1, 17, 0],
        [1, 2048, 0, 640],
        [1000, 999, 998, 0],
        [5, 0, 0, 0],
        [2048, 2048, 2048, 2048],
    ]
    for i, lens in enumerate(replays):
        q.copy_(_query(num_seqs, c["heads"], hd, 10 + i))
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        got = out.clone()
        torch.cuda.synchronize()
        assert not be._decode_tickets.any(), i
        assert _within_ulp(got, _decode(q, c, sl)), i
        _check_against_reference(got, _reference(q, c, lens))
        assert not got[sl == 0].any(), i
