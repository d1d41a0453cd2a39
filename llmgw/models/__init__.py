"""
Model weights on a node: where a model comes from (L{source}), how its
files are fetched and checked (L{hub}, L{https}, L{fetching}), and the
node-local cache that keeps one copy of each (L{cache}, L{index}).

Nothing here knows of shards, the agent or the control plane: the agent
asks L{cache.ModelCache} for a source and gets a L{Deferred} of a local path.
"""
