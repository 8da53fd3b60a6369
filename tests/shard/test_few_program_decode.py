"""CudaAttentionBackend.few_program_decode (shard/attention/cuda_backend.py): decode-only steps with
few (sequence, KV head) programs (batch 1 of a 4-KV-head model) launch the split kernel with the
option's split count and tile; larger batches keep the kernel's defaults. Under Triton's
interpreter on CPU tensors (float32): both decode entry points (attend on a decode-only step, and
the fused rotary + cache store + attention) give the default tiling's output and cache contents
with the option's arguments actually passed to the kernel (a recorder around the kernel module).
"""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import INT_MASK_PRELUDE, INTERPRETER_MARKS, run_interpreted

# The kernel module, recording each launch's keyword arguments (both checks below).
_RECORDER = textwrap.dedent(
    """
    class Recorder:
        def __init__(self, module):
            self.module, self.calls = module, []

        def __getattr__(self, name):
            fn = getattr(self.module, name)
            if not name.endswith("decode_attention"):
                return fn

            def wrapped(*args, **kwargs):
                self.calls.append(kwargs)
                return fn(*args, **kwargs)
            return wrapped
    """
)

_CHECK = textwrap.dedent(
    """
    import torch

    from shard.attention.cuda_backend import CudaAttentionBackend, DecodeTiling
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.layers.rotary import RotaryEmbedding
    from shard.testing.paged_batch import random_paged_step

    heads, kv_heads, hd, page = 8, 4, 32, 16
    tiling = DecodeTiling(max_programs=4, num_splits=8, block_n=16, num_warps=2, num_stages=1)
    reference = TorchAttentionBackend()
    for seq_lens in ([100], [7], [37, 60]):  # batch 1 (4 programs): the option; batch 2: not
        q, cache, meta = random_paged_step([1] * len(seq_lens), seq_lens, heads, kv_heads, hd,
                                           page)
        want = reference.attend(q, *cache, meta, 0.2, None)
        outs = {}
        for opt in (None, tiling):
            backend = CudaAttentionBackend("cpu", use_flash_attn=False, num_sms=132)
            backend.few_program_decode = opt
            backend.short_decode = None  # (None: the kernel's defaults, not the short launch)
            backend._decode = rec = Recorder(backend._decode)
            outs[opt] = got = backend.attend(q, *cache, meta, 0.2, None)
            assert float((got - want).abs().max()) < 2e-5, (seq_lens, opt)
            kw = rec.calls[-1]
            applies = opt is not None and len(seq_lens) == 1
            if applies:
                assert (kw["num_splits"], kw["block_n"], kw["num_warps"], kw["num_stages"]) == (
                    8, 16, 2, 1), kw
            else:
                assert "block_n" not in kw and kw["num_splits"] == 16, kw

    # the fused rotary + store + attention at batch 1: same cache contents, same output
    rotary = RotaryEmbedding(hd, 256, {"rope_theta": 10000.0, "rope_type": "default"},
                             torch.device("cpu"))
    q, cache, meta = random_paged_step([1], [70], heads, kv_heads, hd, page, seed=3)
    meta.slot_mapping[0] = int(meta.block_tables[0, 69 // page]) * page + 69 % page
    k, v = torch.randn(1, kv_heads, hd), torch.randn(1, kv_heads, hd)
    pos = torch.tensor([69])
    results = []
    for opt in (None, tiling):
        backend = CudaAttentionBackend("cpu", use_flash_attn=False, num_sms=132)
        backend.few_program_decode = opt
        backend.short_decode = None
        backend._decode = rec = Recorder(backend._decode)
        kc, vc = cache[0].clone(), cache[1].clone()
        out = backend.rotate_write_and_attend_decode(rotary, pos, q, k, v, kc, vc, meta, 0.2,
                                                     None)
        assert rec.calls[-1]["num_splits"] == (8 if opt else 16)
        assert rec.calls[-1].get("block_n") == (16 if opt else None)
        results.append((out, kc, vc))
    (o1, k1, v1), (o2, k2, v2) = results
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert float((o1 - o2).abs().max()) < 2e-5
    """
)


@INTERPRETER_MARKS[0]
@INTERPRETER_MARKS[1]
def test_few_program_decode_tiling_in_interpreter():
    run_interpreted(INT_MASK_PRELUDE + _RECORDER + _CHECK)  # the fused mode's early-tile reload


# CudaAttentionBackend.short_decode: a decode-only step whose contexts all fit its bound
# (meta.max_seq_len, which a short-context CUDA graph is captured with) at a batch up to its
# max_batch launches with its tile, warps and stages; a longer context, a larger batch, or
# few_program_decode set (which wins) keep the other launch. The outputs equal the reference.
_SHORT_CHECK = textwrap.dedent(
    """
    import torch

    from shard.attention.cuda_backend import CudaAttentionBackend, DecodeTiling, ShortDecode
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.testing.paged_batch import random_paged_step

    heads, kv_heads, hd, page = 8, 4, 32, 16
    short = ShortDecode(max_context=64, max_batch=1, block_n=16, num_warps=2, num_stages=1)
    assert TorchAttentionBackend().short_decode_context(1) == 0  # the protocol's default
    default = CudaAttentionBackend("cpu", use_flash_attn=False, num_sms=132)
    assert default.short_decode == ShortDecode() and default.short_decode_context(1) == 512
    reference = TorchAttentionBackend()
    for seq_lens, few, applies in (([50], None, True), ([64], None, True), ([65], None, False),
                                   ([37, 60], None, False),
                                   ([50], DecodeTiling(max_programs=4), False)):
        q, cache, meta = random_paged_step([1] * len(seq_lens), seq_lens, heads, kv_heads, hd,
                                           page)
        assert meta.max_seq_len == max(seq_lens)
        backend = CudaAttentionBackend("cpu", use_flash_attn=False, num_sms=132)
        backend.short_decode = short
        backend.few_program_decode = few
        n = len(seq_lens)
        assert backend.short_decode_context(n) == (64 if n == 1 and few is None else 0)
        backend._decode = rec = Recorder(backend._decode)
        got = backend.attend(q, *cache, meta, 0.2, None)
        want = reference.attend(q, *cache, meta, 0.2, None)
        assert float((got - want).abs().max()) < 2e-5, seq_lens
        kw = rec.calls[-1]
        if applies:
            assert (kw["block_n"], kw["num_warps"], kw["num_stages"]) == (16, 2, 1), kw
        else:
            assert kw.get("block_n") is None, (seq_lens, kw)
    """
)


@INTERPRETER_MARKS[0]
@INTERPRETER_MARKS[1]
def test_short_decode_launch_for_contexts_within_its_bound_in_interpreter():
    run_interpreted(_RECORDER + _SHORT_CHECK)


def test_a_step_replays_the_short_graph_only_when_every_context_fits() -> None:
    from shard.runner.cuda_graphs import fits_short_graph

    assert fits_short_graph(512, [512]) and fits_short_graph(512, [3, 512])
    assert not fits_short_graph(512, [513]) and not fits_short_graph(512, [3, 600])
    assert not fits_short_graph(0, [1])  # no short graph for the bucket
