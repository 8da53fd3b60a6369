"""Native Qwen3, OLMo-2 and Phi-3 on CUDA: the tiny models of tests/shard/test_native_families.py
(each family's quirks on) run a prefill and then decode steps from CUDA graphs through the CUDA
kernels (the q/k-norm kernel, fused rotary -> KV write -> attend with the LongRoPE tables, fused
residual norms), teacher-forced, and every step's logits equal transformers' own forward on CPU
(float32 both; a tolerance for TF32 in the Triton attention's dots).

Run on a GPU machine: `pytest -m gpu tests/gpu`. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.native_families import FAMILIES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PREFILL, DECODE = 20, 16


@pytest.mark.parametrize("family", list(FAMILIES))
def test_graph_decode_logits_equal_transformers(tmp_path, family):
    import transformers

    from shard.distributed.groups import Dist
    from shard.runner.model_runner import StepInputs
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig
    from shard.tools.tiny_any import write_tiny_any

    model_dir = write_tiny_any(tmp_path / family, family, **FAMILIES[family])
    shard = Shard(ShardConfig(model_id=str(model_dir), dtype="float32", device="cuda"), Dist())
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
    runner = shard.runner
    assert shard.info.model_impl == "native" and runner.graphs is not None
    tokens = [(37 * j + 11) % 500 + 3 for j in range(PREFILL + DECODE)]
    table = list(range(-(-len(tokens) // runner.block_size)))
    # Each step's logits are copied out at once: a graph step's are a view of the graph's static
    # output buffer, which the next replay overwrites (a GPU run kept views: every decode row read
    # as the last step's).
    rows = [runner.execute(StepInputs(tokens[:PREFILL], list(range(PREFILL)), [PREFILL],
                                      [PREFILL], [table], list(range(PREFILL)))).float().cpu()]
    for pos in range(PREFILL, len(tokens)):
        step = StepInputs([tokens[pos]], [pos], [1], [pos + 1], [table], [0])
        rows.append(runner.execute(step).float().cpu())
        assert runner.last_path == "decode_graph"
    got = torch.cat(rows)  # [len(tokens), vocab]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]  # [len(tokens), vocab]
    assert (got - want).norm() / want.norm() < 1e-2
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
