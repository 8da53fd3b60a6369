"""The TypeScript SDK as users get it: the `npm pack` tarball of clients/typescript installed into
a throwaway project. Used by the SDK acceptance tests and the vision tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.processes import REPO, run_checked
from tests.helpers.run_cache import once_per_run

SDK = REPO / "clients" / "typescript"
NPM_FLAGS = ["--no-audit", "--no-fund", "--loglevel=error"]


def pack(work: Path) -> Path:
    """`npm ci` + `npm pack` (which builds dist/ with tsc) in a copy of clients/typescript; the
    tarball's path."""
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


def shared_tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pack at most once per test run (the SDK tests and the vision tests install the same
    tarball; `npm ci` + tsc took ~10 s each)."""
    return once_per_run(tmp_path_factory, "sdk-typescript-tarball", pack)


def install(tarball: Path, project: Path) -> Path:
    """A throwaway ES-module project in `project` that installed the tarball."""
    project.mkdir(parents=True, exist_ok=True)
    (project / "package.json").write_text(
        json.dumps({"name": "sdk-acceptance", "private": True, "type": "module"})
    )
    run_checked(["npm", "install", *NPM_FLAGS, tarball], cwd=project, timeout=300)
    return project
