"""Per-request state and batching of one rank (batches.py), the typed step contracts it takes and
returns (contracts.py), sampling, stopping criteria, incremental detokenization, watermarking.
No torch model code and no protobuf: it drives a runner.ModelRunner."""
