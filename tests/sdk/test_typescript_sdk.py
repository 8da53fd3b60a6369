"""Acceptance of the TypeScript SDK: `npm pack` the package, install the tarball into a temporary
project, and run its `node --test` cases there against a live `tokenwire launch`, directly and
through Envoy's port (which passes gRPC through)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.processes import Deployment
from tests.helpers.raw_grpc import RawClient
from tests.helpers.tools import needs
from tests.helpers.typescript_sdk import SDK, install, shared_tarball

pytestmark = [
    pytest.mark.slow,
    needs(
        shutil.which("npm") is not None and shutil.which("node") is not None,
        "node and npm are needed",
    ),
]



@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tarball(tmp_path_factory)


@pytest.fixture(scope="module")
def project(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway project that installed the tarball, holding the package's test files."""
    project = install(tarball, tmp_path_factory.mktemp("sdk-ts-project"))
    shutil.copytree(SDK / "test", project / "test")
    return project


PROMPT = "The quick brown fox"  # sdk.test.mjs's PROMPT


@pytest.fixture(scope="module")
def expected(live_server: Deployment) -> dict[str, object]:
    """Raw gRPC answers (no SDK) to the requests of sdk.test.mjs and the README examples, which
    the node tests compare with what the SDK returns and what the examples print."""
    raw = RawClient(live_server.target)
    france = raw.generate("The capital of France is", max_new_tokens=8, details=True)
    info = raw.info()
    return {
        "generate": raw.generate(PROMPT, max_new_tokens=5, details=True, temperature=0.0),
        "stream3": raw.stream(PROMPT, max_new_tokens=3, temperature=0.0, details=True),
        "readme": {
            "france": france,
            "once_texts": raw.token_texts("Once upon a time", max_new_tokens=64),
            "hello_texts": raw.token_texts("Hello", max_new_tokens=64),
            "top_p_message": raw.validation_message("Hi", top_p=1.5),
            "model_id": info.model_id,
            "max_total_tokens": info.max_total_tokens,
        },
    }


@pytest.mark.parametrize("route", ["direct", "envoy"])
def test_node_cases(
    project: Path, live_server: Deployment, expected: dict[str, object], route: str
) -> None:
    target = live_server.target if route == "direct" else live_server.envoy_target
    env = {
        **os.environ,
        "TOKENWIRE_URL": f"http://{target}",
        "TOKENWIRE_EXPECTED": json.dumps(expected),
    }
    result = subprocess.run(
        ["node", "--test", "--test-reporter=tap", "test/"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    summary = dict(re.findall(r"^# (pass|fail|skipped) (\d+)$", result.stdout, flags=re.MULTILINE))
    assert result.returncode == 0 and summary.get("fail") == "0", result.stdout + result.stderr
    assert summary.get("skipped") == "0", result.stdout
    # Live: generate (+ equal to raw gRPC, unary and stream), two stream cancels, validation,
    # deadline, info, health; 3 README examples (+1 check); fake server: API key, typed errors,
    # cancel reaching the server.
    assert int(summary["pass"]) >= 16, result.stdout
