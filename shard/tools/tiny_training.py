"""Fits a tiny model's weights to a synthetic sequence task, so that its greedy choices are clear.

Random-weight tiny models have nearly flat next-token logits (top-2 margins of 0.001-0.09), so
any rounding (an fp8 KV cache, bf16, a tensor-parallel all-reduce order) flips greedy picks at
near-ties. A trained model predicts with large margins, like a real checkpoint, and greedy
equality becomes a meaningful test. The task needs attention over the context, so that the KV
cache is on the path of every prediction: arithmetic progressions over a band of token ids,

    BOS, x_0, x_1, ...   with   x_{t+1} = base + (x_t - base + d) mod modulus,

where the stride d is drawn per sequence from a small set; only the previous tokens tell d.
Training is deterministic (fixed seeds, one CPU thread, no dropout) and takes seconds on a CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Enough for top-2 margins well above 1 logit on in-distribution prompts: measured minimum over
# every start and stride and 94 positions, fp32: llama 3.5, mistral 3.2, qwen2 4.0 (150 steps:
# llama 0.8); ~5 s of training each on one CPU core.
RECOMMENDED_STEPS = 200
TASK_FILE = "tokenwire_tiny_task.json"
BATCH_SIZE = 16
# Longer than every test's prompt plus 32 generated tokens (at most ~80), so that all positions
# the tests reach were trained on.
SEQ_LEN = 96
LEARNING_RATE = 1e-2
WARMUP_STEPS = 20


@dataclass(frozen=True)
class ProgressionTask:
    """Arithmetic progressions modulo `modulus` over token ids [base, base + modulus), after BOS.

    The band sits well inside the 512-token vocabulary, clear of the special ids (PAD 0, BOS 1,
    EOS 2), so that a trained model never emits EOS on task prompts.
    """

    base: int = 64
    modulus: int = 32
    strides: tuple[int, ...] = (1, 2, 3, 5, 7)
    bos_id: int = 1

    def next_token(self, token: int, stride: int) -> int:
        return self.base + (token - self.base + stride) % self.modulus

    def sequence(self, start: int, stride: int, length: int) -> list[int]:
        """BOS followed by `length - 1` terms from base + start."""
        out = [self.bos_id, self.base + start % self.modulus]
        while len(out) < length:
            out.append(self.next_token(out[-1], stride))
        return out[:length]


TASK = ProgressionTask()


def task_prompt(length: int, stride: int, start: int = 0, task: ProgressionTask = TASK
                ) -> list[int]:
    """One in-distribution prompt of `length` token ids (BOS included; >= 3 so that the prompt
    determines the stride)."""
    if length < 3:
        raise ValueError(f"a task prompt needs BOS and two terms (length >= 3); got {length}")
    if stride not in task.strides:
        raise ValueError(f"stride must be one of {task.strides}; got {stride}")
    return task.sequence(start, stride, length)


def task_prompts(lengths: Sequence[int] = (17, 5, 45), task: ProgressionTask = TASK
                 ) -> list[list[int]]:
    """In-distribution prompts of the given lengths, each with another stride and start."""
    return [
        task_prompt(n, task.strides[i % len(task.strides)], (11 * i + 3) % task.modulus, task)
        for i, n in enumerate(lengths)
    ]


def task_continuation(prompt: Sequence[int], n: int, task: ProgressionTask = TASK) -> list[int]:
    """The `n` tokens that continue a task prompt (what a well-trained model generates)."""
    stride = (prompt[-1] - prompt[-2]) % task.modulus
    out = [prompt[-1]]
    for _ in range(n):
        out.append(task.next_token(out[-1], stride))
    return out[1:]


def _batch(task: ProgressionTask, gen: torch.Generator) -> torch.Tensor:
    """[BATCH_SIZE, SEQ_LEN] token ids: random starts and strides."""
    import torch

    starts = torch.randint(0, task.modulus, (BATCH_SIZE, 1), generator=gen)
    strides = torch.tensor(task.strides)[
        torch.randint(0, len(task.strides), (BATCH_SIZE, 1), generator=gen)
    ]
    terms = task.base + (starts + strides * torch.arange(SEQ_LEN - 1)) % task.modulus
    return torch.cat([torch.full((BATCH_SIZE, 1), task.bos_id), terms], dim=1)


@contextmanager
def _one_thread() -> Iterator[None]:
    """CPU matmul results can depend on the thread count; one thread makes the weights the same
    in a test process (which pins threads) and in the CLI (which does not). The model is too
    small to gain from more threads anyway (measured: same speed on 2)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_tiny_model(model: torch.nn.Module, steps: int, seed: int = 0,
                     task: ProgressionTask = TASK) -> float:
    """Trains a transformers causal LM (float32, CPU) on `task` in place; returns the last loss.

    Deterministic for a given initial model, steps and seed. The loss skips the first two
    predictions of each sequence (after BOS and after the first term nothing determines the
    next term), so the model is confident exactly where the task is defined.
    """
    import torch
    import torch.nn.functional as F

    bos = getattr(model.config, "bos_token_id", task.bos_id)
    if bos != task.bos_id:
        raise ValueError(f"task BOS id {task.bos_id} != the model's bos_token_id {bos}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98),
                            weight_decay=0.0)
    # Linear warmup, then linear decay to 0 at `steps`: ending at lr 0 settles the weights.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS) * max(0.0, 1.0 - s / steps)
    )
    # eval(): no dropout (gpt2's config has some), so the fit is deterministic and quicker.
    model.eval()
    loss = torch.tensor(float("nan"))
    with _one_thread(), torch.enable_grad():  # callers may hold no_grad (not inference_mode)
        for _ in range(steps):
            ids = _batch(task, gen)
            logits = model(input_ids=ids).logits[:, 2:-1]  # [batch, SEQ_LEN - 3, vocab]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 3:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    model.zero_grad(set_to_none=True)
    return loss.item()


def write_task_card(out_dir: Path, steps: int, seed: int, final_loss: float,
                    task: ProgressionTask = TASK) -> Path:
    """Records what the weights were trained on, beside them (tests and benchmarks read it)."""
    card = {
        "tokenwire_tiny_task": "arithmetic_progression",
        **asdict(task),
        "train_steps": steps,
        "seed": seed,
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "final_loss": round(final_loss, 6),
    }
    path = Path(out_dir) / TASK_FILE
    path.write_text(json.dumps(card, indent=2) + "\n")
    return path


def read_task(model_dir: Path | str) -> ProgressionTask | None:
    """The task a tiny model was trained on, or None for random weights."""
    path = Path(model_dir) / TASK_FILE
    if not path.exists():
        return None
    card = json.loads(path.read_text())
    return ProgressionTask(base=card["base"], modulus=card["modulus"],
                           strides=tuple(card["strides"]), bos_id=card["bos_id"])
