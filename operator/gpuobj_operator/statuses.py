"""Pure builders of every status and condition the operator writes, each unit-tested.

Why apart from the reconciler: the reconciler executes; what a status says (state, reason,
message, which conditions) is a decision, and decisions are plain Python that tests drive
without a server (KubeRay's habit: builders separate from the reconcilers that do I/O).
Each status is built as the contract's typed shape (gpuobj_contract.resources, pinned to crds/) and
written as its JSON: a misspelled or mistyped field fails the type check, not the API server.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any

from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_operator.ledger import SourceVerdict, StreamTally, is_lost
from gpuobj_operator.model import ClaimInfo, ObjectInfo, StreamInfo


def now_str(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    existing: tuple[crd.Condition, ...], ctype: str, status: str, reason: str, message: str, generation: int, now: str
) -> crd.Condition:
    """A condition in the API conventions' shape; the transition time moves only when status does."""
    previous = crd.find_condition(existing, ctype)
    since = previous.last_transition_time if previous and previous.status == status else now
    return crd.Condition(
        type=ctype,
        status=status,
        last_transition_time=since,
        reason=reason,
        message=message,
        observed_generation=generation,
    )


def _materialized(*, object_id: str, pod_uid: str, endpoint: str, incarnation: str) -> crd.GPUObjectStatus:
    return crd.GPUObjectStatus(
        state=names.STATE_READY,
        object_id=object_id,
        source_pod_uid=pod_uid,
        transport=crd.Transport(backend="nixl", agent_endpoint=endpoint, agent_incarnation=incarnation),
    )


def materialized_status(*, object_id: str, pod_uid: str, endpoint: str, incarnation: str) -> dict[str, Any]:
    """A declared object its source agent now holds (the ledger then derives Ready and its conditions)."""
    return _materialized(object_id=object_id, pod_uid=pod_uid, endpoint=endpoint, incarnation=incarnation).to_json()


def materialized_object_status(
    obj: ObjectInfo,
    verdict: SourceVerdict,
    claims: list[ClaimInfo],
    *,
    object_id: str,
    pod_uid: str,
    endpoint: str,
    incarnation: str,
    now: dt.datetime,
) -> dict[str, Any]:
    """The one status write that makes a declared object Ready: the agent's answer together with the
    counts and conditions the ledger derives (else BYTES and REFS show blank until a second write)."""
    answer = _materialized(object_id=object_id, pod_uid=pod_uid, endpoint=endpoint, incarnation=incarnation)
    held = dataclasses.replace(obj, status=_with_answer(obj.status, answer))
    return _with_answer(_desired_object_status(held, verdict, claims, now), answer).to_json()


def _with_answer(status: crd.GPUObjectStatus, answer: crd.GPUObjectStatus) -> crd.GPUObjectStatus:
    """``status`` with what the agent's materialize answer says (state, object id, source pod, transport)."""
    return dataclasses.replace(
        status,
        state=answer.state,
        object_id=answer.object_id,
        source_pod_uid=answer.source_pod_uid,
        transport=answer.transport,
    )


def _not_ready(state: str, *, generation: int, reason: str, message: str, now: str) -> dict[str, Any]:
    ready = condition((), names.CONDITION_READY, "False", reason, message, generation, now)
    return crd.GPUObjectStatus(state=state, conditions=(ready,)).to_json()


def pending_status(*, generation: int, reason: str, message: str, now: str) -> dict[str, Any]:
    """Waiting on the source (e.g. the key is not published yet): retried."""
    return _not_ready(names.STATE_PENDING, generation=generation, reason=reason, message=message, now=now)


def failed_status(*, generation: int, reason: str, message: str, now: str) -> dict[str, Any]:
    """The source agent refused to materialize the object: not retried."""
    return _not_ready(names.STATE_FAILED, generation=generation, reason=reason, message=message, now=now)


def refused_object_status(
    obj: ObjectInfo,
    verdict: SourceVerdict,
    claims: list[ClaimInfo],
    *,
    reason: str,
    message: str,
    now: dt.datetime,
) -> dict[str, Any]:
    """An object the operator refuses (e.g. over its namespace's quota): Failed, with the counts and
    conditions the ledger derives and the refusal as the Ready condition (what `kubectl get` shows)."""
    ready = condition((), names.CONDITION_READY, "False", reason, message, obj.generation, now_str(now))
    held = dataclasses.replace(
        obj, status=dataclasses.replace(obj.status, state=names.STATE_FAILED, conditions=(ready,))
    )
    return desired_object_status(held, verdict, claims, now)


def agent_lost_object_status(*, pod_uid: str, generation: int, message: str, now: str) -> dict[str, Any]:
    """The source agent (audited) no longer holds the object, e.g. it restarted: Lost."""
    return crd.GPUObjectStatus(
        state=names.STATE_LOST,
        source_pod_uid=pod_uid,
        conditions=(
            condition((), names.CONDITION_READY, "False", "SourceLost", message, generation, now),
            condition((), names.CONDITION_SOURCE_AVAILABLE, "False", "AgentLostObject", message, generation, now),
        ),
    ).to_json()


