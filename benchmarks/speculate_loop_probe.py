"""Which prompts make a random Llama-3-8B-shaped model's greedy output loop? (issue 24)

    python -m benchmarks.speculate_loop_probe LAYERS CONTEXT NEW_TOKENS KINDS [bf16]
    e.g.  python -m benchmarks.speculate_loop_probe 4 512 128 rand,pat:2,pat:1

The GPU part of benchmarks/speculate.py needs a workload where the model's own greedy output
repeats (high n-gram acceptance). This probe answers on a CPU with the 8B config cut to a few
layers and the benchmark checkpoint's init (shard/testing/checkpoint.py: every weight N(0, 0.02),
norms 1, lm_head's EOS rows 0; drawn here by torch's CPU generator, so not the same numbers):
greedy-generates NEW_TOKENS after a prompt of CONTEXT tokens of each KIND and prints, per prompt,
from where the output is periodic and with which period, and the acceptance the router's own
proposer (service.scheduler.speculation.NgramIndex, 4 drafts) would get on it. KINDS: `rand`
(random ids), `pat:P` (a random pattern of P ids repeated). One JSON line per prompt.
"""

from __future__ import annotations

import json
import random
import sys
import time


def simulated_acceptance(prompt: list[int], out: list[int], k: int = 4) -> tuple[int, int, int]:
    """(steps, proposed, accepted) of greedy speculative decoding of `out` after `prompt` with the
    router's proposer: each step proposes up to k tokens, accepts the matching prefix, emits one
    more."""
    from service.scheduler.speculation import NgramIndex

    idx = NgramIndex()
    tokens, i, steps, proposed, accepted = list(prompt), 0, 0, 0, 0
    while i < len(out):
        left = len(out) - i - 1
        drafts = idx.propose(tokens, min(k, left)) if left > 0 else []
        a = 0
        while a < len(drafts) and drafts[a] == out[i + a]:
            a += 1
        proposed, accepted = proposed + len(drafts), accepted + a
        tokens += out[i : i + a + 1]
        i, steps = i + a + 1, steps + 1
    return steps, proposed, accepted


def main(argv: list[str]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.speculate import _period, _runs
    from shard.testing.checkpoint import EOS_IDS, LLAMA3_8B

    layers, context, new = int(argv[0]), int(argv[1]), int(argv[2])
    kinds = argv[3].split(",")
    dtype = torch.bfloat16 if argv[4:] == ["bf16"] else torch.float32
    cfg = LlamaConfig(**dict(LLAMA3_8B, num_hidden_layers=layers), head_dim=128,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen).to(dtype))
        model.lm_head.weight[list(EOS_IDS)] = 0
    model.model.rotary_emb.__init__(cfg)  # its buffers were left empty by to_empty
    model.eval()
    rng = random.Random(0)
    for kind in kinds:
        name, _, arg = kind.partition(":")
        if name == "rand":
            prompt = [rng.randrange(10, 128000) for _ in range(context)]
        else:
            pattern = [rng.randrange(10, 128000) for _ in range(int(arg))]
            prompt = (pattern * context)[:context]
        t = time.time()
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, context, dtype=torch.long))
        out = ids[0, context:].tolist()
        start, period = _period(out)
        steps, proposed, accepted = simulated_acceptance(prompt, out)
        print(json.dumps({
            "layers": layers, "context": context, "prompt": kind, "dtype": str(dtype),
            "loops_from": start, "period": period, "distinct_tokens": len(set(out)),
            "tokens_in_prompt": sum(1 for x in out if x in set(prompt)),
            "tokens_per_pass": round(len(out) / steps, 2),
            "acceptance": round(accepted / proposed, 3) if proposed else None,
            "seconds": round(time.time() - t, 1), "runs": _runs(out),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
