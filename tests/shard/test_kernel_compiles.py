"""shard.runtime.KernelCompileWatch: Triton's JIT hooks as Triton calls them (keyword arguments,
knobs.JITHook), compiles before and after warm-up told apart, earlier hooks still called."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from shard.runtime import KernelCompileWatch


def _compile(watch: KernelCompileWatch, name: str, key: str) -> None:
    """One variant's build as Triton's JITFunction._do_compile reports it."""
    info = SimpleNamespace(module="shard.kernels.x", name=name, jit_function=None)
    assert not watch.before_compile(key=key, repr=f"{name}[...]", fn=info, compile={},
                                    is_manual_warmup=False, already_compiled=False)
    specialization = {"constants": {"BLOCK": 64}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    watch.after_compile(key=key, repr=f"{name}[num_warps=4](n: i32)\n", fn=info,
                        compile=specialization, is_manual_warmup=False, already_compiled=False)


def test_compiles_after_warmup_are_logged_as_warmup_gaps(caplog):
    watch = KernelCompileWatch()
    _compile(watch, "_prefill_kernel", "k1")
    with caplog.at_level(logging.WARNING, logger="shard.runtime.kernel_compiles"):
        _compile(watch, "_decode_split_kernel", "k2")
        assert not caplog.records  # warm-up's own compiles are expected
        watch.serving()
        _compile(watch, "_decode_split_kernel", "k3")
    assert [c.kernel for c in watch.compiles] == ["_prefill_kernel", "_decode_split_kernel",
                                                  "_decode_split_kernel"]
    assert [c.kernel for c in watch.while_serving] == ["_decode_split_kernel"]
    assert all(c.seconds >= 0 for c in watch.compiles)
    (record,) = caplog.records
    assert "_decode_split_kernel while serving" in record.getMessage()
    assert "(n: i32)" in record.getMessage()  # the specialization that was missing
    assert "{'BLOCK': 64}" in record.getMessage() and "tt.divisibility" in record.getMessage()
    assert "\n" not in record.getMessage()  # one line, whatever Triton's repr holds


def test_install_chains_onto_the_hooks_already_set():
    knobs = pytest.importorskip("triton").knobs
    seen: list[str] = []
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("before:" + kw["key"])
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append("after:" + kw["key"])
    watch = KernelCompileWatch()
    try:
        assert watch.install()
        assert knobs.runtime.jit_cache_hook == watch.before_compile
        _compile(watch, "_silu_mul_kernel", "k")
    finally:
        watch.uninstall()
        restored = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    assert seen == ["before:k", "after:k"]
    assert restored != (watch.before_compile, watch.after_compile)
    assert len(watch.compiles) == 1