def desired_object_status(
    obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], now: dt.datetime
) -> dict[str, Any]:
    """A GPUObject's status as the ledger sees it: state, counts, the Ready and SourceAvailable conditions."""
    return _desired_object_status(obj, verdict, claims, now).to_json()


def _desired_object_status(
    obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], now: dt.datetime
) -> crd.GPUObjectStatus:
    stamp = now_str(now)
    existing = obj.status.conditions
    if obj.state == names.STATE_FAILED:
        state = names.STATE_FAILED
    elif is_lost(obj, verdict):
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
        failed = crd.find_condition(existing, names.CONDITION_READY)
        ready = ("False", failed.reason, failed.message) if failed else ("False", "Failed", "materialization failed")
    else:
        ready = (
            "False",
            "Materializing",
            verdict.message if not verdict.available else "waiting for the source agent",
        )
    if verdict.pod is not None and not verdict.pod.deleted:
        source_pod_uid: str | None = verdict.pod.uid
        transport = None
        if verdict.pod.endpoint:
            known = obj.status.transport.agent_incarnation if obj.status.transport else None
            transport = crd.Transport(
                backend="nixl", agent_endpoint=verdict.pod.endpoint, agent_incarnation=known or None
            )
    else:  # the source pod is gone: keep what the status said of it
        source_pod_uid, transport = obj.status.source_pod_uid, obj.status.transport
    return crd.GPUObjectStatus(
        observed_generation=obj.generation,
        state=state,
        object_id=obj.object_id if obj.materialized or not obj.declared else obj.status.object_id,
        bytes=obj.bytes,
        tensor_count=obj.tensor_count,
        references=refs,
        claims=len(claims),
        source_pod_uid=source_pod_uid,
        transport=transport,
        conditions=(
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
        ),
    )


def desired_claim_status(
    claim: ClaimInfo,
    obj: ObjectInfo | None,
    verdict: SourceVerdict | None,
    now: dt.datetime,
    *,
    replaced: bool = False,
) -> dict[str, Any]:
    """A claim's status: Bound to its object, Lost with it, or Pending until it exists.

    ``obj`` None: no GPUObject of the claimed name and uid exists (any more); ``verdict`` is then unused.
    ``replaced``: an object of that name exists, another incarnation than the one the claim pins: Lost.
    A claim is Lost once it was bound: its status named an object (a written Bound), or the object of its
    pin was replaced. A pinned claim whose object the operator has not seen reads Pending: the claim's
    watch event may come before its object's.
    """
    stamp = now_str(now)
    existing = claim.status.conditions
    if obj is None or verdict is None:
        lost = claim.status.state == "Lost" or bool(claim.status.object_uid) or replaced
        state, reason, message = (
            ("Lost", "ObjectGone", f"GPUObject {claim.object_name} no longer exists")
            if lost
            else ("Pending", "ObjectNotFound", f"GPUObject {claim.object_name} does not exist (yet)")
        )
        return crd.GPUObjectClaimStatus(
            observed_generation=1,
            state=state,
            object_uid=claim.status.object_uid or None,
            conditions=(condition(existing, "Bound", "False", reason, message, 1, stamp),),
        ).to_json()
    if is_lost(obj, verdict):
        state, reason, message = "Lost", "SourceLost", verdict.message
    else:
        state, reason, message = "Bound", "Bound", f"references GPUObject {obj.name} on pod {obj.source_pod}"
    return crd.GPUObjectClaimStatus(
        observed_generation=1,
        state=state,
        object_uid=obj.uid,
        bytes=obj.bytes,
        source_pod=obj.source_pod,
        conditions=(condition(existing, "Bound", "True" if state == "Bound" else "False", reason, message, 1, stamp),),
    ).to_json()


def desired_stream_status(stream: StreamInfo, tally: StreamTally) -> dict[str, Any]:
    """A stream's counters: items emitted (never decreasing), live items and their bytes (ledger.StreamTally)."""
    return crd.GPUObjectStreamStatus(
        observed_generation=1,
        emitted=max(tally.emitted, stream.status.emitted or 0),
        live_items=tally.live_items,
        bytes=tally.live_bytes,
    ).to_json()


@dataclass(frozen=True)
class AfterMaterializeError:
    """What follows an agent's refusal to materialize: the status to write; ``retry`` (why) when the
    object waits for its key to be published, else the Warning's ``reason`` (it failed for good)."""

    status: dict[str, Any]
    retry: str = ""
    reason: str = ""


def after_materialize_error(obj: ObjectInfo, http_status: int, message: str, now: str) -> AfterMaterializeError:
    if http_status == 404:  # the key the object names is not published (yet): Pending, and ask again
        pending = pending_status(generation=obj.generation, reason="KeyNotPublished", message=message, now=now)
        return AfterMaterializeError(pending, retry=f"key {obj.key_name!r} not published yet")
    failed = failed_status(generation=obj.generation, reason="MaterializeFailed", message=message, now=now)
    return AfterMaterializeError(failed, reason="MaterializeFailed")
