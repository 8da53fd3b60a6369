"""Name under which `shard.attention.get_backend` finds the CUDA backend ("triton")."""

from shard.attention.cuda_backend import CudaAttentionBackend as TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
