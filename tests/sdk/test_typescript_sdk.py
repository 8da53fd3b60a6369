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

from tests.helpers.processes import Deployment, run_checked
from tests.helpers.raw_grpc import RawClient
from tests.helpers.tools import needs

pytestmark = [
    pytest.mark.slow,
    needs(
        shutil.which("npm") is not None and shutil.which("node") is not None,
        "node and npm are needed",
    ),
]

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "clients" / "typescript"
NPM_FLAGS = ["--no-audit", "--no-fund", "--loglevel=error"]


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`npm ci` + `npm pack` (which builds dist/ with tsc) in a copy of clients/typescript."""
    work = tmp_path_factory.mktemp("sdk-ts-build")
    package = work / "package"
    shutil.copytree(SDK, package, ignore=shutil.ignore_patterns("node_modules", "dist", "*.tgz"))
    run_checked(["npm", "ci", *NPM_FLAGS], cwd=package, timeout=300)
    packed = run_checked(
        ["npm", "pack", "--json", *NPM_FLAGS, "--pack-destination", work], cwd=package, timeout=300
    )
    info = json.loads(packed.stdout[packed.stdout.index("[") :])[0]
    files = {entry["path"] for entry in info["files"]}
    assert {"dist/index.js", "dist/index.d.ts", "README.md", "package.json"} <= files, files
    assert not any(path.startswith(("src/", "test/", "node_modules/")) for path in files)
    return work / info["filename"]


@pytest.fixture(scope="module")
def project(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway project that installed the tarball, holding the package's test files."""
    project = tmp_path_factory.mktemp("sdk-ts-project")
    (project / "package.json").write_text(
        json.dumps({"name": "sdk-acceptance", "private": True, "type": "module"})
    )
    run_checked(["npm", "install", *NPM_FLAGS, tarball], cwd=project, timeout=300)
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
