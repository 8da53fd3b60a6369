"""tokenwire shard: the model server of one tensor-parallel rank."""
