"""The shard process: CLI (`tokenwire shard`), gRPC servicer, proto <-> contract conversion, and
the assembly of one rank (loader: model, runner, engine). The only shard package that imports
generated protobuf modules."""
