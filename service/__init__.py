"""tokenwire router: public gRPC API, validation, scheduling, shard client, launcher."""
