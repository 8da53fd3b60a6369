"""Process-level runtime policy shared by a shard and the router's engine process (a leaf:
standard library only at import time): full garbage collections paced between bursts of work,
and Triton kernel compiles after warm-up named as the warm-up gaps they are."""

from shard.runtime.gc_pacing import GcPacer
from shard.runtime.kernel_compiles import KernelCompile, KernelCompileWatch

__all__ = ["GcPacer", "KernelCompile", "KernelCompileWatch"]
