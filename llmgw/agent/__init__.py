"""The node agent: stream client, GPU discovery, supervisor of shard processes."""
