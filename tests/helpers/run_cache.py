"""Artifacts that several test files build the same way (the SDK packages), built at most once
per test run and shared: under pytest-xdist every worker has its own base temp inside one run
directory, so the cache sits in that run directory and a lock makes a worker wait for another's
build and reuse it (as tests/helpers/models.py does for the tiny models)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]
) -> Path:
    """What `build(work)` returns, for an empty folder `work` of this run; `build` runs at most
    once per run and `name`. A build that fails records nothing: the next caller builds again
    (and fails with its own message). Callers only read what is returned."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache = root / "run-cache"
    cache.mkdir(parents=True, exist_ok=True)
    record = cache / f"{name}.path"
    with (cache / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if record.is_file():
            return Path(record.read_text())
        work = tmp_path_factory.mktemp(name)
        built = build(work)
        record.write_text(str(built))
        return built
