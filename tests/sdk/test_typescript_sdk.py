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

from tests.e2e._deploy import Deployment
from tests.helpers.processes import run_checked
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


@pytest.mark.parametrize("route", ["direct", "envoy"])
def test_node_cases(project: Path, live_server: Deployment, route: str) -> None:
    target = live_server.grpc_target if route == "direct" else live_server.envoy_target
    env = {**os.environ, "TOKENWIRE_URL": f"http://{target}"}
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
    # Live: generate, two stream cancels, validation, deadline, info, health; 3 README examples
    # (+1 check); fake server: API key, typed errors, cancel reaching the server.
    assert int(summary["pass"]) >= 14, result.stdout
