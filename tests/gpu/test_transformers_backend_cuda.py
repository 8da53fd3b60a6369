"""The transformers backend on CUDA: a trained tiny Llama forced through the backend decodes
from CUDA graphs (Triton attention) and generates what the native path does, token for token;
a MoE model runs eager (declared not graph-safe) and matches transformers' own generate.

Run on a GPU machine: `pytest -m gpu tests/gpu`. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _shard(model_dir, impl: str, dtype: str = "bfloat16"):
    from shard.distributed.groups import Dist
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(model_dir), dtype=dtype, device="cuda",
                              model_impl=impl), Dist())
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
    return shard


def test_forced_backend_decodes_from_graphs_and_equals_native(tmp_path):
    from shard.testing.tiny import greedy_tokens
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
    from shard.tools.tiny_training import RECOMMENDED_STEPS

    model_dir = make_tiny_model(tmp_path / "llama",
                                TinyModelSpec("llama", train_steps=RECOMMENDED_STEPS))
    native = greedy_tokens(_shard(model_dir, "native"))
    backend = _shard(model_dir, "transformers")
    assert backend.info.model_impl == "transformers" and backend.info.cuda_graphs
    assert backend.runner.graphs is not None
    assert greedy_tokens(backend) == native
    assert backend.runner.last_path == "decode_graph"


def test_moe_runs_eager_and_matches_transformers(tmp_path):
    import transformers

    from shard.runner.model_runner import StepInputs
    from shard.tools.tiny_any import write_tiny_any

    model_dir = write_tiny_any(tmp_path / "qwen2_moe", "qwen2_moe")
    # forced: under auto qwen2_moe is native now (tests/gpu/test_moe_cuda.py)
    shard = _shard(model_dir, "transformers", dtype="float32")
    assert shard.info.model_impl == "transformers" and not shard.info.cuda_graphs
    prompt = [(7 * i + 3) % 500 + 3 for i in range(20)]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        want = ref(torch.tensor([prompt])).logits[0, -1]
    got = shard.runner.execute(StepInputs(prompt, list(range(20)), [20], [20], [[0, 1]], [19]))
    torch.testing.assert_close(got[0].cpu(), want, atol=2e-3, rtol=2e-3)
