"""`tokenwire make-tiny-model` writes a hub-like snapshot that transformers loads and generates
with, deterministically per seed; `--train-steps` fits it to the progression task
(shard/tools/tiny_training.py), deterministically too, and the trained model does the task."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
from shard.tools.tiny_training import (
    TASK,
    TASK_FILE,
    read_task,
    task_continuation,
    task_prompt,
    task_prompts,
)
from tests.helpers.models import trained_tiny_model


def make(out: Path, arch: str, seed: int = 0, *extra: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "service.app.cli", "make-tiny-model", str(out), "--arch", arch,
         "--seed", str(seed), *extra],
        # A torch start-up plus a build: seconds when quiet; 120 s was once exceeded at load 10.
        check=True, capture_output=True, timeout=300,
    )
    return out


def digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cli_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The command's llama of seed 1, written once for the module: both the load test and the
    same-bytes test read it (each command is a ~10-30 s interpreter start-up with torch)."""
    return make(tmp_path_factory.mktemp("cli-llama") / "llama", "llama", seed=1)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_cli_output_loads_in_transformers_and_generates(
    tmp_path: Path, arch: str, request: pytest.FixtureRequest
) -> None:
    # The command for one architecture; the others through the function it calls (the command
    # and the function write the same bytes: test_same_seed_same_weights_other_seed_other_weights),
    # which spares three ~10-30 s interpreter start-ups.
    if arch == "llama":
        model_dir = request.getfixturevalue("cli_llama")
    else:
        model_dir = make_tiny_model(tmp_path / arch, TinyModelSpec(arch=arch))
    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < 4 * 2**20  # a few MB at most
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == arch

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.chat_template  # clients exercising chat formatting find one
    inputs = tokenizer("Testing API caf\u00e9", return_tensors="pt")
    assert inputs.input_ids[0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 8 or out[0, -1] == tokenizer.eos_token_id
    # Byte-level BPE: any text round-trips, multi-byte characters included.
    text = "caf\u00e9 \u65e5\u672c \U0001f680"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path, cli_llama: Path) -> None:
    """The command and the function it calls write the same bytes for a seed, other bytes for
    another seed."""
    a = digest(cli_llama)
    b = digest(make_tiny_model(tmp_path / "b", TinyModelSpec(arch="llama", seed=1)))
    c = digest(make_tiny_model(tmp_path / "c", TinyModelSpec(arch="llama", seed=2)))
    assert a == b != c


def test_training_is_deterministic(tmp_path: Path) -> None:
    """The CLI (its own process, default thread count) and an in-process build (this process's
    thread count) of the same seed and steps write the same bytes; training changes them."""
    steps = 20  # determinism does not need a converged model
    cli = make(tmp_path / "cli", "qwen2", 0, "--train-steps", str(steps))
    api = make_tiny_model(tmp_path / "api", TinyModelSpec(arch="qwen2", train_steps=steps))
    untrained = make_tiny_model(tmp_path / "random", TinyModelSpec(arch="qwen2"))
    assert digest(cli) == digest(api) != digest(untrained)
    assert (cli / TASK_FILE).read_text() == (api / TASK_FILE).read_text()
    assert read_task(cli) == TASK and read_task(untrained) is None
    assert not (untrained / TASK_FILE).exists()  # random models are written as before


def test_task_prompts_are_in_distribution() -> None:
    p = task_prompts((17, 5, 45))
    assert [len(x) for x in p] == [17, 5, 45]
    assert all(x[0] == TASK.bos_id for x in p)
    band = range(TASK.base, TASK.base + TASK.modulus)
    assert all(t in band for x in p for t in x[1:])  # clear of PAD/BOS/EOS
    assert len({(x[2] - x[1]) % TASK.modulus for x in p}) == 3  # another stride each
    assert task_prompt(4, 3, start=30) == [TASK.bos_id, 94, 65, 68]  # wraps modulo 32
    assert task_continuation([TASK.bos_id, 94, 65, 68], 2) == [71, 74]
    with pytest.raises(ValueError, match="length >= 3"):
        task_prompt(2, 1)


def test_trained_model_continues_the_progression(tmp_path_factory) -> None:
    """The trained tiny llama (the shard tests' model, built once per session) greedily
    continues task prompts for 32 tokens, every pick by a wide top-2 margin: random models'
    margins are 0.001-0.09, the fp8 KV cache's logit noise ~0.5."""
    model_dir = trained_tiny_model(tmp_path_factory, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n, margins = 32, []
    for prompt in task_prompts((17, 5, 45, 3)):
        want = task_continuation(prompt, n)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            logits = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
        assert out[0, len(prompt):].tolist() == want
        top2 = logits.topk(2, dim=-1).values  # [n, 2]
        margins.append(top2[:, 0] - top2[:, 1])
    min_margin = float(torch.cat(margins).min())
    print(f"trained tiny llama: min top-2 margin over 32 greedy steps {min_margin:.2f}")
    assert min_margin > 1.0
