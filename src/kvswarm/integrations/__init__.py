"""Engine integrations: thin adapters that put an engine's KV blocks on a KVStore."""
