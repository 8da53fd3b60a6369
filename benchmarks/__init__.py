"""Benchmarks of tokenwire: the GPU harness (`python -m benchmarks.harness`), one-off scripts
and their results (*.md, raw/). Nothing in service/ or shard/ imports this package."""
