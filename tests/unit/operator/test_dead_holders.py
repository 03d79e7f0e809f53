"""A dead holder's claims end in memory, the free is decided on that news, and no claim delete comes first.

Issue 30: dead holders were dropped in 12.3 s p99 at 1,000 pods because each one's claims were deleted
through the API, queued with everything else, before the source's free. The pure rules here; the e2e
test (tests/e2e/operator/test_dead_holder_free.py) runs them with the real API server and agents.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from gpuobj_operator.actions import DeleteClaim, Free, PatchObjectStatus, Requeue
from gpuobj_operator.decisions import COLLECTOR_GRACE, decide_claim, decide_object
from gpuobj_operator.model import AgentContainer, ContainerRun
from tests.unit.operator.test_ledger import NOW, NS, claim, kinds, obj, pod, synced_ledger

W = (NS, "w")


def holder(uid: str = "r-1", **kw):
    return pod("reader", uid=uid, endpoint="10.0.0.6:8471", **kw)


def owned(name: str = "c1", holder_uid: str = "r-1", **kw):
    """A claim as the client library makes it: holder pod named, and that pod its ownerReference."""
    return claim(name, holder_pod="reader", owner_pods={"reader": holder_uid}, **kw)


def deleted(p, at: dt.datetime = NOW):
    """The pod watch's DELETED, as intake.on_pod hands it to the ledger."""
    return dataclasses.replace(p, deleted_at=at)


def test_a_deleted_holder_pods_claim_ends_with_the_pod_event_and_the_free_is_decided_before_any_claim_delete() -> None:
    ledger = synced_ledger(pod(), holder(), obj(deleting=True), owned())
    assert Free not in kinds(decide_object(ledger, W, NOW))  # the claim holds it
    dirty = ledger.remove_pod(deleted(holder()), now=5.0)
    # The object the claim held is among the keys to decide now, and its last reference went now.
    assert ("object", W) in dirty and ("claim", (NS, "c1")) in dirty
    assert ledger.ref_gone_at[W] == 5.0
    assert "holder pod reader is gone" in (ledger.claim_ended(ledger.claims[(NS, "c1")]) or "")
    assert kinds(decide_object(ledger, W, NOW)) == [Free]
    # The claim is the garbage collector's (its ownerReference is the deleted pod): no operator write.
    assert decide_claim(ledger, (NS, "c1"), NOW) == [Requeue("claim", (NS, "c1"), COLLECTOR_GRACE.total_seconds())]


def test_a_claim_the_collector_never_deleted_is_deleted_by_the_operator_after_the_grace() -> None:
    ledger = synced_ledger(pod(), holder(), obj(deleting=True), owned())
    ledger.remove_pod(deleted(holder(), at=NOW - COLLECTOR_GRACE))
    assert decide_claim(ledger, (NS, "c1"), NOW) == [DeleteClaim((NS, "c1"), "claim-c1", "holder pod reader is gone")]


def test_a_holder_whose_container_restarts_in_place_is_not_dead() -> None:
    """Same pod (uid), a new container run: the pod is not deleted, and the claim, named for the pod
    (no process), still holds."""
    ledger = synced_ledger(pod(), holder(), obj(deleting=True), owned())
    restart = AgentContainer("workload", 1, ContainerRun("c2"), ContainerRun("c1"))
    ledger.upsert_pod(dataclasses.replace(holder(), agent_container=restart))
    assert ledger.claim_ended(ledger.claims[(NS, "c1")]) is None
    assert Free not in kinds(decide_object(ledger, W, NOW))
    assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))


def test_a_tombstone_of_another_uid_proves_nothing_and_the_claim_is_deleted_before_the_free_as_before() -> None:
    """The claim's owner is r-2 but the pod watch saw r-1 deleted (an older pod of that name; r-2's
    ADDED may still be on its way): not counted ended, so nothing is freed on it."""
    ledger = synced_ledger(pod(), holder(), obj(deleting=True), owned(holder_uid="r-2"))
    ledger.remove_pod(deleted(holder()), now=1.0)
    assert ledger.claim_ended(ledger.claims[(NS, "c1")]) is None
    assert Free not in kinds(decide_object(ledger, W, NOW))
    assert kinds(decide_claim(ledger, (NS, "c1"), NOW)) == [DeleteClaim]  # the operator's, as before


def test_a_lookups_404_keeps_the_tombstones_uid() -> None:
    ledger = synced_ledger(pod(), holder(), obj(deleting=True), owned())
    ledger.remove_pod(deleted(holder()), now=1.0)
    ledger.remove_pod(pod("reader", uid="", endpoint=None), now=2.0)  # what LookupPod records on a 404
    assert ledger.pods[(NS, "reader")].uid == "r-1"
    assert kinds(decide_object(ledger, W, NOW)) == [Free]


def test_a_claim_of_a_live_holder_keeps_the_object_while_the_dead_holders_claim_is_deleted_at_once() -> None:
    ledger = synced_ledger(
        pod(),
        holder(),
        pod("other", uid="o-1"),
        obj(deleting=True),
        owned(),
        owned_by_other := claim("c2", holder_pod="other", owner_pods={"other": "o-1"}),
    )
    ledger.remove_pod(deleted(holder()), now=1.0)
    assert ledger.live_claims(ledger.objects[W]) == [owned_by_other]
    assert Free not in kinds(decide_object(ledger, W, NOW))
    ledger.remove_pod(deleted(pod("other", uid="o-1")), now=2.0)
    assert kinds(decide_object(ledger, W, NOW)) == [Free]


def test_a_dead_processs_claim_frees_at_once_and_is_deleted_after_the_free() -> None:
    ledger = synced_ledger(pod(), holder(), obj(deleting=True), claim(holder_pod="reader", holder_incarnation="r-a"))
    ledger.liveness.observe_alive((NS, "reader"), "r-1", "r-a", probe_started=1.0)
    assert Free not in kinds(decide_object(ledger, W, NOW))
    ledger.liveness.observe_alive((NS, "reader"), "r-1", "r-b", probe_started=2.0)  # the process was replaced
    assert ("object", W) in ledger.suspect_records((NS, "reader"))
    assert kinds(decide_object(ledger, W, NOW)) == [Free]
    assert decide_claim(ledger, (NS, "c1"), NOW) == []  # after the free: its object's deletion decides it again
    ledger.remove_object(ledger.objects[W])
    [drop] = decide_claim(ledger, (NS, "c1"), NOW)
    assert isinstance(drop, DeleteClaim) and drop.holder == "process"


def test_a_dead_processs_claim_on_an_object_its_owner_still_holds_is_deleted_at_once() -> None:
    ledger = synced_ledger(pod(), holder(), obj(), claim(holder_pod="reader", holder_incarnation="r-a"))
    ledger.liveness.observe_alive((NS, "reader"), "r-1", "r-a", probe_started=1.0)
    ledger.liveness.observe_alive((NS, "reader"), "r-1", "r-b", probe_started=2.0)
    [drop] = decide_claim(ledger, (NS, "c1"), NOW)
    assert isinstance(drop, DeleteClaim) and drop.holder == "process"
    # The object's status no longer counts the ended claim: only the owner's reference remains.
    [patch] = [a for a in decide_object(ledger, W, NOW) if isinstance(a, PatchObjectStatus)]
    assert patch.status["references"] == 1 and patch.status["claims"] == 0
