"""Records scoped to an agent process (incarnation): the liveness rules and the ledger's decisions on them.

The e2e tests in tests/e2e/operator/test_incarnations.py drive the same code with real processes.
"""

from __future__ import annotations

import datetime as dt

from gpuobj_contract import names
from gpuobj_contract.resources import GPUObjectStatus
from gpuobj_operator.actions import (
    DeleteClaim,
    DeleteObject,
    Emit,
    Free,
    PatchObjectStatus,
    ReleaseWithoutFree,
    Requeue,
)
from gpuobj_operator.decisions import decide_claim, decide_object
from gpuobj_operator.liveness import Liveness
from tests.unit.operator.test_ledger import NOW, NS, claim, kinds, obj, pod, synced_ledger

SRC = (NS, "src")
READER = (NS, "reader")


def reader_pod():
    return pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")


def test_an_incarnation_replaced_by_another_is_dead_and_the_live_one_is_not() -> None:
    live = Liveness()
    live.observe_alive(SRC, "u1", "inc-a", probe_started=1.0)
    assert live.incarnation_dead(SRC, "u1", "inc-a", learned_at=0.0) is None
    assert live.observe_alive(SRC, "u1", "inc-b", probe_started=2.0)  # a change
    assert "replaced by inc-b" in live.incarnation_dead(SRC, "u1", "inc-a", learned_at=5.0)
    assert live.incarnation_dead(SRC, "u1", "inc-b", learned_at=5.0) is None


def test_a_record_newer_than_the_last_probe_is_never_judged_on_it() -> None:
    live = Liveness()
    live.observe_alive(SRC, "u1", "inc-a", probe_started=1.0)
    # inc-c made a record the operator heard of at t=3, after the last probe: it may be the new process.
    assert live.incarnation_dead(SRC, "u1", "inc-c", learned_at=3.0) is None
    live.observe_alive(SRC, "u1", "inc-c", probe_started=4.0)
    assert live.incarnation_dead(SRC, "u1", "inc-c", learned_at=3.0) is None
    # An incarnation never seen alive (operator restarted), judged by a probe after the record: dead.
    assert live.incarnation_dead(SRC, "u1", "inc-old", learned_at=3.0) is not None


def test_refusal_must_be_confirmed_and_a_timeout_proves_nothing() -> None:
    live = Liveness()
    live.observe_alive(SRC, "u1", "inc-a", probe_started=1.0)
    live.observe_unreachable(SRC, "u1")  # SIGSTOP or overload
    assert live.incarnation_dead(SRC, "u1", "inc-a", learned_at=0.0) is None
    assert not live.observe_refused(SRC, "u1", probe_started=2.0)
    assert live.incarnation_dead(SRC, "u1", "inc-a", learned_at=0.0) is None
    assert live.observe_refused(SRC, "u1", probe_started=3.0)
    assert live.agent_gone(SRC, "u1")
    assert "is gone" in live.incarnation_dead(SRC, "u1", "inc-a", learned_at=0.0)
    # The container comes back: a new process; the old one stays dead.
    live.observe_alive(SRC, "u1", "inc-b", probe_started=4.0)
    assert not live.agent_gone(SRC, "u1")
    assert live.incarnation_dead(SRC, "u1", "inc-a", learned_at=0.0) is not None


def test_a_new_pod_of_the_same_name_starts_afresh() -> None:
    live = Liveness()
    live.observe_alive(SRC, "u1", "inc-a", probe_started=1.0)
    live.observe_alive(SRC, "u2", "inc-b", probe_started=2.0)
    assert live.incarnation_dead(SRC, "u1", "inc-a", learned_at=0.0) is None  # judged with the old pod's state
    assert live.incarnation_dead(SRC, "u2", "inc-a", learned_at=0.0) is not None


def test_probes_back_off_while_failing_or_gone_and_confirm_refusals_quickly() -> None:
    live = Liveness()
    assert live.probe_delay(SRC, 1.0, 8.0) == 1.0
    live.observe_refused(SRC, "u1", 1.0)
    assert live.probe_delay(SRC, 1.0, 8.0) == 0.1  # confirmed within a tenth of a second, not an interval
    assert live.probe_delay(SRC, 20.0, 60.0) == 0.1
    live.observe_refused(SRC, "u1", 2.0)
    assert live.probe_delay(SRC, 1.0, 8.0) == 2.0
    for _ in range(6):
        live.observe_unreachable(SRC, "u1")
    assert live.probe_delay(SRC, 1.0, 8.0) == 8.0


