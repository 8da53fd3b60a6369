"""Triton kernels compiled while a shard serves traffic: found and named, not silently paid for.

Triton compiles a variant of a kernel the first time a launch brings a new specialization: new
constexpr values, an int argument that becomes 1 or a multiple of 16, a pointer argument that
becomes (or stops being) 16-byte aligned. Warm-up is meant to have compiled every variant that
serving launches; a variant it missed compiles inside a step, and every stream waits for it
(0.5-1.7 s a kernel on an H100 with an empty Triton cache, several per run: issue 44's first
runs on a fresh machine, benchmarks/RESULTS.md). Such a gap is a bug to fix at its source (warm
the variant up, or mark the argument `do_not_specialize` / `do_not_specialize_on_alignment`),
so each one is logged as a warning naming the kernel and its specialization.

KernelCompileWatch chains onto Triton's JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called
before a kernel variant is built or loaded from the on-disk cache, and `jit_post_compile_hook`,
after); it is installed once per process, on CUDA shards only (no compiles happen on CPU).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_Hook = Callable[..., Any]


@dataclass(frozen=True)
class KernelCompile:
    kernel: str  # the @triton.jit function's qualified name
    # One line: the constexpr values, the arguments' specialization attributes (divisibility by
    # 16, alignment) and Triton's repr (launch options, argument types)
    specialization: str
    seconds: float  # build (or load from the on-disk cache) time
    while_serving: bool  # after warm-up finished


@dataclass
class KernelCompileWatch:
    compiles: list[KernelCompile] = field(default_factory=list)
    _serving: bool = False
    _started: dict[str, float] = field(default_factory=dict)  # variant key -> perf_counter
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _previous: tuple[_Hook | None, _Hook | None] = (None, None)

    def install(self) -> bool:
        """Chains onto Triton's JIT hooks (process-wide). False where Triton or its hooks are
        missing (CPU-only installs, Triton older than the knobs API)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        return True

    def uninstall(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous

    def serving(self) -> None:
        """Warm-up is over: from now on every compile is a warm-up gap and logged as one."""
        self._serving = True

    @property
    def while_serving(self) -> list[KernelCompile]:
        return [c for c in self.compiles if c.while_serving]

    # ---- Triton's hooks (keyword arguments as triton.knobs.JITHook passes them) ----------------

    def before_compile(self, *, key: Any, **kwargs: Any) -> bool | None:
        with self._lock:
            self._started[str(key)] = time.perf_counter()
        previous = self._previous[0]
        return previous(key=key, **kwargs) if previous is not None else None

    def after_compile(self, *, key: Any, repr: str, fn: Any, **kwargs: Any) -> bool | None:
        end = time.perf_counter()
        with self._lock:
            start = self._started.pop(str(key), end)
        name = getattr(fn, "name", str(fn))
        # What tells this variant from the others: its constexpr values and the arguments'
        # specialization attributes (divisibility by 16, alignment), as Triton keys them.
        # (One line: Triton's repr may hold newlines, and log relays keep a message's first.)
        compile_info = kwargs.get("compile") or {}
        detail = " ".join(
            f"constexprs={compile_info.get('constants')} specialized="
            f"{compile_info.get('configs')} {repr}".split())
        record = KernelCompile(name, detail, end - start, self._serving)
        self.compiles.append(record)
        if record.while_serving:
            log.warning(
                "Triton compiled %s while serving (%.0f ms; that step waited): a kernel variant "
                "warm-up did not cover: %s", name, record.seconds * 1e3, record.specialization)
        previous = self._previous[1]
        return previous(key=key, repr=repr, fn=fn, **kwargs) if previous is not None else None
