"""The GPU benchmark harness (formerly `python -m benchmarks.harness`): run as `python -m benchmarks.harness`
from the repository root. bench.py: ceilings, decode, prefill, end to end, HF baseline; tp.py:
tensor-parallel runs; timing.py: shared timers and step builders; kernel_profile.py: per-kernel
attribution of a profiled call."""
