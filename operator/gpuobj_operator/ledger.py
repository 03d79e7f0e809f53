"""The reference ledger: what references what. Pure Python state, its indexes and queries.

Why: this is the heart of gpuobj, a cluster-wide reference counter. It knows
nothing of HTTP or watches: the reconciler feeds it API objects, the decisions
(decisions.py) read it, so every rule is unit-tested without a server (kueue's
cache/snapshot habit). Each update returns the keys whose decision may change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from gpuobj_contract import names
from gpuobj_operator.claim_ttl import ClaimTTLDefaults
from gpuobj_operator.liveness import Liveness
from gpuobj_operator.model import ClaimInfo, ContainerRun, Key, ObjectInfo, PodInfo, StreamInfo
from gpuobj_operator.quota import QuotaBook


@dataclass
class SourceVerdict:
    """Whether an object's bytes can be reached at their source pod, and if not, why."""

    available: bool
    reason: str
    message: str
    pod: PodInfo | None = None
    unknown: bool = False  # the pod must be looked up before deciding


def is_lost(obj: ObjectInfo, verdict: SourceVerdict) -> bool:
    """Bytes that existed and whose source is gone. An object never materialized is only Pending."""
    return not verdict.available and verdict.reason != "AgentEndpointUnknown" and obj.materialized


@dataclass
class StreamTally:
    """A stream's counters over its items in the ledger, kept on every item update (never recounted)."""

    emitted: int = 0  # highest index + 1 seen (never decreases)
    live_items: int = 0  # items not being deleted
    live_bytes: int = 0

    def add(self, item: ObjectInfo, sign: int) -> None:
        if item.stream:
            self.emitted = max(self.emitted, item.stream[1] + 1)
        if not item.deleting:
            self.live_items += sign
            self.live_bytes += sign * item.bytes


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _add(index: dict[K, set[V]], key: K, value: V) -> None:
    index.setdefault(key, set()).add(value)


def _discard(index: dict[K, set[V]], key: K, value: V) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(value)
        if not members:
            del index[key]


# ---------------------------------------------------------------- the ledger


