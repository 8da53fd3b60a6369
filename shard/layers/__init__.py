"""Model building blocks, each with its own weight loader: tensor-parallel linears incl. the merged
q/k/v and gate/up projections, the decode-time linear dispatch (Triton GEMV or cuBLAS),
embedding / LM head, RMSNorm, rotary embedding, the attention layer (rotary -> KV write -> attend
through an attention backend) and the checkpoint reader they load from (weights.py)."""
