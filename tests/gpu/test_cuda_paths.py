"""The CUDA paths (Triton attention, CUDA-graph decode) against the portable torch path.

Run on a GPU machine: `pytest -m gpu tests/gpu`. Without CUDA every test here is skipped, and
nothing GPU-only is imported at collection time.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _load(model_dir: Path, device: str, dtype: str, backend: str):
    from shard.distributed.groups import Dist
    from shard.server.loader import Shard, ShardConfig

    cfg = ShardConfig(model_id=str(model_dir), dtype=dtype, device=device,
                      attention_backend=backend)
    return Shard(cfg, Dist())


def _greedy(runner, prompts: list[list[int]], steps: int, graphs=None, forced=None):
    """Prefill every prompt in one ragged step, then `steps` decode steps; returns the tokens
    and the logits of every step ([num_seqs, vocab] each)."""
    from shard.runner.model_runner import StepInputs

    bs = runner.block_size
    max_len = max(len(p) for p in prompts) + steps + 1
    per = math.ceil(max_len / bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    # Shuffle physical blocks so that paging is really exercised.
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(len(prompts) * per, generator=gen).tolist()
    tables = [[perm[b] for b in t] for t in tables]
    seqs = [list(p) for p in prompts]
    step = StepInputs([], [], [], [], [], [])
    for p, t in zip(prompts, tables):
        step.logits_indices.append(len(step.token_ids) + len(p) - 1)
        step.token_ids.extend(p)
        step.positions.extend(range(len(p)))
        step.query_lens.append(len(p))
        step.seq_lens.append(len(p))
        step.block_tables.append(t)
    all_logits = []
    logits = runner.execute(step)
    for _ in range(steps + 1):
        all_logits.append(logits.float().cpu())
        nxt = logits.argmax(-1).tolist()
        if forced is not None:  # feed another run's tokens so that both compute the same thing
            nxt = [f[len(all_logits) - 1] for f in forced]
        for s, tok in zip(seqs, nxt):
            s.append(tok)
        if len(all_logits) > steps:
            break
        ids = [s[-1] for s in seqs]
        pos = [len(s) - 1 for s in seqs]
        lens = [len(s) for s in seqs]
        if graphs is not None:
            logits = graphs.run(ids, pos, lens, tables)
        else:
            logits = runner.execute(StepInputs(ids, pos, [1] * len(seqs), lens, tables,
                                               list(range(len(seqs)))))
    return [s[len(p):] for s, p in zip(seqs, prompts)], all_logits


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.helpers.models import tiny_model

    return tiny_model(tmp_path_factory, "llama")


PROMPTS = [[1, 5, 9, 33, 200, 7], [3] * 40, list(range(10, 90)), [42]]


def test_tiny_greedy_tokens_match_cpu(tiny_llama):
    cpu = _load(tiny_llama, "cpu", "float32", "torch")
    cpu.runner.allocate_kv_cache(64)
    want, _ = _greedy(cpu.runner, PROMPTS, 20)

    gpu = _load(tiny_llama, "cuda", "float32", "auto")
    assert "triton" in gpu.runner.attention.name
    gpu.runner.allocate_kv_cache(64)
    got, _ = _greedy(gpu.runner, PROMPTS, 20)
    assert got == want


def test_tiny_cuda_graph_decode_matches_eager(tiny_llama):
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    gpu = _load(tiny_llama, "cuda", "float32", "auto")
    gpu.runner.allocate_kv_cache(64)
    eager, _ = _greedy(gpu.runner, PROMPTS, 12)
    gpu.runner.allocate_kv_cache(64)
    graphs = CudaGraphDecodeRunner(gpu.runner.forward, gpu.runner.device, gpu.runner.block_size,
                                   max_batch=8, max_blocks_per_seq=16)
    graphs.capture()
    got, _ = _greedy(gpu.runner, PROMPTS, 12, graphs=graphs)  # 4 seqs padded to bucket 4/8
    assert got == eager


def test_short_context_graph_replays_while_contexts_fit_its_bound(tiny_llama):
    """CudaAttentionBackend.short_decode (on by default; its bound lowered here): the runner
    captures a second graph for batch 1 with meta.max_seq_len at the bound (32 positions here)
    and 32-position K/V tiles, and replays it while the context fits, then the default graph;
    the logits match eager decode (fed the same tokens) to float32 rounding of another tiling."""
    from shard.attention.cuda_backend import ShortDecode
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    gpu = _load(tiny_llama, "cuda", "float32", "auto")
    # (eager decode takes the short launch within the same bound: each context is attended with
    # the same tiles both ways, so the logits agree to float32 rounding, not to TF32's)
    gpu.runner.attention.short_decode = ShortDecode(max_context=32, block_n=32)
    gpu.runner.allocate_kv_cache(64)
    prompt = [list(range(5, 25))]  # 20 tokens: contexts 21 .. 44 over 24 steps
    eager, eager_logits = _greedy(gpu.runner, prompt, 24)
    gpu.runner.allocate_kv_cache(64)
    graphs = CudaGraphDecodeRunner(gpu.runner.forward, gpu.runner.device, gpu.runner.block_size,
                                   max_batch=4, max_blocks_per_seq=16,
                                   short_context=gpu.runner.attention.short_decode_context)
    graphs.capture()
    assert graphs.short_limits == {1: 32} and set(graphs.short_graphs) == {1}
    # a runner whose own graphs are bounded by 32 positions takes the short launch in them
    bounded = CudaGraphDecodeRunner(gpu.runner.forward, gpu.runner.device, gpu.runner.block_size,
                                    max_batch=1, max_blocks_per_seq=32 // gpu.runner.block_size,
                                    short_context=gpu.runner.attention.short_decode_context)
    assert bounded.short_limits == {}
    flags = []
    run = graphs.run

    def recording_run(*args, **kwargs):
        out = run(*args, **kwargs)
        flags.append((max(args[2]), graphs.last_short))
        return out

    graphs.run = recording_run
    _, logits = _greedy(gpu.runner, prompt, 24, graphs=graphs, forced=eager)
    assert flags and all(short == (context <= 32) for context, short in flags), flags
    assert {short for _, short in flags} == {True, False}
    for got, want in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_llama3_shape_logits_within_bf16_tolerance(tmp_path):
    """2 layers of the real Llama-3-8B shape: Triton backend vs the portable torch backend on the
    same GPU and weights, prefill + 3 decode steps fed the same tokens."""
    from shard.testing.checkpoint import write_checkpoint

    model_dir = tmp_path / "l3"
    write_checkpoint(model_dir, num_layers=2)
    prompts = [list(range(100, 100 + n)) for n in (37, 300, 5)]
    ref = _load(model_dir, "cuda", "bfloat16", "torch")
    ref.runner.allocate_kv_cache(64)
    ref_tokens, ref_logits = _greedy(ref.runner, prompts, 3)
    ref.runner.kv_cache = None
    del ref
    fast = _load(model_dir, "cuda", "bfloat16", "triton")
    fast.runner.allocate_kv_cache(64)
    _, logits = _greedy(fast.runner, prompts, 3, forced=ref_tokens)
    for a, b in zip(logits, ref_logits):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 2e-2, err
    # Greedy picks agree except where the top two logits are within bf16 noise.
    picks = [lg.argmax(-1) for lg in logits]
    ref_picks = [lg.argmax(-1) for lg in ref_logits]
    agree = sum(int((a == b).sum()) for a, b in zip(picks, ref_picks))
    assert agree >= 10, agree


def test_fused_ops_match_torch_forms():
    """Triton RMSNorm / rotary / SiLU-mul against the portable torch formulas (bf16, CUDA)."""
    import torch.nn.functional as F

    from shard.kernels import elementwise
    from shard.layers.rotary import RotaryEmbedding

    def rotate_half(t):  # the textbook form: cat(-t_hi, t_lo)
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    assert rel(elementwise.rms_norm(x, w, 1e-5), ref) < 1e-2
    d = torch.randn_like(x)
    h, r = elementwise.add_rms_norm(d, x, w, 1e-5)
    sf = (x + d).float()
    assert torch.equal(r, x + d)
    ref = w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    assert rel(h, ref) < 1e-2

    rot = RotaryEmbedding(128, 4096, {"rope_theta": 500000.0, "rope_type": "default"},
                          torch.device("cuda"))
    pos = torch.randint(0, 4096, (29,), device="cuda")
    q = torch.randn(29, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(29, 8, 128, device="cuda", dtype=torch.bfloat16)
    cos = rot.cos[pos].unsqueeze(1).to(q.dtype)
    sin = rot.sin[pos].unsqueeze(1).to(q.dtype)
    got_q, got_k = elementwise.rotary(pos, q, k, rot.cos, rot.sin)
    assert rel(got_q, q * cos + rotate_half(q) * sin) < 1e-2
    assert rel(got_k, k * cos + rotate_half(k) * sin) < 1e-2

    g = torch.randn(33, 14336, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(33, 14336, device="cuda", dtype=torch.bfloat16)
    assert rel(elementwise.silu_mul(g, u), F.silu(g) * u) < 1e-2


def test_fp8_kv_scaled_kernels_match_torch_backend():
    """fp8 cache with per-KV-head scales: the Triton store, decode and prefill kernels equal the
    portable torch backend (same quantized bytes; outputs within bf16 rounding)."""
    from shard.attention.cuda_backend import CudaAttentionBackend
    from shard.attention.torch_backend import TorchAttentionBackend
    from shard.runner.model_runner import ModelRunner, StepInputs
    from shard.quantization.kv_cache import KvScales

    torch.manual_seed(3)
    dev = torch.device("cuda")
    heads, kvh, hd, bs, blocks = 8, 2, 64, 16, 32
    # |k| < ~10, |v| < ~2.5: stored values stay under 448 (no saturation) at these scales
    scales = KvScales(torch.tensor([0.03, 0.05], device=dev), torch.tensor([0.02, 0.01], device=dev))
    runner = ModelRunner(None, None, bs, dev)  # only prepare() is used
    lens = [40, 7, 100]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    step = StepInputs([], [], lens, lens, tables, [])
    n = sum(lens)
    d = runner.prepare(step)
    k = torch.randn(n, kvh, hd, device=dev, dtype=torch.bfloat16) * 2
    v = torch.randn(n, kvh, hd, device=dev, dtype=torch.bfloat16) * 0.5
    q = torch.randn(n, heads, hd, device=dev, dtype=torch.bfloat16)
    caches = []
    for be in (TorchAttentionBackend(), CudaAttentionBackend(dev)):
        kc = torch.zeros(blocks, bs, kvh, hd, device=dev, dtype=torch.float8_e4m3fn)
        vc = torch.zeros_like(kc)
        be.write_kv(k, v, kc, vc, d.meta.slot_mapping, scales)
        caches.append((kc, vc, be.attend(q, kc, vc, d.meta, hd**-0.5, None, scales)))
    (k0, _v0, o0), (k1, v1, o1) = caches
    # Same bytes up to one e4m3 step (fp32 division may round the last bit differently).
    assert (k0.float() - k1.float()).abs().max() <= 32 and (k0.float() != k1.float()).float().mean() < 1e-3
    assert ((o1.float() - o0.float()).norm() / o0.float().norm()).item() < 1e-2
    # Decode over the same cache (one token per sequence, the last position).
    dec = runner.prepare(StepInputs([0] * 3, [x - 1 for x in lens], [1] * 3, lens, tables,
                                    [0, 1, 2]))
    qd = torch.randn(3, heads, hd, device=dev, dtype=torch.bfloat16)
    od0 = TorchAttentionBackend().attend(qd, k1, v1, dec.meta, hd**-0.5, None, scales)
    od1 = CudaAttentionBackend(dev).attend(qd, k1, v1, dec.meta, hd**-0.5, None, scales)
    assert ((od1.float() - od0.float()).norm() / od0.float().norm()).item() < 1e-2
    # Scales really apply: against unquantized attention the error is fp8 rounding (~3%).
    ref = TorchAttentionBackend()
    kc = torch.zeros(blocks, bs, kvh, hd, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    ref.write_kv(k, v, kc, vc, d.meta.slot_mapping)
    o_ref = ref.attend(q, kc, vc, d.meta, hd**-0.5, None)
    assert ((o1.float() - o_ref.float()).norm() / o_ref.float().norm()).item() < 0.06


def test_tiny_fp8_kv_cache_cuda_matches_cpu_path(tiny_llama):
    """--kv-cache-dtype fp8_e4m3fn on CUDA (Triton kernels, graphs) after warmup calibration:
    the scales equal the CPU path's and greedy tokens follow the GPU bf16 cache except at
    near-ties (reported)."""
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    def load(kv):
        s = Shard(ShardConfig(model_id=str(tiny_llama), dtype="bfloat16", device="cuda",
                              kv_cache_dtype=kv, max_batch_total_tokens=2048), Dist())
        s.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
        return s

    fp8 = load("fp8_e4m3fn")
    attn = fp8.runner.model.model.layers[0].self_attn.attn
    assert float(attn.kv_scales.k_scale.min()) < 0.5  # calibrated from the tiny model's range
    assert fp8.runner.graphs is not None
    from shard.testing.tiny import greedy_tokens

    got = greedy_tokens(fp8)
    want = greedy_tokens(load("auto"))
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g))
             for g, w in zip(got, want)]
    print("fp8 KV (CUDA) greedy agreement with bf16 cache, tokens per sequence:", first)
    assert all(len(g) == 32 for g in got)


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory) -> Path:
    """Tiny llama trained on the progression task (CPU, ~5 s): confident greedy choices."""
    from tests.helpers.models import trained_tiny_model

    return trained_tiny_model(tmp_path_factory, "llama")


def test_trained_tiny_fp8_kv_cache_cuda_greedy_32_tokens(trained_llama):
    """Issue 8's acceptance on CUDA: bf16 model, Triton kernels, CUDA-graph decode, after the
    real warmup (fp8 scales calibrated): greedy 32 tokens with an fp8_e4m3fn cache equal the
    bf16 cache's exactly on a model whose choices are clear (the random model above has bf16
    ties, so it cannot show this)."""
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig
    from shard.tools.tiny_training import task_continuation, task_prompts

    prompts = task_prompts((17, 5, 45))

    def run(kv: str) -> tuple[list[list[int]], float]:
        shard = Shard(ShardConfig(model_id=str(trained_llama), dtype="bfloat16", device="cuda",
                                  kv_cache_dtype=kv, max_batch_total_tokens=2048), Dist())
        shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
        assert "triton" in shard.runner.attention.name and shard.runner.graphs is not None
        # The prefill's token + 31 decode steps (graph replays through runner.execute) = 32.
        tokens, logits = _greedy(shard.runner, prompts, 31)
        top2 = torch.stack(logits).topk(2, dim=-1).values  # [32, num_seqs, 2]
        return tokens, float((top2[..., 0] - top2[..., 1]).min())

    want, bf16_margin = run("auto")
    got, fp8_margin = run("fp8_e4m3fn")
    print(f"trained tiny llama on CUDA: min top-2 margin bf16 cache {bf16_margin:.2f}, "
          f"fp8 cache {fp8_margin:.2f}")
    assert want == [task_continuation(p, 32) for p in prompts]  # the bf16 run does the task
    assert got == want
    assert bf16_margin > 1.0