def test_a_share_is_scoped_to_the_first_process_that_answered_after_the_operator_heard_of_it() -> None:
    live = Liveness()
    live.observe_alive(READER, "u1", "r-1", probe_started=1.0)
    # The claim was learned at t=1.5: the probe of t=1.0 predates it and decides nothing.
    assert live.scoped_incarnation(READER, "u1", learned_at=1.5) is None
    live.observe_alive(READER, "u1", "r-1", probe_started=2.0)
    assert live.scoped_incarnation(READER, "u1", learned_at=1.5) == "r-1"
    # Alive and slow to adopt: nothing says r-1 is dead.
    assert live.incarnation_dead(READER, "u1", "r-1", learned_at=1.5) is None
    live.observe_alive(READER, "u1", "r-2", probe_started=3.0)
    # Asked again after the restart: still r-1 (decided from the probes' history), and r-1 is dead.
    assert live.scoped_incarnation(READER, "u1", learned_at=1.5) == "r-1"
    assert "replaced by r-2" in live.incarnation_dead(READER, "u1", "r-1", learned_at=1.5)
    # A share learned after r-2 answered belongs to r-2, never to the dead r-1.
    assert live.scoped_incarnation(READER, "u1", learned_at=2.5) == "r-2"


def test_a_share_whose_process_died_before_any_probe_is_scoped_to_its_successor() -> None:
    live = Liveness()
    live.observe_alive(READER, "u1", "r-1", probe_started=1.0)
    live.observe_refused(READER, "u1", 2.0)
    live.observe_refused(READER, "u1", 3.0)  # gone: nothing to scope to yet
    assert live.scoped_incarnation(READER, "u1", learned_at=1.5) is None
    live.observe_alive(READER, "u1", "r-2", probe_started=4.0)
    # r-1 may have been the holder, but the operator cannot know it: the later process keeps it (safe).
    assert live.scoped_incarnation(READER, "u1", learned_at=1.5) == "r-2"


def test_a_share_for_another_pod_of_the_same_name_is_not_scoped_on_the_old_pods_probes() -> None:
    live = Liveness()
    live.observe_alive(READER, "u1", "r-1", probe_started=2.0)
    assert live.scoped_incarnation(READER, "u2", learned_at=1.0) is None
    live.observe_alive(READER, "u2", "r-9", probe_started=3.0)
    assert live.scoped_incarnation(READER, "u2", learned_at=1.0) == "r-9"


def test_claim_of_a_dead_holder_process_is_deleted_with_the_process_named() -> None:
    ledger = synced_ledger(pod(), reader_pod(), obj(), claim(holder_pod="reader", holder_incarnation="r-1"))
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-1", probe_started=1.0)
    assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=2.0)
    [action] = [a for a in decide_claim(ledger, (NS, "c1"), NOW) if isinstance(a, DeleteClaim)]
    assert action.holder == "process" and "r-1" in action.reason


def test_claim_without_an_incarnation_lives_as_long_as_its_pod() -> None:
    ledger = synced_ledger(pod(), reader_pod(), obj(), claim(holder_pod="reader"))
    ledger.liveness.observe_refused(READER, "pod-uid-r", 1.0)
    ledger.liveness.observe_refused(READER, "pod-uid-r", 2.0)
    assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))


def test_object_of_a_restarted_source_process_becomes_lost_and_is_released_without_a_free() -> None:
    ledger = synced_ledger(pod(), obj(spec_incarnation="s-1"))
    ledger.liveness.observe_alive(SRC, "pod-uid-1", "s-1", probe_started=1.0)
    assert not any(isinstance(a, DeleteObject) for a in decide_object(ledger, (NS, "w"), NOW))
    ledger.liveness.observe_alive(SRC, "pod-uid-1", "s-2", probe_started=2.0)
    actions = decide_object(ledger, (NS, "w"), NOW)
    assert kinds(actions) == [PatchObjectStatus, Emit, DeleteObject]
    status = actions[0].status
    assert status["state"] == names.STATE_LOST
    available = next(c for c in status["conditions"] if c["type"] == names.CONDITION_SOURCE_AVAILABLE)
    assert (available["status"], available["reason"]) == ("False", "SourceAgentRestarted")
    # Once deleted, its bytes went with the process: no free is sent to the new one.
    written = GPUObjectStatus.from_json(status)
    ledger.upsert_object(obj(spec_incarnation="s-1", deleting=True, status=written), now=3.0)
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [ReleaseWithoutFree]


def test_object_of_a_source_agent_that_nothing_answers_for_is_lost() -> None:
    ledger = synced_ledger(pod(), obj(spec_incarnation="s-1", deleting=True))
    ledger.liveness.observe_alive(SRC, "pod-uid-1", "s-1", probe_started=1.0)
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]
    ledger.liveness.observe_refused(SRC, "pod-uid-1", 2.0)
    ledger.liveness.observe_refused(SRC, "pod-uid-1", 3.0)
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [ReleaseWithoutFree]


