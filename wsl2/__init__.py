"""WSL2 support: detection and the Shared Usage sampler (Windows GPU adapter memory counters)."""
