"""The audit's arithmetic: what counts as leaked, what is reclaimed, what is Lost."""

from __future__ import annotations

from gpuobj_contract import names
from gpuobj_contract.agent_api import Inventory, InventoryItem
from gpuobj_contract.resources import GPUObjectStatus
from gpuobj_operator.actions import Emit, PatchObjectStatus
from gpuobj_operator.audit import evaluate, expected_objects, lost_actions
from tests.unit.operator.test_ledger import obj, pod, synced_ledger

NOW = "2026-12-01T12:00:00Z"


def item(object_id: str, age: float, size: int = 100) -> InventoryItem:
    return InventoryItem(object_id, size, age)


def test_unreferenced_bytes_count_after_settling_and_are_reclaimed_after_the_grace_period() -> None:
    p = pod()
    ledger = synced_ledger(p, obj())
    items = [item("o-w", 50.0), item("orphan-young", 0.1), item("orphan-settled", 3.0), item("orphan-old", 40.0)]
    findings = evaluate(
        ledger, p, items, expected_objects(ledger, p), settle_seconds=1, grace_seconds=30, pending_free_age={}
    )
    assert findings.leaked_bytes == 200  # settled + old; the young one may be a put whose GPUObject is on its way
    assert [i.id for i in findings.reclaim] == ["orphan-old"]
    assert findings.missing == []


def test_an_out_of_scope_object_still_held_past_the_grace_period_is_leaked_but_not_reclaimed_by_id() -> None:
    p = pod()
    ledger = synced_ledger(p, obj(deleting=True))
    findings = evaluate(
        ledger, p, [item("o-w", 100.0)], {}, settle_seconds=1, grace_seconds=30, pending_free_age={"o-w": 45.0}
    )
    assert findings.leaked_bytes == 100
    assert findings.reclaim == []  # its GPUObject still describes it: the free path owns it


def test_an_object_whose_record_is_still_queued_is_never_reclaimed_and_counts_only_past_the_grace() -> None:
    """An API outage longer than the grace: the put's GPUObject waits in its process's write-behind."""
    p = pod()
    ledger = synced_ledger(p)
    answer = {
        "podUID": p.uid,
        "incarnation": "i-1",
        "objects": [
            {"id": "queued-young", "bytes": 10, "ageSeconds": 3.0, "recordPending": True},
            {"id": "queued-old", "bytes": 20, "ageSeconds": 40.0, "recordPending": True},
            {"id": "orphan-old", "bytes": 40, "ageSeconds": 40.0},
        ],
    }
    items = Inventory.from_json(answer).objects
    findings = evaluate(ledger, p, items, {}, settle_seconds=1, grace_seconds=30, pending_free_age={})
    assert [i.id for i in findings.reclaim] == ["orphan-old"]  # never one with a live handle
    assert findings.leaked_bytes == 20 + 40  # the young queued one may yet land: not counted


def test_a_live_private_object_is_neither_counted_as_leaked_nor_reclaimed_past_the_grace() -> None:
    """Recording policy "shared": its process holds it and never records it; its bytes die with that process."""
    p = pod()
    ledger = synced_ledger(p)
    answer = {
        "podUID": p.uid,
        "incarnation": "i-1",
        "objects": [
            {"id": "private-old", "bytes": 10, "ageSeconds": 400.0, "private": True},
            {"id": "orphan-old", "bytes": 40, "ageSeconds": 40.0},
        ],
    }
    items = Inventory.from_json(answer).objects
    findings = evaluate(ledger, p, items, {}, settle_seconds=1, grace_seconds=30, pending_free_age={})
    assert [i.id for i in findings.reclaim] == ["orphan-old"]
    assert findings.leaked_bytes == 40


def test_objects_the_agent_no_longer_holds_are_missing_but_only_those_expected_before_asking() -> None:
    p = pod()
    ledger = synced_ledger(p, obj("a", uid="ua"), obj("b", uid="ub"))
    expected = expected_objects(ledger, p)
    ledger.upsert_object(obj("c", uid="uc"), now=1.0)  # put after the inventory was requested
    findings = evaluate(
        ledger, p, [item("o-a", 5.0)], expected, settle_seconds=1, grace_seconds=30, pending_free_age={}
    )
    assert [o.name for o in findings.missing] == ["b"]


def test_objects_of_a_replaced_pod_are_not_expected_from_the_new_agent() -> None:
    ledger = synced_ledger(pod(uid="pod-uid-2"), obj())
    assert expected_objects(ledger, pod(uid="pod-uid-2")) == {}


def test_the_audit_reads_the_agent_contracts_inventory() -> None:
    p = pod()
    ledger = synced_ledger(p)
    answer = {
        "podUID": p.uid,
        "incarnation": "i-1",
        "objects": [{"id": "orphan", "bytes": 4096, "ageSeconds": 40.0, "stream": "s"}],
    }
    inventory = Inventory.from_json(answer)
    findings = evaluate(ledger, p, inventory.objects, {}, settle_seconds=1, grace_seconds=30, pending_free_age={})
    assert findings.leaked_bytes == 4096
    assert findings.reclaim == [InventoryItem("orphan", 4096, 40.0, "s")]


def test_missing_objects_become_lost_with_a_warning_once() -> None:
    p = pod()
    held, deleting, lost = obj("a", uid="ua"), obj("b", uid="ub", deleting=True), obj("c", uid="uc")
    lost.status = GPUObjectStatus(state=names.STATE_LOST)
    actions = lost_actions(p, [held, deleting, lost], NOW)
    assert [type(a) for a in actions] == [PatchObjectStatus, Emit]  # deleting and already Lost: nothing to say
    patch, emit = actions
    assert patch.key == held.key and patch.status["state"] == names.STATE_LOST
    assert patch.status["sourcePodUID"] == p.uid
    assert (emit.type, emit.reason, emit.uid) == ("Warning", "Lost", "ua")
    assert "no longer holds object o-a" in emit.message


def test_an_object_freed_while_the_inventory_was_read_is_not_missing() -> None:
    """A paged inventory of a large store takes a while: a release and its free may land meanwhile."""
    p = pod()
    ledger = synced_ledger(p, obj("a", uid="ua"), obj("b", uid="ub"), obj("c", uid="uc"))
    expected = expected_objects(ledger, p)
    ledger.upsert_object(obj("a", uid="ua", deleting=True), now=1.0)  # released, then freed on the agent
    ledger.remove_object(obj("c", uid="uc"))  # freed and its GPUObject gone
    findings = evaluate(ledger, p, [], expected, settle_seconds=1, grace_seconds=30, pending_free_age={})
    assert [o.name for o in findings.missing] == ["b"]
