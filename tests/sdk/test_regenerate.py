"""The SDKs' generated code is current: running their generators changes nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.tools import tool_missing

REPO = Path(__file__).resolve().parents[2]
GENERATED = ["clients/python/src/tokenwire_client/_generated", "clients/typescript/src/gen"]


def _status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--", *GENERATED],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.slow
def test_regenerating_the_sdks_leaves_git_status_clean() -> None:
    if not (REPO / "build/protodeps/google/api").is_dir():
        tool_missing("build/protodeps missing: scripts/generate prepares it")
    if not (REPO / ".git").exists():
        tool_missing("not a git checkout")
    assert _status() == "", "generated SDK code differs from the commit before regenerating"
    for script in ("clients/python/generate", "clients/typescript/generate"):
        subprocess.run([REPO / script], cwd=REPO, check=True, capture_output=True)
    assert _status() == "", "regenerating the SDKs changed their generated code"
