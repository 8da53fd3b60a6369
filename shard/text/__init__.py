"""The per-token text work: incremental detokenization and stop-string matching.

A leaf (only `tokenizers`): the shard runs it for callers that want text from the shard
(shard.engine), the router's front ends for the requests they detokenize themselves
(service.generation.text_stream), so the two never differ.
"""
