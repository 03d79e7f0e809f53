"""gpuobj: GPU tensor objects shared between Kubernetes pods, freed the moment nothing references them.

Workloads use the client library::

    import gpuobj
    client = gpuobj.Client.connect(pod_name=..., namespace=..., pod_uid=..., token_file=...)
    ref = client.put([weights])            # a GPUObject owned by this pod
    shared = client.share(ref, "reader-0")  # a claim made on the reader's behalf
    ...
    tensors = other_client.fetch(other_client.adopt(shared))

Names are imported lazily so that `gpuobj operator` does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ApiUnavailableError",
    "Client",
    "ConfigurationError",
    "FetchError",
    "GpuObjError",
    "GpuObjTimeoutError",
    "InvalidRequestError",
    "InvalidTensorError",
    "LeaseExpiredError",
    "NameTakenError",
    "ObjectLostError",
    "ObjectNotFoundError",
    "ObjectRef",
    "PermissionDeniedError",
    "PodNotFoundError",
    "QuotaExceededError",
    "ReleasedHandleError",
    "Shard",
    "SharedRef",
    "StreamClosedError",
    "WriteFailedError",
]

_LAZY = {
    "Client": "gpuobj.client.client",
    "ObjectRef": "gpuobj.client.handles",
    "SharedRef": "gpuobj.client.handles",
    "Shard": "gpuobj.client.shards",
    "ApiUnavailableError": "gpuobj.client.errors",
    "ConfigurationError": "gpuobj.client.errors",
    "FetchError": "gpuobj.client.errors",
    "GpuObjError": "gpuobj.client.errors",
    "GpuObjTimeoutError": "gpuobj.client.errors",
    "InvalidRequestError": "gpuobj.client.errors",
    "InvalidTensorError": "gpuobj.client.errors",
    "LeaseExpiredError": "gpuobj.client.errors",
    "NameTakenError": "gpuobj.client.errors",
    "ObjectLostError": "gpuobj.client.errors",
    "ObjectNotFoundError": "gpuobj.client.errors",
    "PermissionDeniedError": "gpuobj.client.errors",
    "PodNotFoundError": "gpuobj.client.errors",
    "QuotaExceededError": "gpuobj.client.errors",
    "ReleasedHandleError": "gpuobj.client.errors",
    "StreamClosedError": "gpuobj.client.errors",
    "WriteFailedError": "gpuobj.client.writebehind",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuobj' has no attribute {name!r}")