def test_bytes_held_only_by_claims_of_dead_holders_count_as_leaked_until_dropped() -> None:
    ledger = synced_ledger(
        pod(), reader_pod(), obj(deleting=True), claim(holder_pod="reader", holder_incarnation="r-1")
    )
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-1", probe_started=1.0)
    assert ledger.dead_holder_bytes() == {}
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=2.0)
    assert ledger.dead_holder_bytes() == {SRC: 64}
    # A live second holder keeps the bytes referenced: not a leak.
    ledger.upsert_claim(claim("c2", holder_pod="reader", holder_incarnation="r-2"), now=3.0)
    assert ledger.dead_holder_bytes() == {}


def test_after_a_probe_the_records_of_other_incarnations_are_re_decided() -> None:
    ledger = synced_ledger(
        pod(),
        reader_pod(),
        obj(spec_incarnation="s-1"),
        claim(holder_pod="reader", holder_incarnation="r-1"),
        claim("c2", holder_pod="reader", holder_incarnation="r-2"),
    )
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=1.0)
    # The claim, and the object it held: its free is decided on this probe (Ledger.claim_ended).
    assert ledger.suspect_records(READER) == {("claim", (NS, "c1")), ("object", (NS, "w"))}
    ledger.liveness.observe_alive(SRC, "pod-uid-1", "s-1", probe_started=1.0)
    assert ledger.suspect_records(SRC) == set()


def test_a_claim_with_a_ttl_is_rechecked_when_due_and_dropped_once_it_ran_out() -> None:
    created = NOW - dt.timedelta(seconds=5)
    ledger = synced_ledger(pod(), obj(), claim(ttl_seconds=10, created=created))
    [requeue] = [a for a in decide_claim(ledger, (NS, "c1"), NOW) if isinstance(a, Requeue)]
    assert (requeue.kind, requeue.key, requeue.seconds) == ("claim", (NS, "c1"), 5.0)
    [drop] = decide_claim(ledger, (NS, "c1"), NOW + dt.timedelta(seconds=5))
    assert isinstance(drop, DeleteClaim) and drop.holder == "ttl" and "TTL of 10s" in drop.reason


def test_a_claim_without_a_ttl_never_expires() -> None:
    ledger = synced_ledger(pod(), obj(), claim(created=NOW - dt.timedelta(days=365)))
    assert not [a for a in decide_claim(ledger, (NS, "c1"), NOW) if isinstance(a, DeleteClaim | Requeue)]


def share(**kw):
    """A claim that src's share() made for the reader pod without naming the reader's process."""
    return claim(holder_pod="reader", shared_by="src", owner_pods={"reader": "pod-uid-r"}, **kw)


def test_a_share_without_an_incarnation_is_dropped_when_the_receiver_process_alive_at_the_time_dies() -> None:
    ledger = synced_ledger(pod(), reader_pod(), obj(deleting=True), share())  # learned at t=0
    assert ledger.holder_incarnation(ledger.claims[(NS, "c1")]) is None  # no probe since: the pod's for now
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-1", probe_started=1.0)
    for t in range(2, 20):  # alive, slow to adopt: kept however long
        ledger.liveness.observe_alive(READER, "pod-uid-r", "r-1", probe_started=float(t))
        assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))
    assert ledger.suspect_records(READER) == set() and ledger.dead_holder_bytes() == {}
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=20.0)  # the container restarted
    assert ledger.suspect_records(READER) == {("claim", (NS, "c1")), ("object", (NS, "w"))}
    assert ledger.dead_holder_bytes() == {SRC: 64}  # a leak while it waits
    # The claim ended with its process: the free is decided now, and the claim is deleted after it.
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]
    assert decide_claim(ledger, (NS, "c1"), NOW) == []
    ledger.remove_object(ledger.objects[(NS, "w")])
    [drop] = [a for a in decide_claim(ledger, (NS, "c1"), NOW) if isinstance(a, DeleteClaim)]
    assert drop.holder == "process" and "r-1" in drop.reason and "shared by src" in drop.reason


def test_a_share_whose_receiver_died_before_the_operator_asked_is_kept_by_the_next_process() -> None:
    ledger = synced_ledger(pod(), reader_pod(), obj(), share())
    ledger.liveness.observe_refused(READER, "pod-uid-r", 1.0)
    ledger.liveness.observe_refused(READER, "pod-uid-r", 2.0)
    assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=3.0)
    assert ledger.holder_incarnation(ledger.claims[(NS, "c1")]) == "r-2"
    assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))


def test_a_claim_applied_with_kubectl_is_never_scoped_to_a_process() -> None:
    ledger = synced_ledger(pod(), reader_pod(), obj(), claim(holder_pod="reader"))
    assert not ledger.needs_scope(ledger.claims[(NS, "c1")])
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-1", probe_started=1.0)
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=2.0)
    assert DeleteClaim not in kinds(decide_claim(ledger, (NS, "c1"), NOW))
    assert ledger.suspect_records(READER) == set()
