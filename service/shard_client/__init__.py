"""The router's side of the internal shard protocol: the only package in `service/` that speaks
`tokenwire.shard.v1` protobuf (besides the fake shard in `service.testing`)."""
