"""The engine: requests, the block pool and KV-cache manager, the scheduler and the step loop."""
