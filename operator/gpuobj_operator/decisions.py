"""What must happen next for each GPUObject, claim and stream. Pure functions of the ledger.

Why: this is where gpuobj's rules live. The ledger (ledger.py) holds the state, these
functions read it and return actions (actions.py), statuses come from the builders
(statuses.py), and the reconciler executes; so every rule is unit-tested without a server.

Rules (docs/design.md, "Lifecycle rules"):
- An object's references are its live claims, plus the owner's own reference
  until the GPUObject is deleted. A claim whose holder pod was deleted, or whose
  holder process is known gone, is not live from that moment (Ledger.claim_ended):
  the free is decided then, and the claim's deletion follows (the garbage
  collector's, or the operator's after the free), never the other way round.
- Out of scope (deleted and no live claim) -> free on the source, then drop the
  finalizer. Never before every kind of state has been listed once (``synced``).
- A source pod that is gone, terminated or replaced (new UID) makes its objects
  Lost; a Lost object with no claim is deleted and its finalizer dropped without
  a free (its memory went with the pod).
- A stream item whose index is below the stream's read position was consumed:
  a report of it that arrives late is deleted at once (docs/design.md, "streamed-item leak").
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from gpuobj_contract import names
from gpuobj_contract.agent_api import Inventory, InventoryItem
from gpuobj_operator.actions import (
    Action,
    AddFinalizer,
    DeleteClaim,
    DeleteObject,
    Emit,
    FinishStream,
    Free,
    LookupPod,
    Materialize,
    PatchClaimStatus,
    PatchObjectStatus,
    PatchStreamStatus,
    ReleaseWithoutFree,
    Requeue,
    SetClaimOwner,
)
from gpuobj_operator.ledger import Ledger, SourceVerdict, StreamTally, is_lost
from gpuobj_operator.model import ClaimInfo, Key, ObjectInfo, PodInfo
from gpuobj_operator.quota import REASON as QUOTA_EXCEEDED
from gpuobj_operator.statuses import (
    desired_claim_status,
    desired_object_status,
    desired_stream_status,
    refused_object_status,
)

# How long a claim owned by a deleted pod is left to Kubernetes' garbage collector before the operator
# deletes it itself (it holds nothing meanwhile: Ledger.claim_ended).
COLLECTOR_GRACE = dt.timedelta(seconds=30)


def decide_object(ledger: Ledger, key: Key, now: dt.datetime) -> list[Action]:
    """What must happen for this GPUObject now. Empty when nothing is to be done."""
    obj = ledger.objects.get(key)
    if obj is None or not ledger.synced:
        return []
    verdict = ledger.source_verdict(obj)
    if verdict.unknown:
        return [LookupPod(obj.namespace, obj.source_pod)]
    claims = ledger.live_claims(obj)
    refusal = ledger.quota.refusal(obj)
    if obj.deleting:
        if not obj.finalized:
            return []  # not ours to hold; the API server removes it
        if claims and refusal:
            return _drop_claims(claims, refusal)  # a refused object's claims hold nothing it may keep
        if claims:
            return _status_actions(obj, verdict, claims, now)
        if ledger.siblings(obj):
            message = f"another GPUObject names object {obj.object_id} of pod {obj.source_pod}; not freed"
            return [
                Emit("GPUObject", obj.key, obj.uid, "Warning", "DuplicateObjectId", message),
                ReleaseWithoutFree(obj.key, obj.uid, "DuplicateObjectId"),
            ]
        if verdict.available and obj.materialized:
            pod = verdict.pod
            why = QUOTA_EXCEEDED if refusal else "OutOfScope"
            return [Free(obj.key, obj.uid, obj.object_id, pod.endpoint, obj.bytes, why, pod.uid)]  # type: ignore[union-attr,arg-type]
        if verdict.reason == "AgentEndpointUnknown" and obj.materialized:
            return _status_actions(obj, verdict, claims, now)  # wait for the pod's address
        return [ReleaseWithoutFree(obj.key, obj.uid, verdict.reason if not verdict.available else "NeverMaterialized")]
    if not obj.finalized:
        return [AddFinalizer(obj.key, obj.uid)]
    if refusal:
        return _refuse(obj, verdict, claims, refusal, now)
    if obj.stream:
        stream = ledger.streams.get((obj.namespace, obj.stream[0]))
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
    if is_lost(obj, verdict):
        actions = _status_actions(obj, verdict, claims, now)
        if obj.state != names.STATE_LOST:
            actions.append(Emit("GPUObject", obj.key, obj.uid, "Warning", "Lost", verdict.message))
        if not claims:
            actions.append(DeleteObject(obj.key, obj.uid, "Lost", f"{verdict.message}; no claim remains"))
        return actions
    pod = verdict.pod  # an available source has a pod with an endpoint (Ledger.source_verdict)
    materialize = obj.declared and not obj.materialized and verdict.available and obj.state != names.STATE_FAILED
    if materialize and pod is not None and pod.endpoint:
        return [Materialize(obj.key, obj.uid, pod.endpoint, obj.object_id, pod.uid)]
    return _status_actions(obj, verdict, claims, now)


def _refuse(
    obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], why: str, now: dt.datetime
) -> list[Action]:
    """Over its namespace's quota (quota.py): Failed and announced; bytes already stored are freed (the
    object and its claims deleted). A declared object is never materialized: nothing was allocated."""
    actions: list[Action] = []
    if obj.state != names.STATE_FAILED:
        status = refused_object_status(obj, verdict, claims, reason=QUOTA_EXCEEDED, message=why, now=now)
        actions += [
            PatchObjectStatus(obj.key, status),
            Emit("GPUObject", obj.key, obj.uid, "Warning", QUOTA_EXCEEDED, why),
        ]
    if obj.materialized:
        actions += [*_drop_claims(claims, why), DeleteObject(obj.key, obj.uid, QUOTA_EXCEEDED, why)]
    return actions


def _drop_claims(claims: list[ClaimInfo], why: str) -> list[Action]:
    return [DeleteClaim(c.key, c.uid, f"its GPUObject was refused: {why}", holder="quota") for c in claims]


def _status_actions(obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], now: dt.datetime) -> list[Action]:
    desired = desired_object_status(obj, verdict, claims, now)
    if _status_differs(obj.status.to_json(), desired):
        return [PatchObjectStatus(obj.key, desired)]
    return []


def decide_claim(ledger: Ledger, key: Key, now: dt.datetime) -> list[Action]:
    """What must happen for this claim now: drop it when its holder or TTL is gone, else keep its status."""
    claim = ledger.claims.get(key)
    if claim is None or not ledger.synced or claim.deleting:
        return []
    actions: list[Action] = []
    for pod_name in claim.owner_pods:
        if (claim.namespace, pod_name) not in ledger.pods:
            return [LookupPod(claim.namespace, pod_name)]
    # A claim whose holder is gone counted as ended the moment the ledger learned it (Ledger.claim_ended):
    # the free of what it held never waits for the deletions below.
    if tombstone := ledger.holder_pod_deleted(claim):
        return _left_to_the_collector(claim, tombstone, now)
    for pod_name, pod_uid in claim.owner_pods.items():
        owner = ledger.pods[(claim.namespace, pod_name)]
        if owner.deleted or owner.uid != pod_uid:
            # Gone, but not provably this owner (a lookup's 404, a pod of that name made again): the claim
            # still holds until it is deleted, and the operator deletes it now.
            return [DeleteClaim(claim.key, claim.uid, f"holder pod {pod_name} is gone")]
    if why := ledger.holder_process_gone(claim):
        if _free_pending(ledger, claim):
            return []  # deleted after the free: the object's deletion decides this claim again
        return [DeleteClaim(claim.key, claim.uid, why, holder="process")]
    if (ttl := ledger.claim_ttl.effective(claim)) and claim.created:
        left = (claim.created + dt.timedelta(seconds=ttl) - now).total_seconds()
        if left <= 0:
            return [DeleteClaim(claim.key, claim.uid, f"its TTL of {ttl}s expired", holder="ttl")]
        actions.append(Requeue("claim", claim.key, left))
    if claim.holder_pod and claim.holder_pod not in claim.owner_pods:
        pod = ledger.pods.get((claim.namespace, claim.holder_pod))
        if pod is None:
            return [LookupPod(claim.namespace, claim.holder_pod)]
        if not pod.deleted:
            actions.append(SetClaimOwner(claim.key, claim.uid, pod.name, pod.uid))
    obj = ledger.objects.get(claim.object_key)
    replaced = obj is not None and bool(claim.object_uid) and obj.uid != claim.object_uid
    if obj is None or replaced:
        desired = desired_claim_status(claim, None, None, now, replaced=replaced)
    else:
        verdict = ledger.source_verdict(obj)
        if verdict.unknown:
            return [*actions, LookupPod(obj.namespace, obj.source_pod)]
        desired = desired_claim_status(claim, obj, verdict, now)
    if _claim_status_due(claim, desired):
        actions.append(PatchClaimStatus(claim.key, desired))
    return actions


def _claim_status_due(claim: ClaimInfo, desired: dict[str, Any]) -> bool:
    """Whether the claim's status must be written to say ``desired``.

    Why not whenever it differs: every claim reads Bound from the CRD's default the moment it is created,
    and a claim the client library makes pins its object's incarnation (spec.objectUID), so a written Bound
    would repeat what the claim and its object already say (bytes, source pod and claim count are in the
    GPUObject's status) at one API write per hand-off. Such a claim's status is written only when it stops
    being Bound (Pending, Lost) or after it was not. A claim a person applied without a pin still gets its
    Bound written, with the object's uid, bytes and source pod (few such claims, and the uid is what makes
    it Lost rather than Pending once its object goes)."""
    if desired.get("state") == "Bound" and claim.object_uid and claim.status.state in (None, "Bound"):
        return False
    return _status_differs(claim.status.to_json(), desired)


def _left_to_the_collector(claim: ClaimInfo, tombstone: PodInfo, now: dt.datetime) -> list[Action]:
    """A claim owned by a deleted pod: Kubernetes' garbage collector deletes it with the pod, so the
    operator writes nothing; only if it is still there COLLECTOR_GRACE after the pod went (no collector,
    or one far behind) does the operator delete it itself."""
    if tombstone.deleted_at is not None:
        left = (tombstone.deleted_at + COLLECTOR_GRACE - now).total_seconds()
        if left > 0:
            return [Requeue("claim", claim.key, left)]
    return [DeleteClaim(claim.key, claim.uid, f"holder pod {tombstone.name} is gone")]


def _free_pending(ledger: Ledger, claim: ClaimInfo) -> bool:
    """The claim's object is deleted and nothing live holds it: its free is on its way, and the claim's
    deletion waits for it (off the free's path); the object's own deletion re-decides the claim."""
    obj = ledger.objects.get(claim.object_key)
    if obj is None or (claim.object_uid and claim.object_uid != obj.uid):
        return False
    return obj.deleting and obj.finalized and not ledger.live_claims(obj)


def decide_stream(ledger: Ledger, key: Key, now: dt.datetime) -> list[Action]:
    """What must happen for this stream now: its counters, or, once deleted, its items and then itself."""
    stream = ledger.streams.get(key)
    if stream is None or not ledger.synced:
        return []
    tally = ledger.stream_tallies.get(key) or StreamTally()
    if stream.deleting:
        if not stream.finalized:
            return []
        # Items first: each goes through the normal free path (and waits for its claims).
        if tally.live_items:
            live = [i for i in ledger.stream_items(key) if not i.deleting]
            return [DeleteObject(i.key, i.uid, "StreamDeleted", f"stream {stream.name} was deleted") for i in live]
        if ledger.has_stream_items(key):
            return []  # wait for the items' frees
        producer = ledger.pods.get((stream.namespace, stream.producer_pod))
        endpoint = producer.endpoint if producer and not producer.terminated else None
        return [FinishStream(stream.key, stream.uid, endpoint, producer.uid if endpoint and producer else "")]
    desired = desired_stream_status(stream, tally)
    written = stream.status.to_json()
    current = {k: written.get(k) for k in desired}
    if current != desired:
        return [PatchStreamStatus(stream.key, desired)]
    return []


def unreported_stream_items(ledger: Ledger, stream: Key, inventory: Inventory) -> list[InventoryItem]:
    """Items of a deleted stream that its producer's agent holds and no GPUObject describes (written,
    never reported): the stream's end frees them there."""
    return [
        item
        for item in inventory.objects
        if item.stream == stream[1] and not ledger.describes(stream[0], inventory.pod, item.id)
    ]


_DECIDERS: dict[str, Callable[[Ledger, Key, dt.datetime], list[Action]]] = {
    "object": decide_object,
    "claim": decide_claim,
    "stream": decide_stream,
}


def decide(ledger: Ledger, kind: str, key: Key, now: dt.datetime) -> list[Action]:
    """The actions for one work item of the queue (kind, key)."""
    try:
        decider = _DECIDERS[kind]
    except KeyError:
        raise ValueError(f"unknown kind {kind!r}") from None
    return decider(ledger, key, now)


def _status_differs(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Compare what we would write with what is there, ignoring keys we do not manage."""
    return any(current.get(k) != v for k, v in desired.items())
