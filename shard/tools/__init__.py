"""Tools around the shard: hub snapshots (`tokenwire download`), GGUF conversion into cached
snapshots, and tiny random or trained models for tests and demos (`tokenwire make-tiny-model`)."""
