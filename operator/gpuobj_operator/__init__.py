"""gpuobj operator: the cluster-wide reference counter for GPU objects (kopf)."""
