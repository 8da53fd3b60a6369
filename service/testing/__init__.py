"""Test doubles for the router: an instant fake shard speaking the real shard protocol."""

from service.testing.fake_shard import FakeShard, FakeShardConfig, expected_tokens, start_fake_shard

__all__ = ["FakeShard", "FakeShardConfig", "expected_tokens", "start_fake_shard"]
