"""gpuobj agent: the per-pod object store, its NIXL agent and its control server."""
