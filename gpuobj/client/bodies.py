"""What the client writes to the API: GPUObject, claim and stream bodies, built from plain values.

Why apart from core.py: these are pure functions of their arguments (no loop, no agent, no API), the
client's counterpart of KubeRay's builders; the core decides when to write, this module what. A
reader checks the shapes here against the contract (gpuobj_contract.resources) without reading any
of the core's I/O.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuobj.client.handles import ObjectAddress, TensorLayout
from gpuobj.client.state_dicts import Entries
from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_contract.layouts import LISTED_TENSORS_MAX
from gpuobj_contract.shard_buckets import bucket_labels


def short_id() -> str:
    return uuid.uuid4().hex


def expiry(ttl: int | None) -> float | None:
    """When a claim made now with `ttl` ends for its handle (wall clock: it travels to another pod).

    The operator drops it at its creationTimestamp plus ttl, and that timestamp is whole seconds, no
    earlier than now truncated: so the handle ends no later than the operator drops the claim."""
    if not isinstance(ttl, int) or ttl < 1:
        return None  # a bad ttl: claim_body says why
    return math.floor(time.time()) + ttl


@dataclass(frozen=True)
class Source:
    """The writing pod as its records name it: pod, uid, its agent's endpoint and incarnation."""

    pod_name: str
    namespace: str
    pod_uid: str
    endpoint: str
    incarnation: str | None


def object_body(
    source: Source,
    name: str,
    object_id: str,
    layouts: Sequence[TensorLayout],
    *,
    labels: dict[str, str] | None = None,
    stream: tuple[str, int, str] | None = None,
    shared_with: Sequence[str] = (),
    entries: Entries = (),
) -> dict[str, Any]:
    """A GPUObject whose source is this pod (`stream`: the stream's name, item index and uid)."""
    meta: dict[str, Any] = {
        "name": name,
        "finalizers": [names.FINALIZER_FREE],
        "labels": {names.LABEL_SOURCE_POD: source.pod_name, **(labels or {}), **bucket_labels(source.namespace)},
        "annotations": {names.ANNOTATION_SOURCE_ENDPOINT: source.endpoint},
    }
    item: crd.StreamItem | None = None
    if stream is not None:
        stream_name, index, stream_uid = stream
        item = crd.StreamItem(stream_name, index)
        meta["labels"][names.LABEL_STREAM] = stream_name
        meta["ownerReferences"] = [
            {"apiVersion": names.API_VERSION, "kind": names.KIND_STREAM, "name": stream_name, "uid": stream_uid}
        ]
    # A long layout list is summed up (LISTED_TENSORS_MAX says why); a stream's items keep theirs, as its
    # readers allocate from the item's record.
    listed = item is not None or len(layouts) <= LISTED_TENSORS_MAX
    spec = crd.GPUObjectSpec(
        source=crd.ObjectSource(source.pod_name, pod_uid=source.pod_uid, incarnation=source.incarnation or None),
        tensors=named_tensor_specs(layouts, entries) if listed else (),
        tensor_summary=None if listed else crd.TensorSummary(len(layouts), sum(t.nbytes for t in layouts)),
        object_id=object_id,
        shared_with=tuple(shared_with),
        stream=item,
    )
    return {"metadata": meta, "spec": spec.to_json()}


def claim_body(
    sharer: str,
    address: ObjectAddress,
    holder_pod: str,
    holder_uid: str,
    incarnation: str | None = None,
    ttl: int | None = None,
) -> dict[str, Any]:
    """A GPUObjectClaim on `address` held by `holder_pod` (owned by it), made by pod `sharer`."""
    if ttl is not None and (not isinstance(ttl, int) or ttl < 1):
        raise ValueError(f"ttl must be a whole number of seconds >= 1, not {ttl!r}")
    spec = crd.GPUObjectClaimSpec(
        object_name=address.name,
        object_uid=address.uid or None,  # else the write-behind pins the uid it created
        ttl_seconds=ttl or None,
        # Scoped to a process: ours, or the receiver's when the sender knows it.
        holder=crd.ClaimHolder(holder_pod, incarnation or None),
    )
    return {
        "metadata": {
            "name": f"{address.name[:200]}-{holder_pod[:40]}-{short_id()[:6]}",
            "labels": {names.LABEL_OBJECT: address.name[:63], **bucket_labels(address.namespace)},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": holder_pod, "uid": holder_uid}],
            # On a receiver's behalf: say who shares, so admission can check it is us (docs/security.md).
            **({"annotations": {names.ANNOTATION_SHARED_BY: sharer}} if holder_pod != sharer else {}),
        },
        "spec": spec.to_json(),
    }


def stream_body(source: Source, name: str) -> dict[str, Any]:
    """A GPUObjectStream produced by this pod; if the pod goes, so does the stream (and every item)."""
    return {
        "metadata": {
            "name": name,
            "finalizers": [names.FINALIZER_FREE],
            "labels": bucket_labels(source.namespace),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": source.pod_name, "uid": source.pod_uid}],
        },
        "spec": crd.GPUObjectStreamSpec(crd.StreamProducer(source.pod_name)).to_json(),
    }


def named_tensor_specs(layouts: Sequence[TensorLayout], entries: Entries) -> tuple[crd.TensorSpec, ...]:
    """spec.tensors; a state dict's tensors carry their (first) name, for people reading the object."""
    names_by_index: dict[int, str] = {}
    for tensor_name, index in reversed(entries):
        if len(tensor_name) <= 253:
            names_by_index[index] = tensor_name
    return tuple(crd.TensorSpec(t.shape, t.dtype, t.device, names_by_index.get(i)) for i, t in enumerate(layouts))
