"""The device side: the model runner, its compiled step programs, the on-device sampler, the cache's per-row
state and where the arrays live (one device or a mesh)."""