@dataclass
class Ledger:
    """In-memory view of GPUObjects, claims, streams and agent pods, with the queries the decisions ask."""

    objects: dict[Key, ObjectInfo] = field(default_factory=dict)
    claims: dict[Key, ClaimInfo] = field(default_factory=dict)
    streams: dict[Key, StreamInfo] = field(default_factory=dict)
    pods: dict[Key, PodInfo] = field(default_factory=dict)
    synced: bool = False
    # Secondary indexes: every per-event query is a lookup, never a scan of a pod's or a namespace's
    # objects (a burst of 7,000 releases of one pod once cost O(n^2)). Empty sets are dropped, so an
    # index holds exactly what the primary dicts imply (tests/unit/operator/test_ledger_indexes.py).
    _claims_by_object: dict[Key, set[Key]] = field(default_factory=dict)
    _objects_by_pod: dict[Key, set[Key]] = field(default_factory=dict)
    # (namespace, source pod, object id) -> the GPUObjects naming those bytes (one, but for a copy).
    _objects_by_id: dict[tuple[str, str, str], set[Key]] = field(default_factory=dict)
    # (namespace, source pod) -> {source incarnation (None: not known yet) -> objects}.
    _objects_by_incarnation: dict[Key, dict[str | None, set[Key]]] = field(default_factory=dict)
    _items_by_stream: dict[Key, set[Key]] = field(default_factory=dict)
    _claims_by_pod: dict[Key, set[Key]] = field(default_factory=dict)
    _streams_by_producer: dict[Key, set[Key]] = field(default_factory=dict)
    # (namespace, stream) -> its items' counters, kept as items come and go (desired_stream_status).
    stream_tallies: dict[Key, StreamTally] = field(default_factory=dict)
    # When each object's last reference went (monotonic seconds), for the free-latency histogram.
    ref_gone_at: dict[Key, float] = field(default_factory=dict)
    # Which agent process of each pod lives (probes), and when each record (by uid) was first seen:
    # records of a dead process are dropped, never on a probe older than the record.
    liveness: Liveness = field(default_factory=Liveness)
    learned_at: dict[str, float] = field(default_factory=dict)
    # Each namespace's running sum of bytes against its quota (quota.py), kept on every object event.
    quota: QuotaBook = field(default_factory=QuotaBook)
    # Each namespace's default claim ttl (claim_ttl.py): a claim without spec.ttlSeconds expires as if it had it.
    claim_ttl: ClaimTTLDefaults = field(default_factory=ClaimTTLDefaults)

    # ------------------------------------------------------------ updates; each returns the keys to reconcile

    def upsert_object(self, obj: ObjectInfo, now: float) -> set[tuple[str, Key]]:
        old = self.objects.get(obj.key)
        if old is not None and old.uid == obj.uid and _older(obj.resource_version, old.resource_version):
            return set()  # a late event; we already hold a newer version (from a patch response)
        if old is not None:
            self._unindex_object(old)
        self.objects[obj.key] = obj
        self.learned_at.setdefault(obj.uid, now)
        self._index_object(obj)
        self.quota.observe(obj)
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
        self.quota.forget(current)
        del self.objects[obj.key]
        self.learned_at.pop(obj.uid, None)
        self.ref_gone_at.pop(obj.key, None)
        self._drop_tombstone((current.namespace, current.source_pod))
        dirty = {("claim", c) for c in self._claims_by_object.get(obj.key, ())}
        if obj.stream:
            dirty.add(("stream", (obj.namespace, obj.stream[0])))
        return dirty

    def _index_object(self, obj: ObjectInfo) -> None:
        pod = (obj.namespace, obj.source_pod)
        _add(self._objects_by_pod, pod, obj.key)
        _add(self._objects_by_id, (obj.namespace, obj.source_pod, obj.object_id), obj.key)
        _add(self._objects_by_incarnation.setdefault(pod, {}), obj.source_incarnation, obj.key)
        if obj.stream:
            stream = (obj.namespace, obj.stream[0])
            _add(self._items_by_stream, stream, obj.key)
            self.stream_tallies.setdefault(stream, StreamTally()).add(obj, +1)

    def _unindex_object(self, obj: ObjectInfo) -> None:
        pod = (obj.namespace, obj.source_pod)
        _discard(self._objects_by_pod, pod, obj.key)
        _discard(self._objects_by_id, (obj.namespace, obj.source_pod, obj.object_id), obj.key)
        by_incarnation = self._objects_by_incarnation.get(pod, {})
        _discard(by_incarnation, obj.source_incarnation, obj.key)
        if not by_incarnation:
            self._objects_by_incarnation.pop(pod, None)
        if obj.stream:
            stream = (obj.namespace, obj.stream[0])
            _discard(self._items_by_stream, stream, obj.key)
            tally = self.stream_tallies.get(stream)
            if tally is not None:
                tally.add(obj, -1)
                if stream not in self._items_by_stream and stream not in self.streams:
                    del self.stream_tallies[stream]

    def upsert_claim(self, claim: ClaimInfo, now: float) -> set[tuple[str, Key]]:
        old = self.claims.get(claim.key)
        if old is not None and old.uid == claim.uid and _older(claim.resource_version, old.resource_version):
            return set()
        if old is not None:
            self._unindex_claim(old)
        self.claims[claim.key] = claim
        self.learned_at.setdefault(claim.uid, now)
        _add(self._claims_by_object, claim.object_key, claim.key)
        for pod in self._claim_pods(claim):
            _add(self._claims_by_pod, (claim.namespace, pod), claim.key)
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
        for pod in self._claim_pods(current):
            self._drop_tombstone((current.namespace, pod))
        self._touch_refs(current.object_key, now)
        return {("object", current.object_key)}

    def _unindex_claim(self, claim: ClaimInfo) -> None:
        _discard(self._claims_by_object, claim.object_key, claim.key)
        for pod in self._claim_pods(claim):
            _discard(self._claims_by_pod, (claim.namespace, pod), claim.key)

    @staticmethod
    def _claim_pods(claim: ClaimInfo) -> set[str]:
        pods = set(claim.owner_pods)
        if claim.holder_pod:
            pods.add(claim.holder_pod)
        return pods

    def upsert_stream(self, stream: StreamInfo) -> set[tuple[str, Key]]:
        old = self.streams.get(stream.key)
        if old is not None:
            _discard(self._streams_by_producer, (old.namespace, old.producer_pod), old.key)
        self.streams[stream.key] = stream
        _add(self._streams_by_producer, (stream.namespace, stream.producer_pod), stream.key)
        self.stream_tallies.setdefault(stream.key, StreamTally())
        return {("stream", stream.key)} | {("object", k) for k in self._items_by_stream.get(stream.key, ())}

    def remove_stream(self, stream: StreamInfo) -> set[tuple[str, Key]]:
        current = self.streams.get(stream.key)
        if current is None or current.uid != stream.uid:
            return set()
        del self.streams[stream.key]
        _discard(self._streams_by_producer, (current.namespace, current.producer_pod), current.key)
        if stream.key not in self._items_by_stream:
            self.stream_tallies.pop(stream.key, None)
        self._drop_tombstone((current.namespace, current.producer_pod))
        return {("object", k) for k in self._items_by_stream.get(stream.key, ())}

    def upsert_pod(self, pod: PodInfo) -> set[tuple[str, Key]]:
        if self.pods.get(pod.key) == pod:
            return set()  # nothing a decision reads changed (a pod's status changes often)
        self.pods[pod.key] = pod
        return self._pod_dependents(pod.key)

    def remove_pod(self, pod: PodInfo, now: float | None = None) -> set[tuple[str, Key]]:
        """The pod is gone. Its claims end here, in memory (claim_ended): the objects they were the last
        references of are among the keys returned, and ``now`` (monotonic) is when their references went."""
        current = self.pods.get(pod.key)
        if current is not None and current.uid != pod.uid and not current.deleted:
            return set()  # a newer pod of the same name already replaced it
        if current is not None and current.deleted and not pod.uid:
            pod = current  # a lookup's 404 says no more than the tombstone, which knows the uid that went
        self.pods[pod.key] = PodInfo(
            pod.namespace, pod.name, pod.uid, phase=pod.phase, deleted=True, deleted_at=pod.deleted_at
        )
        dirty = self._pod_dependents(pod.key)
        if now is not None:
            for kind, key in dirty:
                if kind == "object":
                    self._touch_refs(key, now)
        self._drop_tombstone(pod.key)
        return dirty

    def _drop_tombstone(self, pod_key: Key) -> None:
        """Forget a deleted pod once no object, claim or stream indexes it: at 100,000 objects the probe
        rounds and audits scan `pods`, and a record that names the pod later gets a LookupPod (404: a new
        tombstone), so dropping it costs one GET at most and never a wrong verdict."""
        pod = self.pods.get(pod_key)
        if pod is not None and pod.deleted and not self._pod_dependents(pod_key):
            del self.pods[pod_key]

    def _pod_dependents(self, pod_key: Key) -> set[tuple[str, Key]]:
        dirty = {("object", k) for k in self._objects_by_pod.get(pod_key, ())}
        claims = self._claims_by_pod.get(pod_key, ())
        dirty |= {("claim", k) for k in claims}
        # The objects its claims reference: the pod's news may end those claims (claim_ended), and
        # the free is decided on it, not once the claims' deletions come back from the API.
        dirty |= {("object", self.claims[k].object_key) for k in claims}
        dirty |= {("stream", k) for k in self._streams_by_producer.get(pod_key, ())}
        return dirty

    # ------------------------------------------------------------ queries

    def live_claims(self, obj: ObjectInfo) -> list[ClaimInfo]:
        """Claims that hold a reference on this incarnation of the object: not those whose holder is known
        gone (claim_ended), which only wait for their deletion and never hold a free back."""
        return [c for c in self._claims_on(obj) if not self.claim_ended(c)]

    def _claims_on(self, obj: ObjectInfo) -> list[ClaimInfo]:
        """Claims on this incarnation of the object, ended or not."""
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
            self.objects[k]
            for k in self._objects_by_id.get((obj.namespace, obj.source_pod, obj.object_id), ())
            if k != obj.key
        ]

    def describes(self, namespace: str, pod: str, object_id: str) -> bool:
        """Whether a GPUObject names these bytes (an object id of this source pod)."""
        return (namespace, pod, object_id) in self._objects_by_id

    def references(self, obj: ObjectInfo) -> int:
        return len(self.live_claims(obj)) + (0 if obj.deleting else 1)

    def objects_of_pod(self, namespace: str, pod: str) -> list[ObjectInfo]:
        return [self.objects[k] for k in self._objects_by_pod.get((namespace, pod), ()) if k in self.objects]

    def stream_items(self, key: Key) -> list[ObjectInfo]:
        return [self.objects[k] for k in self._items_by_stream.get(key, ()) if k in self.objects]

    def has_stream_items(self, key: Key) -> bool:
        return key in self._items_by_stream

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
        expected_uid = obj.source_pod_uid or (obj.status.source_pod_uid if obj.materialized else None)
        if expected_uid and pod.uid != expected_uid:
            return SourceVerdict(
                False, "SourcePodReplaced", f"source pod {obj.source_pod} was recreated (uid {pod.uid})", pod
            )
        if pod.phase in ("Succeeded", "Failed"):
            return SourceVerdict(False, "SourcePodTerminated", f"source pod {obj.source_pod} is {pod.phase}", pod)
        if obj.state == names.STATE_LOST and obj.status.source_pod_uid == pod.uid:
            # The agent reported the bytes gone (audit); the pod itself is fine.
            lost = obj.status.condition(names.CONDITION_SOURCE_AVAILABLE)
            if lost and lost.status == "False":
                return SourceVerdict(False, lost.reason, lost.message, pod)
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
        if obj.spec_incarnation and (run := self.liveness.ended_run(pod.key, pod.uid, obj.created)):
            # Put by a process of a container run that has ended (the kubelet says so): gone with it.
            return "SourceAgentRestarted", _ended_message(obj.spec_incarnation, pod.name, run)
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

    @staticmethod
    def needs_scope(claim: ClaimInfo) -> bool:
        """A claim that ``share()`` made for another pod without naming the receiver's process: the
        operator scopes it to that pod's process alive when it was made (liveness.scoped_incarnation).
        A claim applied with kubectl (no shared-by annotation) stays its pod's."""
        return bool(
            claim.holder_pod
            and not claim.holder_incarnation
            and claim.shared_by
            and claim.shared_by != claim.holder_pod
        )

    def holder_incarnation(self, claim: ClaimInfo) -> str | None:
        """The process this claim belongs to: its spec.holder.incarnation, or the one the operator's probes
        scoped a share to; None while it belongs to its pod only."""
        if claim.holder_incarnation or not self.needs_scope(claim):
            return claim.holder_incarnation
        pod = self.pods.get((claim.namespace, claim.holder_pod))  # type: ignore[arg-type]
        uid = pod.uid if pod is not None else claim.owner_pods.get(claim.holder_pod)  # type: ignore[arg-type]
        return self.liveness.scoped_incarnation(
            (claim.namespace, claim.holder_pod),  # type: ignore[arg-type]
            uid,
            self.learned_at.get(claim.uid, float("inf")),
        )

    def holder_process_gone(self, claim: ClaimInfo) -> str | None:
        """Why the process this claim belongs to is known gone, or None (see holder_incarnation)."""
        if not claim.holder_pod or not (claim.holder_incarnation or self.needs_scope(claim)):
            return None
        pod = self.pods.get((claim.namespace, claim.holder_pod))
        uid = pod.uid if pod is not None else claim.owner_pods.get(claim.holder_pod)
        if run := self.liveness.ended_run((claim.namespace, claim.holder_pod), uid, claim.created):
            # Made while a container run lived that has ended: its process (named, or the one alive then
            # for a share that named only the pod) went with it, whether or not a probe ever reached it.
            return f"holder {_ended_message(claim.holder_incarnation, claim.holder_pod, run)}"
        learned_at = self.learned_at.get(claim.uid, float("inf"))
        if not claim.holder_incarnation and (
            why := self.liveness.run_replaced((claim.namespace, claim.holder_pod), uid, learned_at, claim.created)
        ):
            # A share that named only the pod belongs to the container run current when it was made: a
            # restart the pod watch reports ends it, even if that run's process never answered a probe.
            return f"holder {why}; shared by {claim.shared_by} without naming a process, so it was that run's"
        incarnation = self.holder_incarnation(claim)
        if not incarnation:
            return None
        why = self.liveness.incarnation_dead(
            (claim.namespace, claim.holder_pod),
            uid,
            incarnation,
            learned_at,
        )
        if why and not claim.holder_incarnation:
            why += f"; shared by {claim.shared_by} without naming a process, so it was that pod's process then"
        return f"holder {why}" if why else None

    def holder_pod_deleted(self, claim: ClaimInfo) -> PodInfo | None:
        """The tombstone of the holder pod this claim is owned by, when the pod watch saw that very pod
        (its uid) deleted: Kubernetes' garbage collector deletes the claim. A pod deleted is gone for good;
        one whose container restarts in place is not deleted, and a tombstone of another uid (a lookup's
        404, or an older pod of the name) proves nothing about this owner."""
        for name, uid in claim.owner_pods.items():
            pod = self.pods.get((claim.namespace, name))
            if pod is not None and pod.deleted and pod.uid == uid:
                return pod
        return None

    def claim_ended(self, claim: ClaimInfo) -> str | None:
        """Why this claim holds nothing any more although it is not deleted yet (a message), or None.

        Its holder pod was deleted, or the holder's process is known gone (holder_process_gone): the claim
        counts as ended at once, in memory, and the decision to free what it held is taken on that news.
        Its deletion follows, by the garbage collector or after the free (decide_claim)."""
        if pod := self.holder_pod_deleted(claim):
            return f"holder pod {pod.name} is gone"
        return self.holder_process_gone(claim)

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
        gone = state is not None and state.gone
        for incarnation, keys in self._objects_by_incarnation.get(pod, {}).items():
            if gone or incarnation != alive:  # the live process's own records are not suspect: skipped whole
                dirty |= {("object", k) for k in keys if self.objects[k].materialized}
        for key in self._claims_by_pod.get(pod, ()):
            claim = self.claims.get(key)
            if claim is None:
                continue
            incarnation = self.holder_incarnation(claim)
            if incarnation and incarnation != alive:
                dirty.add(("claim", key))
                dirty.add(("object", claim.object_key))  # its free is decided on this probe (claim_ended)
        return dirty

    def dead_holder_bytes(self) -> dict[Key, int]:
        """(namespace, source pod) -> bytes held only by claims whose holder is gone: leaked while they wait."""
        result: dict[Key, int] = defaultdict(int)
        for obj in self.objects.values():
            if not obj.deleting or not obj.finalized or not obj.materialized or obj.state == names.STATE_LOST:
                continue
            claims = self._claims_on(obj)
            if claims and all(self._holder_gone(c) for c in claims):
                result[(obj.namespace, obj.source_pod)] += obj.bytes
        return dict(result)

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


def _ended_message(incarnation: str | None, pod: str, run: ContainerRun) -> str:
    who = f"agent process {incarnation}" if incarnation else "the agent process"
    return (
        f"{who} of pod {pod} ran in container {run.container_id[-12:]}, which ended at "
        f"{run.finished:%H:%M:%S} (the kubelet reports a restart)"
    )


def _older(a: str, b: str) -> bool:
    """resourceVersions are etcd revisions in practice; treat unparsable ones as not older."""
    try:
        return int(a) < int(b)
    except ValueError:
        return False
