"""The Python SDK as users get it: the `tokenwire-client` wheel built from clients/python and a
fresh virtualenv holding only that wheel and its dependencies (nothing of this repository is
importable there). Used by the SDK acceptance tests and the vision tests."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import REPO, run_checked
from tests.helpers.run_cache import once_per_run

SDK = REPO / "clients" / "python"


def build_wheel(work: Path) -> Path:
    """The wheel, built from a copy of clients/python so that no build output lands in the
    tree."""
    source = work / "src"
    shutil.copytree(
        SDK, source, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")
    )
    out = work / "dist"
    # Build with this venv's setuptools when it has one (offline, fast); else pip's isolated build.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    run_checked(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", out, source]
    )
    (built,) = out.glob("tokenwire_client-*.whl")
    return built


def shared_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """build_wheel at most once per test run (the SDK tests and the vision tests install the same
    wheel; building it took ~2-4 s of CPU each)."""
    return once_per_run(tmp_path_factory, "sdk-python-wheel", build_wheel)


def sdk_venv(wheel: Path, work: Path) -> Path:
    """A fresh virtualenv holding only the wheel and its dependencies; returns its python. It is
    created without pip (fast) and filled by this interpreter's pip, which reuses its wheel
    cache."""
    venv = work / "venv"
    run_checked([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run_checked(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q",
         "--disable-pip-version-check", wheel],
        timeout=300,
    )
    return python
