"""The audit's arithmetic: what counts as leaked, what is reclaimed, what is Lost."""

from __future__ import annotations

from gpuobj_operator.audit import InventoryItem, evaluate, expected_objects, parse_inventory
from tests.unit.operator.test_ledger import obj, pod, synced_ledger


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
    assert [i.object_id for i in findings.reclaim] == ["orphan-old"]
    assert findings.missing == []


def test_an_out_of_scope_object_still_held_past_the_grace_period_is_leaked_but_not_reclaimed_by_id() -> None:
    p = pod()
    ledger = synced_ledger(p, obj(deleting=True))
    findings = evaluate(
        ledger, p, [item("o-w", 100.0)], {}, settle_seconds=1, grace_seconds=30, pending_free_age={"o-w": 45.0}
    )
    assert findings.leaked_bytes == 100
    assert findings.reclaim == []  # its GPUObject still describes it: the free path owns it


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


def test_inventory_parsing_reads_the_agent_contract() -> None:
    inventory = {"objects": [{"id": "o-1", "bytes": 4096, "ageSeconds": 1.5, "stream": "s"}]}
    assert parse_inventory(inventory) == [InventoryItem("o-1", 4096, 1.5, "s")]
