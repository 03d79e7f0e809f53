"""The reference ledger: what references what, and what must happen next. Pure Python.

Why: this is the heart of gpuobj, a cluster-wide reference counter. It knows
nothing of HTTP or kopf: the reconciler feeds it API objects and executes the
actions it returns, so every rule here is unit-tested without a server
(kueue's cache/snapshot habit).

Rules (see DESIGN.md, "Object lifecycle"):
- An object's references are its live claims, plus the owner's own reference
  until the GPUObject is deleted.
- Out of scope (deleted and no live claim) -> free on the source, then drop the
  finalizer. Never before every kind of state has been listed once (``synced``).
- A source pod that is gone, terminated or replaced (new UID) makes its objects
  Lost; a Lost object with no claim is deleted and its finalizer dropped without
  a free (its memory went with the pod).
- A stream item whose index is below the stream's read position was consumed:
  a report of it that arrives late is deleted at once (seed 003).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field

from gpuobj_contract import names
from gpuobj_operator.liveness import Liveness
from gpuobj_operator.model import ClaimInfo, Key, ObjectInfo, PodInfo, StreamInfo
from gpuobj_operator.statuses import condition, now_str

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class Action:
    """Something the reconciler must do against the API or an agent."""


@dataclass(frozen=True)
class LookupPod(Action):
    namespace: str
    name: str


@dataclass(frozen=True)
class AddFinalizer(Action):
    key: Key
    uid: str


@dataclass(frozen=True)
class Materialize(Action):
    key: Key
    uid: str
    endpoint: str
    object_id: str
    pod_uid: str = ""


@dataclass(frozen=True)
class Free(Action):
    """Free on the source agent, then drop the finalizer. The reconciler re-checks claims first."""

    key: Key
    uid: str
    object_id: str
    endpoint: str
    bytes: int
    reason: str
    pod_uid: str = ""  # the agent must serve this pod (checked by the agent on the same call)


@dataclass(frozen=True)
class ReleaseWithoutFree(Action):
    """Drop the finalizer of an object whose bytes are already gone (source pod lost)."""

    key: Key
    uid: str
    reason: str


@dataclass(frozen=True)
class DeleteObject(Action):
    key: Key
    uid: str
    reason: str
    message: str


@dataclass(frozen=True)
class PatchObjectStatus(Action):
    key: Key
    status: dict


@dataclass(frozen=True)
class PatchClaimStatus(Action):
    key: Key
    status: dict


@dataclass(frozen=True)
class SetClaimOwner(Action):
    key: Key
    uid: str
    pod_name: str
    pod_uid: str


@dataclass(frozen=True)
class DeleteClaim(Action):
    key: Key
    uid: str
    reason: str
    holder: str = "pod"  # what is gone: the holder pod, or only its process ("process")


@dataclass(frozen=True)
class Requeue(Action):
    """Decide this again after ``seconds`` (a claim's TTL runs out then)."""

    kind: str
    key: Key
    seconds: float


@dataclass(frozen=True)
class PatchStreamStatus(Action):
    key: Key
    status: dict


@dataclass(frozen=True)
class FinishStream(Action):
    """A deleted stream whose items are all gone: free unreported items on the producer, drop the finalizer."""

    key: Key
    uid: str
    producer_endpoint: str | None
    producer_uid: str = ""


@dataclass(frozen=True)
class Emit(Action):
    """A Kubernetes Event about an object."""

    kind: str
    key: Key
    uid: str
    type: str
    reason: str
    message: str


@dataclass
class SourceVerdict:
    available: bool
    reason: str
    message: str
    pod: PodInfo | None = None
    unknown: bool = False  # the pod must be looked up before deciding


# ---------------------------------------------------------------- the ledger


@dataclass
class Ledger:
    """In-memory view of GPUObjects, claims, streams and agent pods, with the decisions on them."""

    objects: dict[Key, ObjectInfo] = field(default_factory=dict)
    claims: dict[Key, ClaimInfo] = field(default_factory=dict)
    streams: dict[Key, StreamInfo] = field(default_factory=dict)
    pods: dict[Key, PodInfo] = field(default_factory=dict)
    synced: bool = False
    # Secondary indexes.
    _claims_by_object: dict[Key, set[Key]] = field(default_factory=lambda: defaultdict(set))
    _objects_by_pod: dict[Key, set[Key]] = field(default_factory=lambda: defaultdict(set))
    _items_by_stream: dict[Key, set[Key]] = field(default_factory=lambda: defaultdict(set))
    _claims_by_pod: dict[Key, set[Key]] = field(default_factory=lambda: defaultdict(set))
    # When each object's last reference went (monotonic seconds), for the free-latency histogram.
    ref_gone_at: dict[Key, float] = field(default_factory=dict)
    # Which agent process of each pod lives (probes), and when each record (by uid) was first seen:
    # records of a dead process are dropped, never on a probe older than the record.
    liveness: Liveness = field(default_factory=Liveness)
    learned_at: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------ updates; each returns the keys to reconcile

    def upsert_object(self, obj: ObjectInfo, now: float) -> set[tuple[str, Key]]:
        old = self.objects.get(obj.key)
        if old is not None and old.uid == obj.uid and _older(obj.resource_version, old.resource_version):
            return set()  # a late event; we already hold a newer version (from a patch response)
        if old is not None and old.uid != obj.uid:
            self._unindex_object(old)
        self.objects[obj.key] = obj
        self.learned_at.setdefault(obj.uid, now)
        self._objects_by_pod[(obj.namespace, obj.source_pod)].add(obj.key)
        if obj.stream:
            self._items_by_stream[(obj.namespace, obj.stream[0])].add(obj.key)
        self._note_reference_count(obj, now)
        dirty = {("object", obj.key)} | {("claim", c) for c in self._claims_by_object.get(obj.key, ())}
        if obj.stream:
            dirty.add(("stream", (obj.namespace, obj.stream[0])))
        return dirty

    def remove_object(self, obj: ObjectInfo) -> set[tuple[str, Key]]:
        current = self.objects.get(obj.key)
        if current is None or current.uid != obj.uid:
            return set()
        self._unindex_object(current)
        del self.objects[obj.key]
        self.learned_at.pop(obj.uid, None)
        self.ref_gone_at.pop(obj.key, None)
        dirty = {("claim", c) for c in self._claims_by_object.get(obj.key, ())}
        if obj.stream:
            dirty.add(("stream", (obj.namespace, obj.stream[0])))
        return dirty

    def _unindex_object(self, obj: ObjectInfo) -> None:
        self._objects_by_pod[(obj.namespace, obj.source_pod)].discard(obj.key)
        if obj.stream:
            self._items_by_stream[(obj.namespace, obj.stream[0])].discard(obj.key)

    def upsert_claim(self, claim: ClaimInfo, now: float) -> set[tuple[str, Key]]:
        old = self.claims.get(claim.key)
        if old is not None and old.uid == claim.uid and _older(claim.resource_version, old.resource_version):
            return set()
        if old is not None:
            self._unindex_claim(old)
        self.claims[claim.key] = claim
        self.learned_at.setdefault(claim.uid, now)
        self._claims_by_object[claim.object_key].add(claim.key)
        for pod in self._claim_pods(claim):
            self._claims_by_pod[(claim.namespace, pod)].add(claim.key)
        dirty = {("claim", claim.key), ("object", claim.object_key)}
        if old is not None and old.object_key != claim.object_key:
            dirty.add(("object", old.object_key))
        self._touch_refs(claim.object_key, now)
        return dirty

    def remove_claim(self, claim: ClaimInfo, now: float) -> set[tuple[str, Key]]:
        current = self.claims.get(claim.key)
        if current is None or current.uid != claim.uid:
            return set()
        self._unindex_claim(current)
        del self.claims[claim.key]
        self.learned_at.pop(claim.uid, None)
        self._touch_refs(current.object_key, now)
        return {("object", current.object_key)}

    def _unindex_claim(self, claim: ClaimInfo) -> None:
        self._claims_by_object[claim.object_key].discard(claim.key)
        for pod in self._claim_pods(claim):
            self._claims_by_pod[(claim.namespace, pod)].discard(claim.key)

    @staticmethod
    def _claim_pods(claim: ClaimInfo) -> set[str]:
        pods = set(claim.owner_pods)
        if claim.holder_pod:
            pods.add(claim.holder_pod)
        return pods

    def upsert_stream(self, stream: StreamInfo) -> set[tuple[str, Key]]:
        self.streams[stream.key] = stream
        return {("stream", stream.key)} | {("object", k) for k in self._items_by_stream.get(stream.key, ())}

    def remove_stream(self, stream: StreamInfo) -> set[tuple[str, Key]]:
        current = self.streams.get(stream.key)
        if current is None or current.uid != stream.uid:
            return set()
        del self.streams[stream.key]
        return {("object", k) for k in self._items_by_stream.get(stream.key, ())}

    def upsert_pod(self, pod: PodInfo) -> set[tuple[str, Key]]:
        self.pods[pod.key] = pod
        return self._pod_dependents(pod.key)

    def remove_pod(self, pod: PodInfo) -> set[tuple[str, Key]]:
        current = self.pods.get(pod.key)
        if current is not None and current.uid != pod.uid and not current.deleted:
            return set()  # a newer pod of the same name already replaced it
        self.pods[pod.key] = PodInfo(pod.namespace, pod.name, pod.uid, phase=pod.phase, deleted=True)
        return self._pod_dependents(pod.key)

    def _pod_dependents(self, pod_key: Key) -> set[tuple[str, Key]]:
        dirty = {("object", k) for k in self._objects_by_pod.get(pod_key, ())}
        dirty |= {("claim", k) for k in self._claims_by_pod.get(pod_key, ())}
        for key in list(self.streams):
            if key[0] == pod_key[0] and self.streams[key].producer_pod == pod_key[1]:
                dirty.add(("stream", key))
        return dirty

    # ------------------------------------------------------------ queries

    def live_claims(self, obj: ObjectInfo) -> list[ClaimInfo]:
        """Claims that hold a reference on this incarnation of the object."""
        result = []
        for key in self._claims_by_object.get(obj.key, ()):
            claim = self.claims[key]
            if claim.deleting:
                continue
            if claim.object_uid and claim.object_uid != obj.uid:
                continue
            if claim.shared_by is not None and claim.shared_by != obj.source_pod:
                continue  # only the source may claim on a receiver's behalf (admission checks the sharer)
            result.append(claim)
        return result

    def siblings(self, obj: ObjectInfo) -> list[ObjectInfo]:
        """Other GPUObjects naming the same bytes (source pod and object id). The client library never
        makes two; a copy made to have the original freed on its delete must never free them."""
        return [
            o
            for k in self._objects_by_pod.get((obj.namespace, obj.source_pod), ())
            if (o := self.objects[k]).uid != obj.uid and o.object_id == obj.object_id
        ]

    def references(self, obj: ObjectInfo) -> int:
        return len(self.live_claims(obj)) + (0 if obj.deleting else 1)

    def objects_of_pod(self, namespace: str, pod: str) -> list[ObjectInfo]:
        return [self.objects[k] for k in self._objects_by_pod.get((namespace, pod), ()) if k in self.objects]

    def stream_items(self, key: Key) -> list[ObjectInfo]:
        return [self.objects[k] for k in self._items_by_stream.get(key, ()) if k in self.objects]

    def agent_pods(self) -> list[PodInfo]:
        return [p for p in self.pods.values() if not p.terminated and p.endpoint]

    def _note_reference_count(self, obj: ObjectInfo, now: float) -> None:
        if self.references(obj) == 0:
            self.ref_gone_at.setdefault(obj.key, now)
        else:
            self.ref_gone_at.pop(obj.key, None)

    def _touch_refs(self, object_key: Key, now: float) -> None:
        obj = self.objects.get(object_key)
        if obj is not None:
            self._note_reference_count(obj, now)

    def source_verdict(self, obj: ObjectInfo) -> SourceVerdict:
        pod = self.pods.get((obj.namespace, obj.source_pod))
        if pod is None:
            return SourceVerdict(False, "Unknown", "source pod not looked up yet", unknown=True)
        if pod.deleted:
            return SourceVerdict(False, "SourcePodDeleted", f"source pod {obj.source_pod} was deleted", pod)
        expected_uid = obj.source_pod_uid or (obj.status.get("sourcePodUID") if obj.materialized else None)
        if expected_uid and pod.uid != expected_uid:
            return SourceVerdict(
                False, "SourcePodReplaced", f"source pod {obj.source_pod} was recreated (uid {pod.uid})", pod
            )
        if pod.phase in ("Succeeded", "Failed"):
            return SourceVerdict(False, "SourcePodTerminated", f"source pod {obj.source_pod} is {pod.phase}", pod)
        if obj.state == names.STATE_LOST and obj.status.get("sourcePodUID") == pod.uid:
            # The agent reported the bytes gone (audit); the pod itself is fine.
            lost = next(
                (c for c in obj.status.get("conditions", []) if c["type"] == names.CONDITION_SOURCE_AVAILABLE), None
            )
            if lost and lost["status"] == "False":
                return SourceVerdict(False, lost["reason"], lost["message"], pod)
        if obj.materialized and (gone := self.source_process_gone(obj, pod)):
            return SourceVerdict(False, *gone, pod)
        if not pod.endpoint:
            return SourceVerdict(
                False, "AgentEndpointUnknown", f"pod {obj.source_pod} has no IP or agent host yet", pod, unknown=False
            )
        return SourceVerdict(True, "SourceAvailable", f"agent of pod {obj.source_pod} at {pod.endpoint}", pod)

    # ------------------------------------------------------------ processes (incarnations)

    def source_process_gone(self, obj: ObjectInfo, pod: PodInfo) -> tuple[str, str] | None:
        """(reason, message) when the agent process holding this object's bytes is known gone."""
        incarnation = obj.source_incarnation
        if incarnation:
            why = self.liveness.incarnation_dead(
                pod.key, pod.uid, incarnation, self.learned_at.get(obj.uid, float("inf"))
            )
            if why:
                reason = "SourceAgentGone" if self.liveness.agent_gone(pod.key, pod.uid) else "SourceAgentRestarted"
                return reason, why
            return None
        if self.liveness.agent_gone(pod.key, pod.uid):
            return "SourceAgentGone", f"nothing listens at the agent address of pod {pod.name}"
        return None

    def holder_process_gone(self, claim: ClaimInfo) -> str | None:
        """Why the process this claim belongs to is known gone, or None. Needs spec.holder.incarnation."""
        if not claim.holder_incarnation or not claim.holder_pod:
            return None
        pod = self.pods.get((claim.namespace, claim.holder_pod))
        uid = pod.uid if pod is not None else claim.owner_pods.get(claim.holder_pod)
        why = self.liveness.incarnation_dead(
            (claim.namespace, claim.holder_pod),
            uid,
            claim.holder_incarnation,
            self.learned_at.get(claim.uid, float("inf")),
        )
        return f"holder {why}" if why else None

    def _holder_gone(self, claim: ClaimInfo) -> bool:
        """The claim's holder (process, or pod) is gone: the claim only waits to be deleted."""
        if self.holder_process_gone(claim):
            return True
        for name, uid in claim.owner_pods.items():
            pod = self.pods.get((claim.namespace, name))
            if pod is not None and (pod.terminated or pod.uid != uid):
                return True
        return False

    def suspect_records(self, pod: Key) -> set[tuple[str, Key]]:
        """Records of this pod that name an incarnation other than the live one: re-decide after a probe."""
        state = self.liveness.agents.get(pod)
        alive = state.incarnation if state is not None else None
        dirty: set[tuple[str, Key]] = set()
        for key in self._objects_by_pod.get(pod, ()):
            obj = self.objects.get(key)
            gone = state is not None and state.gone
            if obj is not None and obj.materialized and (gone or obj.source_incarnation != alive):
                dirty.add(("object", key))
        for key in self._claims_by_pod.get(pod, ()):
            claim = self.claims.get(key)
            if claim is not None and claim.holder_incarnation and claim.holder_incarnation != alive:
                dirty.add(("claim", key))
        return dirty

    def dead_holder_bytes(self) -> dict[Key, int]:
        """(namespace, source pod) -> bytes held only by claims whose holder is gone: leaked while they wait."""
        result: dict[Key, int] = defaultdict(int)
        for obj in self.objects.values():
            if not obj.deleting or not obj.finalized or not obj.materialized or obj.state == names.STATE_LOST:
                continue
            claims = self.live_claims(obj)
            if claims and all(self._holder_gone(c) for c in claims):
                result[(obj.namespace, obj.source_pod)] += obj.bytes
        return dict(result)

    # ------------------------------------------------------------ decisions

    def decide_object(self, key: Key, now: dt.datetime) -> list[Action]:
        """What must happen for this GPUObject now. Empty when nothing is to be done."""
        obj = self.objects.get(key)
        if obj is None or not self.synced:
            return []
        verdict = self.source_verdict(obj)
        if verdict.unknown:
            return [LookupPod(obj.namespace, obj.source_pod)]
        claims = self.live_claims(obj)
        if obj.deleting:
            if not obj.finalized:
                return []  # not ours to hold; the API server removes it
            if claims:
                return self._status_actions(obj, verdict, claims, now)
            if self.siblings(obj):
                message = f"another GPUObject names object {obj.object_id} of pod {obj.source_pod}; not freed"
                return [
                    Emit("GPUObject", obj.key, obj.uid, "Warning", "DuplicateObjectId", message),
                    ReleaseWithoutFree(obj.key, obj.uid, "DuplicateObjectId"),
                ]
            if verdict.available and obj.materialized:
                pod = verdict.pod
                return [Free(obj.key, obj.uid, obj.object_id, pod.endpoint, obj.bytes, "OutOfScope", pod.uid)]  # type: ignore[union-attr,arg-type]
            if verdict.reason == "AgentEndpointUnknown" and obj.materialized:
                return self._status_actions(obj, verdict, claims, now)  # wait for the pod's address
            return [
                ReleaseWithoutFree(obj.key, obj.uid, verdict.reason if not verdict.available else "NeverMaterialized")
            ]
        if not obj.finalized:
            return [AddFinalizer(obj.key, obj.uid)]
        if obj.stream:
            stream = self.streams.get((obj.namespace, obj.stream[0]))
            if stream is None or stream.deleting:
                return [DeleteObject(obj.key, obj.uid, "StreamDeleted", f"stream {obj.stream[0]} is gone")]
            if obj.stream[1] < stream.consumed and not claims:
                return [
                    DeleteObject(
                        obj.key,
                        obj.uid,
                        "StaleStreamReport",
                        f"item {obj.stream[1]} of stream {obj.stream[0]} was already consumed"
                        f" (read position {stream.consumed})",
                    )
                ]
        if self._lost(obj, verdict):
            actions = self._status_actions(obj, verdict, claims, now)
            if obj.state != names.STATE_LOST:
                actions.append(Emit("GPUObject", obj.key, obj.uid, "Warning", "Lost", verdict.message))
            if not claims:
                actions.append(DeleteObject(obj.key, obj.uid, "Lost", f"{verdict.message}; no claim remains"))
            return actions
        if obj.declared and not obj.materialized and verdict.available and obj.state != names.STATE_FAILED:
            return [Materialize(obj.key, obj.uid, verdict.pod.endpoint, obj.object_id, verdict.pod.uid)]  # type: ignore[union-attr]
        return self._status_actions(obj, verdict, claims, now)

    @staticmethod
    def _lost(obj: ObjectInfo, verdict: SourceVerdict) -> bool:
        """Bytes that existed and whose source is gone. An object never materialized is only Pending."""
        return not verdict.available and verdict.reason != "AgentEndpointUnknown" and obj.materialized

    def desired_object_status(
        self, obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], now: dt.datetime
    ) -> dict:
        stamp = now_str(now)
        existing = obj.status.get("conditions", [])
        if obj.state == names.STATE_FAILED:
            state = names.STATE_FAILED
        elif self._lost(obj, verdict):
            state = names.STATE_LOST
        elif not obj.materialized:
            state = names.STATE_PENDING
        elif obj.deleting:
            state = names.STATE_RELEASING
        else:
            state = names.STATE_READY
        refs = len(claims) + (0 if obj.deleting else 1)
        if state == names.STATE_READY:
            ready = ("True", "Ready", "bytes are held by the source agent and can be fetched")
        elif state == names.STATE_RELEASING:
            ready = ("False", "WaitingForClaims", f"deleted; waiting for {len(claims)} claim(s) to go before freeing")
        elif state == names.STATE_LOST:
            ready = ("False", "SourceLost", verdict.message)
        elif state == names.STATE_FAILED:
            ready = next(
                (("False", c["reason"], c["message"]) for c in existing if c["type"] == names.CONDITION_READY),
                ("False", "Failed", "materialization failed"),
            )
        else:
            ready = (
                "False",
                "Materializing",
                verdict.message if not verdict.available else "waiting for the source agent",
            )
        status = {
            "observedGeneration": obj.generation,
            "state": state,
            "objectId": obj.object_id if obj.materialized or not obj.declared else obj.status.get("objectId"),
            "bytes": obj.bytes,
            "tensorCount": len(obj.tensors),
            "references": refs,
            "claims": len(claims),
            "conditions": [
                condition(existing, names.CONDITION_READY, *ready, obj.generation, stamp),
                condition(
                    existing,
                    names.CONDITION_SOURCE_AVAILABLE,
                    "True" if verdict.available else "False",
                    verdict.reason,
                    verdict.message,
                    obj.generation,
                    stamp,
                ),
            ],
        }
        if verdict.pod is not None and not verdict.pod.deleted:
            status["sourcePodUID"] = verdict.pod.uid
            if verdict.pod.endpoint:
                status["transport"] = {
                    "backend": "nixl",
                    "agentEndpoint": verdict.pod.endpoint,
                    **(
                        {"agentIncarnation": obj.status["transport"]["agentIncarnation"]}
                        if obj.status.get("transport", {}).get("agentIncarnation")
                        else {}
                    ),
                }
        else:
            for k in ("sourcePodUID", "transport"):
                if k in obj.status:
                    status[k] = obj.status[k]
        if obj.status.get("objectId") is None and status["objectId"] is None:
            del status["objectId"]
        return status

    def _status_actions(
        self, obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], now: dt.datetime
    ) -> list[Action]:
        desired = self.desired_object_status(obj, verdict, claims, now)
        if _status_differs(obj.status, desired):
            return [PatchObjectStatus(obj.key, desired)]
        return []

    def decide_claim(self, key: Key, now: dt.datetime) -> list[Action]:
        claim = self.claims.get(key)
        if claim is None or not self.synced or claim.deleting:
            return []
        actions: list[Action] = []
        # Holder pod: ownerReference for garbage collection; the operator as a backstop.
        for pod_name, pod_uid in claim.owner_pods.items():
            pod = self.pods.get((claim.namespace, pod_name))
            if pod is None:
                return [LookupPod(claim.namespace, pod_name)]
            if pod.deleted or pod.uid != pod_uid:
                return [DeleteClaim(claim.key, claim.uid, f"holder pod {pod_name} is gone")]
        if claim.holder_incarnation and (why := self.holder_process_gone(claim)):
            return [DeleteClaim(claim.key, claim.uid, why, holder="process")]
        if claim.ttl_seconds and claim.created:
            left = (claim.created + dt.timedelta(seconds=claim.ttl_seconds) - now).total_seconds()
            if left <= 0:
                return [DeleteClaim(claim.key, claim.uid, f"its TTL of {claim.ttl_seconds}s expired", holder="ttl")]
            actions.append(Requeue("claim", claim.key, left))
        if claim.holder_pod and claim.holder_pod not in claim.owner_pods:
            pod = self.pods.get((claim.namespace, claim.holder_pod))
            if pod is None:
                return [LookupPod(claim.namespace, claim.holder_pod)]
            if not pod.deleted:
                actions.append(SetClaimOwner(claim.key, claim.uid, pod.name, pod.uid))
        obj = self.objects.get(claim.object_key)
        stamp = now_str(now)
        existing = claim.status.get("conditions", [])
        if obj is None or (claim.object_uid and obj.uid != claim.object_uid):
            lost = claim.status.get("state") in ("Bound", "Lost")
            state, reason, message = (
                ("Lost", "ObjectGone", f"GPUObject {claim.object_name} no longer exists")
                if lost
                else ("Pending", "ObjectNotFound", f"GPUObject {claim.object_name} does not exist (yet)")
            )
            desired = {
                "state": state,
                "conditions": [condition(existing, "Bound", "False", reason, message, 1, stamp)],
            }
            if claim.status.get("objectUID"):
                desired["objectUID"] = claim.status["objectUID"]
        else:
            verdict = self.source_verdict(obj)
            if verdict.unknown:
                return [*actions, LookupPod(obj.namespace, obj.source_pod)]
            if self._lost(obj, verdict):
                state, reason, message = "Lost", "SourceLost", verdict.message
            else:
                state, reason, message = "Bound", "Bound", f"references GPUObject {obj.name} on pod {obj.source_pod}"
            desired = {
                "state": state,
                "objectUID": obj.uid,
                "bytes": obj.bytes,
                "sourcePod": obj.source_pod,
                "conditions": [
                    condition(existing, "Bound", "True" if state == "Bound" else "False", reason, message, 1, stamp)
                ],
            }
        desired["observedGeneration"] = 1
        if _status_differs(claim.status, desired):
            actions.append(PatchClaimStatus(claim.key, desired))
        return actions

    def decide_stream(self, key: Key, now: dt.datetime) -> list[Action]:
        stream = self.streams.get(key)
        if stream is None or not self.synced:
            return []
        items = self.stream_items(key)
        if stream.deleting:
            if not stream.finalized:
                return []
            # Items first: each goes through the normal free path (and waits for its claims).
            live = [i for i in items if not i.deleting]
            if live:
                return [DeleteObject(i.key, i.uid, "StreamDeleted", f"stream {stream.name} was deleted") for i in live]
            if items:
                return []  # wait for the items' frees
            producer = self.pods.get((stream.namespace, stream.producer_pod))
            endpoint = producer.endpoint if producer and not producer.terminated else None
            return [FinishStream(stream.key, stream.uid, endpoint, producer.uid if endpoint and producer else "")]
        emitted = max((i.stream[1] + 1 for i in items if i.stream), default=0)
        desired = {
            "observedGeneration": 1,
            "emitted": max(emitted, int(stream.status.get("emitted", 0))),
            "liveItems": len([i for i in items if not i.deleting]),
            "bytes": sum(i.bytes for i in items if not i.deleting),
        }
        current = {k: stream.status.get(k) for k in desired}
        if current != desired:
            return [PatchStreamStatus(stream.key, desired)]
        return []

    def decide(self, kind: str, key: Key, now: dt.datetime) -> list[Action]:
        if kind == "object":
            return self.decide_object(key, now)
        if kind == "claim":
            return self.decide_claim(key, now)
        if kind == "stream":
            return self.decide_stream(key, now)
        raise ValueError(f"unknown kind {kind!r}")

    # ------------------------------------------------------------ metrics views

    def objects_by_state(self) -> dict[str, tuple[int, int]]:
        """state -> (count, bytes), for the gauges a scrape reads."""
        result: dict[str, list[int]] = {s: [0, 0] for s in names.STATES}
        for obj in self.objects.values():
            state = obj.state or names.STATE_PENDING
            entry = result.setdefault(state, [0, 0])
            entry[0] += 1
            entry[1] += obj.bytes
        return {k: (v[0], v[1]) for k, v in result.items()}


def _status_differs(current: dict, desired: dict) -> bool:
    """Compare what we would write with what is there, ignoring keys we do not manage."""
    return any(current.get(k) != v for k, v in desired.items())


def _older(a: str, b: str) -> bool:
    """resourceVersions are etcd revisions in practice; treat unparsable ones as not older."""
    try:
        return int(a) < int(b)
    except ValueError:
        return False
