"""Running Triton kernels under the interpreter on CPU tensors (TRITON_INTERPRET=1), for tests of
kernels whose real runs need a GPU.

Triton reads TRITON_INTERPRET when a kernel is defined, so each check runs in a fresh Python
process: a source string (a prelude plus the check) executed with the variable set, which must
exit 0. `triton` is a dev dependency (pyproject.toml), so `make test` runs these on CPU; the mark
skips them only where the interpreter cannot run (no triton, or triton < 3.9 with numpy >= 2.4:
triton 3.6's interpreter cannot take runtime loop bounds with it), and fails them under CI=true
(tests/helpers/tools.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from packaging.version import Version

from tests.helpers.tools import needs

REPO_ROOT = Path(__file__).resolve().parents[2]


def _unavailable_reason() -> str:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed (a dev dependency: pip install -e '.[dev]')"
    triton_version = importlib.metadata.version("triton")
    if Version(triton_version) < Version("3.9") and Version(np.__version__) >= Version("2.4"):
        return f"triton {triton_version}'s interpreter cannot run loops with numpy >= 2.4"
    return ""


_REASON = _unavailable_reason()
# Skips a test where the interpreter cannot run (fails it under CI=true); INTERPRETER_MARKS for a
# module's pytestmark.
requires_interpreter = needs(not _REASON, _REASON)
# One interpreted check costs 30-140 s of CPU; on a loaded 2-core CI machine its wall time can be
# several times that (pyproject.toml's default pytest timeout is 300 s).
INTERPRETER_TIMEOUT_S = 900
INTERPRETER_MARKS = [requires_interpreter, pytest.mark.timeout(INTERPRETER_TIMEOUT_S)]

# Prepended to checks that run bf16 tl.dot: triton 3.6's interpreter multiplies bf16 operands as
# raw 16-bit integers; widening them to fp32 first is exact.
BF16_DOT_PRELUDE = textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    _dot = interpreter.InterpreterBuilder.create_dot

    def _widen_bf16(h):
        if h.dtype != tl.bfloat16:
            return h
        data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def _create_dot(self, a, b, d, *rest):  # bf16 dot operands are exact in fp32
        return _dot(self, _widen_bf16(a), _widen_bf16(b), d, *rest)

    interpreter.InterpreterBuilder.create_dot = _create_dot
    """
)

# triton 3.9's interpreter hands a masked load an int32 mask where a kernel's mask is a computed
# tensor (attention_decode's early-tile reload), which its C++ masked load refuses ("mask has
# unsupported dtype"); compiled, the mask is i1. The patch converts it.
INT_MASK_PRELUDE = textwrap.dedent(
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    _masked_load = interpreter.InterpreterBuilder.create_masked_load

    def _create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if mask.data.dtype != np.bool_:
            mask = interpreter.TensorHandle(mask.data != 0, tl.int1)
        return _masked_load(self, ptrs, mask, other, cache_policy, is_volatile)

    interpreter.InterpreterBuilder.create_masked_load = _create_masked_load
    """
)


# Prepended to every check (run_interpreted): a speed-up of the interpreter's plumbing only, not
# of what a kernel computes. Each call of a @triton.jit helper from inside a kernel
# (InterpretedFunction.__call__) runs triton.runtime.interpreter._patch_lang again: an
# inspect.getmembers scan over triton.language, its tensor class and math (~9 ms, a third of a
# small GEMV program's time). The launch (GridExecutor.__call__) has already patched those same
# modules for its whole grid, and a helper's patches are never restored, so the repeat finds
# every builtin already wrapped and changes nothing. Here a helper's call skips it while a launch
# is in progress and every language module the helper sees was patched already during that
# launch; anything else (a launch, or the first call of a helper that sees another module, such as
# tl.sum's triton.language.core) takes triton's own path, whose patches then stay, as before.
FAST_DEVICE_CALLS_PRELUDE = textwrap.dedent(
    """
    import inspect as _tw_inspect

    import triton.language as _tw_tl
    from triton.runtime import interpreter as _tw_interpreter

    def _tw_fast_device_calls():
        original = _tw_interpreter._patch_lang
        launch = []  # [language modules patched so far in the launch in progress], or []

        def langs_of(fn):
            return [v for v in fn.__globals__.values()
                    if _tw_inspect.ismodule(v) and v in (_tw_tl, _tw_tl.core)]

        class LaunchScope:
            def __init__(self, scope):
                self.scope = scope

            def restore(self):
                launch.clear()
                self.scope.restore()

        def patch_lang(fn):
            langs = langs_of(fn)
            if launch:  # a helper called inside a launch
                if all(lang in launch[0] for lang in langs):
                    return _tw_interpreter._LangPatchScope()  # nothing to patch or restore
                scope = original(fn)
                launch[0].extend(langs)
                return scope
            scope = original(fn)  # a launch: GridExecutor restores this scope at its end
            launch.append(langs)
            return LaunchScope(scope)

        _tw_interpreter._patch_lang = patch_lang

    _tw_fast_device_calls()
    """
)


def run_interpreted(source: str, timeout_s: float = INTERPRETER_TIMEOUT_S - 30) -> None:
    """Executes `source` in a fresh interpreter-mode Python process (repo root as the working
    directory, no GPU visible); fails the test with the process's stderr if it exits non-zero."""
    assert not _REASON, _REASON
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-c", FAST_DEVICE_CALLS_PRELUDE + source],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert run.returncode == 0, run.stderr[-4000:]
