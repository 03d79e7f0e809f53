"""gpuobj operator: the cluster-wide reference counter for GPU objects (asyncio, gpuobj_kube informers)."""
