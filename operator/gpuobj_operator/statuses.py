"""Pure builders of every status and condition the operator writes, each unit-tested.

Why apart from the reconciler: the reconciler executes; what a status says (state, reason,
message, which conditions) is a decision, and decisions are plain Python that tests drive
without a server (KubeRay's habit: builders separate from the reconcilers that do I/O).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any

from gpuobj_contract import names
from gpuobj_operator.ledger import SourceVerdict, StreamTally, is_lost
from gpuobj_operator.model import ClaimInfo, ObjectInfo, StreamInfo


def now_str(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    existing: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str, generation: int, now: str
) -> dict[str, Any]:
    """A condition in the API conventions' shape; the transition time moves only when status does."""
    previous = next((c for c in existing if c.get("type") == ctype), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == status else now
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }


def materialized_status(*, object_id: str, pod_uid: str, endpoint: str, incarnation: str) -> dict[str, Any]:
    """A declared object its source agent now holds (the ledger then derives Ready and its conditions)."""
    return {
        "state": names.STATE_READY,
        "objectId": object_id,
        "sourcePodUID": pod_uid,
        "transport": {"backend": "nixl", "agentEndpoint": endpoint, "agentIncarnation": incarnation},
    }


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
    answer = materialized_status(object_id=object_id, pod_uid=pod_uid, endpoint=endpoint, incarnation=incarnation)
    held = dataclasses.replace(obj, status={**obj.status, **answer})
    return {**desired_object_status(held, verdict, claims, now), **answer}


def pending_status(*, generation: int, reason: str, message: str, now: str) -> dict[str, Any]:
    """Waiting on the source (e.g. the key is not published yet): retried."""
    return {
        "state": names.STATE_PENDING,
        "conditions": [condition([], names.CONDITION_READY, "False", reason, message, generation, now)],
    }


def failed_status(*, generation: int, reason: str, message: str, now: str) -> dict[str, Any]:
    """The source agent refused to materialize the object: not retried."""
    return {
        "state": names.STATE_FAILED,
        "conditions": [condition([], names.CONDITION_READY, "False", reason, message, generation, now)],
    }


def agent_lost_object_status(*, pod_uid: str, generation: int, message: str, now: str) -> dict[str, Any]:
    """The source agent (audited) no longer holds the object, e.g. it restarted: Lost."""
    return {
        "state": names.STATE_LOST,
        "sourcePodUID": pod_uid,
        "conditions": [
            condition([], names.CONDITION_READY, "False", "SourceLost", message, generation, now),
            condition([], names.CONDITION_SOURCE_AVAILABLE, "False", "AgentLostObject", message, generation, now),
        ],
    }


def desired_object_status(
    obj: ObjectInfo, verdict: SourceVerdict, claims: list[ClaimInfo], now: dt.datetime
) -> dict[str, Any]:
    """A GPUObject's status as the ledger sees it: state, counts, the Ready and SourceAvailable conditions."""
    stamp = now_str(now)
    existing = obj.status.get("conditions", [])
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


def desired_claim_status(
    claim: ClaimInfo, obj: ObjectInfo | None, verdict: SourceVerdict | None, now: dt.datetime
) -> dict[str, Any]:
    """A claim's status: Bound to its object, Lost with it, or Pending until it exists.

    ``obj`` None: no GPUObject of the claimed name and uid exists (any more); ``verdict`` is then unused.
    """
    stamp = now_str(now)
    existing = claim.status.get("conditions", [])
    if obj is None or verdict is None:
        lost = claim.status.get("state") in ("Bound", "Lost")
        state, reason, message = (
            ("Lost", "ObjectGone", f"GPUObject {claim.object_name} no longer exists")
            if lost
            else ("Pending", "ObjectNotFound", f"GPUObject {claim.object_name} does not exist (yet)")
        )
        desired: dict[str, Any] = {
            "state": state,
            "conditions": [condition(existing, "Bound", "False", reason, message, 1, stamp)],
        }
        if claim.status.get("objectUID"):
            desired["objectUID"] = claim.status["objectUID"]
    else:
        if is_lost(obj, verdict):
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
    return desired


def desired_stream_status(stream: StreamInfo, tally: StreamTally) -> dict[str, Any]:
    """A stream's counters: items emitted (never decreasing), live items and their bytes (ledger.StreamTally)."""
    return {
        "observedGeneration": 1,
        "emitted": max(tally.emitted, int(stream.status.get("emitted", 0))),
        "liveItems": tally.live_items,
        "bytes": tally.live_bytes,
    }


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
