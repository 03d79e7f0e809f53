"""The reference ledger's rules, driven without a server (the cluster tests drive the same code for real)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuobj_contract import names
from gpuobj_contract.layouts import tensor_bytes
from gpuobj_contract.resources import GPUObjectClaimStatus, GPUObjectStatus
from gpuobj_operator.actions import (
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
    ReleaseWithoutFree,
    SetClaimOwner,
)
from gpuobj_operator.decisions import decide_claim, decide_object, decide_stream
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.model import ClaimInfo, ObjectInfo, PodInfo, StreamInfo

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
NS = "ml"


def pod(
    name: str = "src", uid: str = "pod-uid-1", endpoint: str | None = "10.0.0.5:8471", phase: str = "Running"
) -> PodInfo:
    return PodInfo(NS, name, uid, phase=phase, endpoint=endpoint)


def obj(name: str = "w", *, uid: str = "obj-uid-1", deleting: bool = False, finalized: bool = True, **kw) -> ObjectInfo:
    kw.setdefault("spec_object_id", f"o-{name}")
    kw.setdefault("source_pod_uid", "pod-uid-1")
    return ObjectInfo(
        NS,
        name,
        uid,
        source_pod=kw.pop("source_pod", "src"),
        tensors=kw.pop("tensors", [{"shape": [4, 4], "dtype": "float32", "device": "cpu"}]),
        deleting=deleting,
        finalized=finalized,
        **kw,
    )


def claim(name: str = "c1", object_name: str = "w", *, uid: str | None = None, **kw) -> ClaimInfo:
    return ClaimInfo(NS, name, uid or f"claim-{name}", object_name=object_name, **kw)


def synced_ledger(*items) -> Ledger:
    ledger = Ledger()
    for item in items:
        if isinstance(item, PodInfo):
            ledger.upsert_pod(item)
        elif isinstance(item, ObjectInfo):
            ledger.upsert_object(item, now=0.0)
        elif isinstance(item, ClaimInfo):
            ledger.upsert_claim(item, now=0.0)
        elif isinstance(item, StreamInfo):
            ledger.upsert_stream(item)
    ledger.synced = True
    return ledger


def kinds(actions) -> list[type]:
    return [type(a) for a in actions]


def test_nothing_is_decided_before_every_kind_was_listed() -> None:
    ledger = synced_ledger(pod(), obj(deleting=True))
    ledger.synced = False
    assert decide_object(ledger, (NS, "w"), NOW) == []


def test_a_live_object_gets_ready_status_once_and_then_no_writes() -> None:
    ledger = synced_ledger(pod(), obj())
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert kinds(actions) == [PatchObjectStatus]
    status = actions[0].status
    assert status["state"] == names.STATE_READY
    assert status["references"] == 1 and status["claims"] == 0
    assert status["bytes"] == 64
    assert status["transport"]["agentEndpoint"] == "10.0.0.5:8471"
    assert {c["type"] for c in status["conditions"]} == {names.CONDITION_READY, names.CONDITION_SOURCE_AVAILABLE}
    # Once the status is what we would write, nothing is written again.
    o = ledger.objects[(NS, "w")]
    o.status = GPUObjectStatus.from_json(status)  # what was written, read back
    assert decide_object(ledger, (NS, "w"), NOW + dt.timedelta(seconds=5)) == []


def test_deleted_object_without_claims_is_freed_on_its_source() -> None:
    ledger = synced_ledger(pod(), obj(deleting=True))
    (action,) = decide_object(ledger, (NS, "w"), NOW)
    # The free names the pod uid the agent must serve (it refuses otherwise: a reused address, a decoy).
    assert action == Free((NS, "w"), "obj-uid-1", "o-w", "10.0.0.5:8471", 64, "OutOfScope", "pod-uid-1")


def test_deleted_object_waits_for_its_claims_and_frees_after_the_last_goes() -> None:
    c1, c2 = claim("c1"), claim("c2")
    ledger = synced_ledger(pod(), obj(deleting=True), c1, c2)
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert kinds(actions) == [PatchObjectStatus]
    assert actions[0].status["state"] == names.STATE_RELEASING
    assert actions[0].status["references"] == 2
    ledger.remove_claim(c1, now=1.0)
    assert Free not in kinds(decide_object(ledger, (NS, "w"), NOW))
    assert (NS, "w") not in ledger.ref_gone_at
    ledger.remove_claim(c2, now=2.0)
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]
    assert ledger.ref_gone_at[(NS, "w")] == 2.0


def test_a_copy_naming_the_same_bytes_never_frees_them_while_the_original_lives() -> None:
    """Issue 11: a peer copied spec.objectId and source into a new GPUObject and deleted it."""
    ledger = synced_ledger(pod(), obj("real"), claim("c1", "real"), obj("copy", uid="obj-uid-2", deleting=True,
                                                                       spec_object_id="o-real"))  # fmt: skip
    actions = decide_object(ledger, (NS, "copy"), NOW)
    assert kinds(actions) == [Emit, ReleaseWithoutFree]
    assert actions[0].reason == "DuplicateObjectId" and actions[1].reason == "DuplicateObjectId"
    # The original, once deleted and unclaimed (the copy gone), is freed as usual.
    ledger.remove_object(ledger.objects[(NS, "copy")])
    ledger.remove_claim(ledger.claims[(NS, "c1")], now=1.0)
    ledger.objects[(NS, "real")].deleting = True
    assert kinds(decide_object(ledger, (NS, "real"), NOW)) == [Free]


def test_a_claim_shared_by_a_pod_other_than_the_source_holds_nothing() -> None:
    ledger = synced_ledger(pod(), obj(deleting=True), claim("bogus", holder_pod="victim", shared_by="intruder"))
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]
    ledger = synced_ledger(pod(), obj(deleting=True), claim("real", holder_pod="reader", shared_by="src"))
    assert Free not in kinds(decide_object(ledger, (NS, "w"), NOW))


def test_claims_pinned_to_another_incarnation_or_being_deleted_hold_nothing() -> None:
    ledger = synced_ledger(
        pod(), obj(deleting=True), claim("old", object_uid="an-older-uid"), claim("dying", deleting=True)
    )
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]


def test_source_pod_deleted_makes_the_object_lost_and_cleans_it_up_when_unclaimed() -> None:
    p = pod()
    ledger = synced_ledger(p, obj())
    ledger.remove_pod(p)
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert kinds(actions) == [PatchObjectStatus, Emit, DeleteObject]
    assert actions[0].status["state"] == names.STATE_LOST
    assert actions[1].reason == "Lost"
    assert actions[2].reason == "Lost"


def test_lost_object_with_claims_stays_until_they_go_and_is_then_released_without_a_free() -> None:
    p, c = pod(), claim()
    ledger = synced_ledger(p, obj(), c)
    ledger.remove_pod(p)
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert DeleteObject not in kinds(actions)
    claim_actions = decide_claim(ledger, (NS, "c1"), NOW)
    assert claim_actions[0].status["state"] == "Lost"
    # The owner deletes it; once the claim goes there is nothing to free: the memory went with the pod.
    ledger.upsert_object(obj(deleting=True), now=1.0)
    ledger.remove_claim(c, now=2.0)
    (action,) = decide_object(ledger, (NS, "w"), NOW)
    assert action == ReleaseWithoutFree((NS, "w"), "obj-uid-1", "SourcePodDeleted")


def test_source_pod_recreated_with_a_new_uid_makes_the_object_lost() -> None:
    ledger = synced_ledger(pod(uid="pod-uid-2"), obj())
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert actions[0].status["state"] == names.STATE_LOST
    assert "recreated" in actions[0].status["conditions"][0]["message"]


def test_unknown_source_pod_is_looked_up_first() -> None:
    ledger = synced_ledger(obj(deleting=True))
    assert decide_object(ledger, (NS, "w"), NOW) == [LookupPod(NS, "src")]


def test_object_without_our_finalizer_gets_it() -> None:
    ledger = synced_ledger(pod(), obj(finalized=False))
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [AddFinalizer]


def test_deleted_object_without_our_finalizer_is_left_to_the_api_server() -> None:
    ledger = synced_ledger(pod(), obj(finalized=False, deleting=True))
    assert decide_object(ledger, (NS, "w"), NOW) == []


def test_declared_object_is_materialized_by_its_source_agent() -> None:
    declared = obj(spec_object_id=None, source_pod_uid=None, key_name="weights")
    ledger = synced_ledger(pod(), declared)
    assert decide_object(ledger, (NS, "w"), NOW) == [
        Materialize((NS, "w"), "obj-uid-1", "10.0.0.5:8471", "obj-uid-1", "pod-uid-1")
    ]


def test_declared_object_whose_pod_does_not_exist_yet_waits_instead_of_being_lost() -> None:
    declared = obj(spec_object_id=None, source_pod_uid=None)
    ledger = synced_ledger(declared)
    ledger.remove_pod(PodInfo(NS, "src", uid="", deleted=True))
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert kinds(actions) == [PatchObjectStatus]
    assert actions[0].status["state"] == names.STATE_PENDING


def test_late_report_of_a_consumed_stream_item_is_deleted_not_counted() -> None:
    """Streamed-item leak (docs/design.md): a report arriving after its item was consumed must not leave a reference."""
    stream = StreamInfo(NS, "tokens", "s-uid", producer_pod="src", consumed=5, finalized=True)
    late = obj("tokens-3", uid="i3", stream=("tokens", 3))
    fresh = obj("tokens-5", uid="i5", stream=("tokens", 5))
    ledger = synced_ledger(pod(), stream, late, fresh)
    (action,) = decide_object(ledger, (NS, "tokens-3"), NOW)
    assert isinstance(action, DeleteObject) and action.reason == "StaleStreamReport"
    assert DeleteObject not in kinds(decide_object(ledger, (NS, "tokens-5"), NOW))


def test_deleting_a_stream_deletes_its_items_then_finishes() -> None:
    stream = StreamInfo(NS, "tokens", "s-uid", producer_pod="src", deleting=True, finalized=True)
    item = obj("tokens-0", uid="i0", stream=("tokens", 0))
    ledger = synced_ledger(pod(), stream, item)
    assert kinds(decide_stream(ledger, (NS, "tokens"), NOW)) == [DeleteObject]
    ledger.upsert_object(obj("tokens-0", uid="i0", stream=("tokens", 0), deleting=True), now=1.0)
    assert decide_stream(ledger, (NS, "tokens"), NOW) == []  # waits for the item's free
    ledger.remove_object(ledger.objects[(NS, "tokens-0")])
    assert decide_stream(ledger, (NS, "tokens"), NOW) == [
        FinishStream((NS, "tokens"), "s-uid", "10.0.0.5:8471", "pod-uid-1")
    ]


def test_item_of_a_vanished_stream_is_deleted() -> None:
    ledger = synced_ledger(pod(), obj("tokens-0", stream=("tokens", 0)))
    (action,) = decide_object(ledger, (NS, "tokens-0"), NOW)
    assert isinstance(action, DeleteObject) and action.reason == "StreamDeleted"


def test_claim_whose_holder_pod_is_gone_is_deleted_as_a_backstop_to_garbage_collection() -> None:
    holder = pod("reader", uid="r-1")
    c = claim(owner_pods={"reader": "r-1"})
    ledger = synced_ledger(pod(), holder, obj(), c)
    ledger.remove_pod(holder)
    assert decide_claim(ledger, (NS, "c1"), NOW) == [DeleteClaim((NS, "c1"), "claim-c1", "holder pod reader is gone")]


def test_claim_naming_a_holder_gets_the_pod_as_owner() -> None:
    ledger = synced_ledger(pod(), pod("reader", uid="r-1"), obj(), claim(holder_pod="reader"))
    actions = decide_claim(ledger, (NS, "c1"), NOW)
    assert actions[0] == SetClaimOwner((NS, "c1"), "claim-c1", "reader", "r-1")
    assert kinds(actions)[1:] == [PatchClaimStatus]


def test_claim_on_a_missing_object_is_pending_and_lost_once_its_object_goes() -> None:
    ledger = synced_ledger(pod(), claim(object_name="nope"))
    (action,) = decide_claim(ledger, (NS, "c1"), NOW)
    assert action.status["state"] == "Pending"
    # Bound by the CRD's default alone says nothing of an object: still Pending, not Lost.
    ledger.claims[(NS, "c1")].status = GPUObjectClaimStatus(state="Bound")
    (action,) = decide_claim(ledger, (NS, "c1"), NOW)
    assert action.status["state"] == "Pending"
    # A written Bound named the object: once it is gone the claim is Lost.
    ledger.claims[(NS, "c1")].status = GPUObjectClaimStatus(state="Bound", object_uid="obj-uid")
    (action,) = decide_claim(ledger, (NS, "c1"), NOW)
    assert action.status["state"] == "Lost"


def test_bound_claim_reports_bytes_and_source() -> None:
    """A claim a person applied without a pin: its Bound is written, naming what it holds."""
    ledger = synced_ledger(pod(), obj(), claim())
    (action,) = decide_claim(ledger, (NS, "c1"), NOW)
    assert action.status["state"] == "Bound"
    assert action.status["bytes"] == 64 and action.status["sourcePod"] == "src"


def test_a_pinned_claim_that_stays_bound_costs_no_status_write() -> None:
    """The client library's claims pin the object's uid: Bound is the CRD's default, so nothing is written;
    its status is written once it is not Bound (the pinned object replaced: Lost)."""
    held = obj()
    for status in (GPUObjectClaimStatus(), GPUObjectClaimStatus(state="Bound")):  # unit shape, API default
        ledger = synced_ledger(pod(), held, claim(object_uid=held.uid, status=status))
        assert decide_claim(ledger, (NS, "c1"), NOW) == []
    ledger = synced_ledger(pod(), held, claim(object_uid="an-older-incarnation", status=GPUObjectClaimStatus("Bound")))
    (action,) = decide_claim(ledger, (NS, "c1"), NOW)
    assert isinstance(action, PatchClaimStatus) and action.status["state"] == "Lost"
    # Pending before, Bound now: written, so kubectl shows it bound again.
    ledger = synced_ledger(pod(), held, claim(object_uid=held.uid, status=GPUObjectClaimStatus(state="Pending")))
    (action,) = decide_claim(ledger, (NS, "c1"), NOW)
    assert action.status["state"] == "Bound"


def test_a_late_event_never_overwrites_a_newer_version() -> None:
    ledger = synced_ledger(pod(), obj(resource_version="20", status=GPUObjectStatus(state="Ready")))
    ledger.upsert_object(obj(resource_version="10"), now=1.0)
    assert ledger.objects[(NS, "w")].status == GPUObjectStatus(state="Ready")


def test_states_are_counted_for_the_gauges() -> None:
    ready, lost = GPUObjectStatus(state="Ready"), GPUObjectStatus(state="Lost")
    ledger = synced_ledger(pod(), obj(status=ready), obj("v", uid="u2", status=lost))
    by_state = ledger.objects_by_state()
    assert by_state["Ready"] == (1, 64) and by_state["Lost"] == (1, 64)
    assert by_state["Pending"] == (0, 0)


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [
        ([{"shape": [], "dtype": "float32"}], 4),
        ([{"shape": [0, 5], "dtype": "int8"}], 0),
        ([{"shape": [3], "dtype": "bfloat16"}, {"shape": [2, 2], "dtype": "bool"}], 10),
    ],
)
def test_tensor_bytes_cover_0d_empty_and_multi_tensor_objects(tensors, expected) -> None:
    assert tensor_bytes(tensors) == expected


def test_a_pod_tombstone_goes_once_nothing_indexes_the_pod() -> None:
    """Issue 30: a deleted pod no record names is forgotten (probe rounds and audits scan `pods`)."""
    ledger = Ledger(synced=True)
    idle = pod("idle", uid="idle-uid")
    ledger.upsert_pod(idle)
    ledger.remove_pod(idle)
    assert (NS, "idle") not in ledger.pods
    src = pod()
    ledger.upsert_pod(src)
    o = obj()
    ledger.upsert_object(o, 0.0)
    ledger.remove_pod(src)
    assert ledger.pods[(NS, "src")].deleted  # its object still needs the verdict
    ledger.remove_object(o)
    assert (NS, "src") not in ledger.pods
