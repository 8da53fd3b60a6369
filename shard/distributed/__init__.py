"""Tensor parallelism: process groups and collectives (groups.Dist), the symmetric-memory one-shot
all-reduce, and the fused all-reduce + residual add + RMSNorm orchestration (its kernel lives in
shard/kernels/all_reduce_norm.py)."""
