"""Compare an agent's inventory with the API's view. Pure: the auditor (auditor.py) does the I/O.

Leaked bytes are bytes an agent holds that no GPUObject describes (a crashed put,
a missed free, a planted orphan), or whose GPUObject is out of scope but still
unfreed after the grace period. They are counted at once (after a short settle
time that covers a put whose GPUObject is being created) and reclaimed after the
grace period. GPUObjects whose bytes the agent no longer holds become Lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuobj_contract import names
from gpuobj_contract.agent_api import InventoryItem
from gpuobj_operator.actions import Action, Emit, PatchObjectStatus
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.model import ObjectInfo, PodInfo
from gpuobj_operator.statuses import agent_lost_object_status


@dataclass
class AuditFindings:
    leaked_bytes: int = 0
    reclaim: list[InventoryItem] = field(default_factory=list)
    missing: list[ObjectInfo] = field(default_factory=list)


def expected_objects(ledger: Ledger, pod: PodInfo) -> dict[str, ObjectInfo]:
    """Objects this pod's agent must hold, taken BEFORE asking for the inventory:
    their puts happened earlier, so a missing one really is gone."""
    return {
        o.object_id: o
        for o in ledger.objects_of_pod(pod.namespace, pod.name)
        if o.materialized
        and not o.deleting
        and o.state != names.STATE_LOST
        and (not o.source_pod_uid or o.source_pod_uid == pod.uid)
    }


def evaluate(
    ledger: Ledger,
    pod: PodInfo,
    items: Sequence[InventoryItem],
    expected_before: dict[str, ObjectInfo],
    *,
    settle_seconds: float,
    grace_seconds: float,
    pending_free_age: dict[str, float],
) -> AuditFindings:
    """``pending_free_age``: object_id -> seconds since its last reference went, for out-of-scope objects."""
    findings = AuditFindings()
    described = {o.object_id: o for o in ledger.objects_of_pod(pod.namespace, pod.name)}
    held = {i.id for i in items}
    for item in items:
        obj = described.get(item.id)
        if obj is None:
            if item.private:
                # Held by a live handle of the process that embeds this agent and never recorded by policy
                # (docs/design.md, "Recording policy"): its bytes die with that process, and the agent too.
                continue
            if item.record_pending:
                # Its process still holds it and is recording it (an API outage outlasted the grace):
                # never reclaimed; counted as leaked only once the grace has passed, so a record that
                # never lands still shows.
                if item.age_seconds >= grace_seconds:
                    findings.leaked_bytes += item.bytes
                continue
            if item.age_seconds >= settle_seconds:
                findings.leaked_bytes += item.bytes
            if item.age_seconds >= grace_seconds:
                findings.reclaim.append(item)
        elif item.id in pending_free_age and pending_free_age[item.id] >= grace_seconds:
            # Out of scope for longer than the grace period and still held: a free that did not happen.
            findings.leaked_bytes += item.bytes
    # Missing: expected before asking, not held, and still expected now. An object freed or deleted while
    # the (paged) inventory was read is gone by design, not lost: judged on its record as it is now.
    findings.missing = [
        now
        for oid in expected_before
        if oid not in held
        and (now := described.get(oid)) is not None
        and not now.deleting
        and now.state != names.STATE_LOST
    ]
    return findings


def lost_actions(pod: PodInfo, missing: Iterable[ObjectInfo], now: str) -> list[Action]:
    """Objects the pod's agent no longer holds (it restarted, say) become Lost, each with a Warning."""
    actions: list[Action] = []
    for obj in missing:
        if obj.deleting or obj.state == names.STATE_LOST:
            continue
        message = f"agent of pod {pod.name} no longer holds object {obj.object_id} (agent restarted?)"
        status = agent_lost_object_status(pod_uid=pod.uid, generation=obj.generation, message=message, now=now)
        actions.append(PatchObjectStatus(obj.key, status))  # counts gpuobj_lost_objects_total, once
        actions.append(Emit("GPUObject", obj.key, obj.uid, "Warning", "Lost", message))
    return actions
