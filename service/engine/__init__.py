"""The generation engine: its contracts, the step loop over the scheduler and a shard backend,
and per-request event streams."""
