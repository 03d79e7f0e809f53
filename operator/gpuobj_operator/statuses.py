"""Pure builders of every status and condition the operator writes, each unit-tested.

Why apart from the reconciler: the reconciler executes; what a status says (state, reason,
message, which conditions) is a decision, and decisions are plain Python that tests drive
without a server (KubeRay's habit: builders separate from the reconcilers that do I/O).
"""

from __future__ import annotations

import datetime as dt

from gpuobj_contract import names


def now_str(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    existing: list[dict], ctype: str, status: str, reason: str, message: str, generation: int, now: str
) -> dict:
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


def materialized_status(*, object_id: str, pod_uid: str, endpoint: str, incarnation: str) -> dict:
    """A declared object its source agent now holds (the ledger then derives Ready and its conditions)."""
    return {
        "state": names.STATE_READY,
        "objectId": object_id,
        "sourcePodUID": pod_uid,
        "transport": {"backend": "nixl", "agentEndpoint": endpoint, "agentIncarnation": incarnation},
    }


def pending_status(*, generation: int, reason: str, message: str, now: str) -> dict:
    """Waiting on the source (e.g. the key is not published yet): retried."""
    return {
        "state": names.STATE_PENDING,
        "conditions": [condition([], names.CONDITION_READY, "False", reason, message, generation, now)],
    }


def failed_status(*, generation: int, reason: str, message: str, now: str) -> dict:
    """The source agent refused to materialize the object: not retried."""
    return {
        "state": names.STATE_FAILED,
        "conditions": [condition([], names.CONDITION_READY, "False", reason, message, generation, now)],
    }


def agent_lost_object_status(*, pod_uid: str, generation: int, message: str, now: str) -> dict:
    """The source agent (audited) no longer holds the object, e.g. it restarted: Lost."""
    return {
        "state": names.STATE_LOST,
        "sourcePodUID": pod_uid,
        "conditions": [
            condition([], names.CONDITION_READY, "False", "SourceLost", message, generation, now),
            condition([], names.CONDITION_SOURCE_AVAILABLE, "False", "AgentLostObject", message, generation, now),
        ],
    }
