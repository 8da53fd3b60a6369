"""Helpers that tests and benchmarks share (never imported by the product): free ports, tensor-
parallel rank processes, tiny-model greedy runs, Llama-3-8B-shaped random checkpoints."""
