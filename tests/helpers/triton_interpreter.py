"""Running Triton kernels under the interpreter on CPU tensors (TRITON_INTERPRET=1), for tests of
kernels whose real runs need a GPU.

Triton reads TRITON_INTERPRET when a kernel is defined, so each check runs in a fresh Python
process: a source string (a prelude plus the check) executed with the variable set, which must
exit 0. The marks skip where the interpreter cannot run: no triton (not a CPU dependency), or
numpy >= 2.4 (triton 3.6's interpreter cannot take runtime loop bounds with it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

INTERPRETER_MARKS = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="triton not installed (not a CPU dependency)",
    ),
    pytest.mark.skipif(
        np.lib.NumpyVersion(np.__version__) >= "2.4.0",
        reason="triton 3.6's interpreter cannot take runtime loop bounds with numpy >= 2.4",
    ),
]


def run_interpreted(source: str, timeout_s: float = 280.0) -> None:
    """Executes `source` in a fresh interpreter-mode Python process (repo root as the working
    directory, no GPU visible); fails the test with the process's stderr if it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-c", source],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert run.returncode == 0, run.stderr[-4000:]
