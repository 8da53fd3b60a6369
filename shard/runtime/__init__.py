"""Process-level runtime policy shared by a shard and the router's engine process (a leaf:
standard library only): full garbage collections paced between bursts of work."""

from shard.runtime.gc_pacing import GcPacer

__all__ = ["GcPacer"]
