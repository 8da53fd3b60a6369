"""Command-line tools around the shard: `tokenwire download` (hub snapshots) and
`tokenwire make-tiny-model` (tiny random or trained models for tests and demos)."""
