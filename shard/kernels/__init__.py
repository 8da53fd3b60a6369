"""Every Triton kernel of the shard, with its launch wrapper. Modules here import only torch,
triton and each other (never layers, models or collectives); importing any of them needs Triton,
except gemv_buckets (plain constants) and head_norms (a dataclass the attention protocol names),
which are CPU-safe."""
