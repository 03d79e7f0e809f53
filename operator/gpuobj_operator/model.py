"""Plain records of what the API says, parsed once at the edge.

Why: the ledger and the decisions work on these, never on raw dicts, so their unit tests build
them directly and the parsing rules (which field means what) live in one place. The CRD kinds are
read through the contract's typed shapes (gpuobj_contract.resources, pinned to crds/), never by
spelling their field names here; pods and metadata are Kubernetes' own and read as they are.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_contract.layouts import tensor_bytes

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class ContainerRun:
    """One run of a container as the kubelet reports it (times on the node's clock, whole seconds)."""

    container_id: str
    started: dt.datetime | None = None
    finished: dt.datetime | None = None  # None while it runs


@dataclass(frozen=True)
class AgentContainer:
    """What the kubelet says of the container the pod's agent runs in (status.containerStatuses[]):
    its restart count, its current run and the run before (docs/liveness.md)."""

    name: str
    restart_count: int = 0
    current: ContainerRun | None = None  # containerID + state.running / state.terminated
    last: ContainerRun | None = None  # lastState.terminated


@dataclass(slots=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    phase: str = "Pending"
    endpoint: str | None = None  # host:port of the pod's agent
    deleted: bool = False  # a tombstone: the pod is confirmed gone (watch DELETED or 404)
    agent_container: AgentContainer | None = None
    deleted_at: dt.datetime | None = None  # a tombstone: when the operator learned it (its own clock)

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @property
    def terminated(self) -> bool:
        return self.deleted or self.phase in ("Succeeded", "Failed")


@dataclass(slots=True)
class ObjectInfo:
    namespace: str
    name: str
    uid: str
    source_pod: str
    tensors: list[dict[str, Any]]  # empty when spec.tensorSummary stands in for them
    summary: tuple[int, int] | None = None  # spec.tensorSummary: (count, bytes)
    source_pod_uid: str | None = None
    spec_incarnation: str | None = None  # spec.source.incarnation: the agent process that put it
    spec_object_id: str | None = None
    key_name: str | None = None
    shared_with: tuple[str, ...] = ()  # spec.sharedWith: other namespaces whose pods may read it
    stream: tuple[str, int] | None = None
    deleting: bool = False
    finalized: bool = False  # carries gpuobj.io/free
    finalizers: tuple[str, ...] = ()
    generation: int = 1
    resource_version: str = ""
    status: crd.GPUObjectStatus = field(default_factory=crd.GPUObjectStatus)
    created: dt.datetime | None = None  # metadata.creationTimestamp (the API server's clock)

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @property
    def declared(self) -> bool:
        """Declared with kubectl: the operator asks the source agent to materialize it."""
        return self.spec_object_id is None

    @property
    def object_id(self) -> str:
        """The agent-side id: set by the client library, or the object's uid for declared objects."""
        return self.spec_object_id or self.uid

    @property
    def bytes(self) -> int:
        return self.summary[1] if self.summary is not None else tensor_bytes(self.tensors)

    @property
    def tensor_count(self) -> int:
        return self.summary[0] if self.summary is not None else len(self.tensors)

    @property
    def materialized(self) -> bool:
        """The source agent holds the bytes (library puts always; declared objects once acknowledged)."""
        if not self.declared:
            return True
        return self.status.object_id == self.uid and self.status.state in (
            names.STATE_READY,
            names.STATE_RELEASING,
            names.STATE_LOST,
        )

    @property
    def state(self) -> str | None:
        return self.status.state

    @property
    def source_incarnation(self) -> str | None:
        """The agent process holding the bytes: from the put (spec), or the materialize answer (status)."""
        if self.spec_incarnation:
            return self.spec_incarnation
        if self.declared and self.materialized:
            transport = self.status.transport
            return (transport.agent_incarnation if transport else None) or None
        return None


@dataclass(slots=True)
class ClaimInfo:
    namespace: str
    name: str
    uid: str
    object_name: str
    object_uid: str | None = None  # pinned incarnation (client library sets it)
    holder_pod: str | None = None  # spec.holder.podName
    holder_incarnation: str | None = None  # spec.holder.incarnation: the claim dies with that process
    ttl_seconds: int | None = None  # spec.ttlSeconds: deleted that long after creation
    created: dt.datetime | None = None  # metadata.creationTimestamp
    owner_pods: dict[str, str] = field(default_factory=dict)  # ownerReferences to Pods: name -> uid
    shared_by: str | None = None  # annotation gpuobj.io/shared-by: the pod that claimed for the holder
    deleting: bool = False
    resource_version: str = ""
    status: crd.GPUObjectClaimStatus = field(default_factory=crd.GPUObjectClaimStatus)

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @property
    def object_key(self) -> Key:
        return (self.namespace, self.object_name)


@dataclass(slots=True)
class StreamInfo:
    namespace: str
    name: str
    uid: str
    producer_pod: str
    consumed: int = 0
    deleting: bool = False
    finalized: bool = False
    status: crd.GPUObjectStreamStatus = field(default_factory=crd.GPUObjectStreamStatus)

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)


# ---------------------------------------------------------------- parsing


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = obj.get("metadata", {})
    return meta


def _timestamp(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def parse_pod(obj: Mapping[str, Any], *, allow_host_annotation: bool = False) -> PodInfo:
    """The pod's agent is at its own status.podIP: the operator's token goes nowhere else. Only a
    dev cluster without a pod network (allow_host_annotation) may name another host by annotation."""
    meta = _meta(obj)
    ann = meta.get("annotations") or {}
    status = obj.get("status") or {}
    host = (ann.get(names.ANNOTATION_AGENT_HOST) if allow_host_annotation else None) or status.get("podIP")
    port = ann.get(names.ANNOTATION_AGENT_PORT)
    if not port:
        for container in (obj.get("spec") or {}).get("containers", []):
            for p in container.get("ports") or []:
                if p.get("name") == names.AGENT_PORT_NAME:
                    port = p.get("containerPort")
    if host and not port:
        port = names.DEFAULT_AGENT_PORT
    endpoint = f"{host}:{port}" if host else None
    return PodInfo(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        phase=status.get("phase", "Pending"),
        endpoint=endpoint,
        agent_container=parse_agent_container(obj),
    )


def _agent_container_name(spec: Mapping[str, Any]) -> str | None:
    """The container that serves the agent port (the workload embeds the agent), else the first one."""
    containers = spec.get("containers") or []
    for container in containers:
        if any(p.get("name") == names.AGENT_PORT_NAME for p in container.get("ports") or []):
            name: str | None = container.get("name")
            return name
    return containers[0].get("name") if containers else None


def _run(container_id: str | None, state: Mapping[str, Any] | None) -> ContainerRun | None:
    if not container_id:
        return None
    state = state or {}
    running, terminated = state.get("running"), state.get("terminated")
    if running is not None:
        return ContainerRun(container_id, _timestamp(running.get("startedAt")))
    if terminated is not None:
        return ContainerRun(
            container_id, _timestamp(terminated.get("startedAt")), _timestamp(terminated.get("finishedAt"))
        )
    return ContainerRun(container_id)


def parse_agent_container(obj: Mapping[str, Any]) -> AgentContainer | None:
    """Reads status.containerStatuses[name] of the agent's container: restartCount, containerID,
    state.running.startedAt, state.terminated.{containerID,startedAt,finishedAt} and
    lastState.terminated.{containerID,startedAt,finishedAt}. Nothing else."""
    name = _agent_container_name(obj.get("spec") or {})
    statuses = (obj.get("status") or {}).get("containerStatuses") or []
    found = next((c for c in statuses if c.get("name") == name), None)
    if name is None or found is None:
        return None
    state = found.get("state") or {}
    terminated = state.get("terminated") or {}
    last = (found.get("lastState") or {}).get("terminated") or {}
    return AgentContainer(
        name=name,
        restart_count=int(found.get("restartCount") or 0),
        current=_run(found.get("containerID") or terminated.get("containerID"), state),
        last=_run(last.get("containerID"), {"terminated": last}) if last else None,
    )


def parse_object(obj: Mapping[str, Any]) -> ObjectInfo:
    """Spec and status through the contract's shapes (ValueError for a body the CRD schema refuses)."""
    meta, spec = _meta(obj), crd.GPUObjectSpec.from_json(obj.get("spec"))
    return ObjectInfo(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        source_pod=spec.source.pod_name,
        source_pod_uid=spec.source.pod_uid,
        spec_incarnation=spec.source.incarnation or None,
        tensors=[t.to_json() for t in spec.tensors],
        summary=(spec.tensor_summary.count, spec.tensor_summary.bytes) if spec.tensor_summary else None,
        spec_object_id=spec.object_id,
        key_name=spec.key,
        shared_with=spec.shared_with,
        stream=(spec.stream.name, spec.stream.index) if spec.stream else None,
        deleting=bool(meta.get("deletionTimestamp")),
        finalized=names.FINALIZER_FREE in (meta.get("finalizers") or []),
        finalizers=tuple(meta.get("finalizers") or ()),
        generation=int(meta.get("generation", 1)),
        resource_version=meta.get("resourceVersion", ""),
        status=crd.GPUObjectStatus.from_json(obj.get("status")),
        created=_timestamp(meta.get("creationTimestamp")),
    )


def parse_claim(obj: Mapping[str, Any]) -> ClaimInfo:
    meta, spec = _meta(obj), crd.GPUObjectClaimSpec.from_json(obj.get("spec"))
    owners = {
        ref["name"]: ref["uid"]
        for ref in meta.get("ownerReferences") or []
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1"
    }
    return ClaimInfo(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        object_name=spec.object_name,
        object_uid=spec.object_uid,
        holder_pod=spec.holder.pod_name if spec.holder else None,
        holder_incarnation=(spec.holder.incarnation if spec.holder else None) or None,
        ttl_seconds=spec.ttl_seconds or None,
        created=_timestamp(meta.get("creationTimestamp")),
        owner_pods=owners,
        shared_by=(meta.get("annotations") or {}).get(names.ANNOTATION_SHARED_BY),
        deleting=bool(meta.get("deletionTimestamp")),
        resource_version=meta.get("resourceVersion", ""),
        status=crd.GPUObjectClaimStatus.from_json(obj.get("status")),
    )


def parse_stream(obj: Mapping[str, Any]) -> StreamInfo:
    meta, spec = _meta(obj), crd.GPUObjectStreamSpec.from_json(obj.get("spec"))
    status = crd.GPUObjectStreamStatus.from_json(obj.get("status"))
    return StreamInfo(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        producer_pod=spec.producer.pod_name,
        consumed=status.consumed or 0,
        deleting=bool(meta.get("deletionTimestamp")),
        finalized=names.FINALIZER_FREE in (meta.get("finalizers") or []),
        status=status,
    )
