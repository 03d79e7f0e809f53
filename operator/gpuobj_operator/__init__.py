"""gpuobj operator: the cluster-wide reference counter for GPU objects (in-order informers, a Lease)."""
