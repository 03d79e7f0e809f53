"""Every status the operator writes comes from a pure builder (gpuobj_operator.statuses)."""

from __future__ import annotations

import datetime as dt

from gpuobj_contract import names
from gpuobj_contract.resources import GPUObjectClaimStatus, GPUObjectStatus, GPUObjectStreamStatus
from gpuobj_operator import actions
from gpuobj_operator.ledger import SourceVerdict, StreamTally
from gpuobj_operator.model import ClaimInfo, ObjectInfo, PodInfo, StreamInfo
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.statuses import (
    agent_lost_object_status,
    condition,
    desired_claim_status,
    desired_object_status,
    desired_stream_status,
    failed_status,
    materialized_status,
    pending_status,
)

NOW = "2026-12-01T12:00:00Z"
REQUIRED = {"type", "status", "reason", "message", "observedGeneration", "lastTransitionTime"}
NOW_DT = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SRC = PodInfo("ml", "src", "pod-uid-1", phase="Running", endpoint="10.0.0.5:8471")
AVAILABLE = SourceVerdict(True, "SourceAvailable", "agent of pod src at 10.0.0.5:8471", SRC)
GONE = SourceVerdict(False, "SourcePodDeleted", "source pod src was deleted", PodInfo("ml", "src", "", deleted=True))
TENSORS = [{"shape": [4, 4], "dtype": "float32", "device": "cpu"}]


def put_object(**kw) -> ObjectInfo:
    """An object the client library put (it names its own id): materialized from the start."""
    return ObjectInfo("ml", "w", "obj-uid-1", source_pod="src", tensors=TENSORS, spec_object_id="o-w", **kw)


def declared_object(**kw) -> ObjectInfo:
    """An object declared with kubectl: Pending until its source agent materializes it."""
    return ObjectInfo("ml", "w", "obj-uid-1", source_pod="src", tensors=TENSORS, **kw)


def claim(**kw) -> ClaimInfo:
    return ClaimInfo("ml", "c1", "claim-uid-1", object_name="w", **kw)


def ready_reason(status: dict) -> tuple[str, str]:
    cond = next(c for c in status["conditions"] if c["type"] == names.CONDITION_READY)
    return cond["status"], cond["reason"]


def test_condition_keeps_its_transition_time_while_status_holds() -> None:
    first = condition((), "Ready", "True", "Materialized", "ok", 1, NOW)
    again = condition((first,), "Ready", "True", "Materialized", "still ok", 2, "2026-12-01T13:00:00Z")
    flipped = condition((again,), "Ready", "False", "SourceLost", "gone", 2, "2026-12-01T14:00:00Z")
    assert set(first.to_json()) == REQUIRED
    assert again.last_transition_time == NOW and again.observed_generation == 2
    assert flipped.last_transition_time == "2026-12-01T14:00:00Z"


def test_pending_and_failed_say_why_on_the_ready_condition() -> None:
    pending = pending_status(generation=3, reason="KeyNotPublished", message="key 'w' not published", now=NOW)
    failed = failed_status(generation=3, reason="MaterializeFailed", message="507", now=NOW)
    assert pending["state"] == names.STATE_PENDING and failed["state"] == names.STATE_FAILED
    for status in (pending, failed):
        (cond,) = status["conditions"]
        assert cond["type"] == names.CONDITION_READY and cond["status"] == "False"
        assert cond["observedGeneration"] == 3


def test_materialized_records_the_agent_and_its_incarnation() -> None:
    status = materialized_status(object_id="uid-1", pod_uid="p-1", endpoint="10.0.0.5:8471", incarnation="i-7")
    assert status["state"] == names.STATE_READY and status["sourcePodUID"] == "p-1"
    assert status["transport"] == {"backend": "nixl", "agentEndpoint": "10.0.0.5:8471", "agentIncarnation": "i-7"}


def test_agent_lost_object_is_lost_with_both_conditions_false() -> None:
    status = agent_lost_object_status(pod_uid="p-1", generation=1, message="agent restarted", now=NOW)
    assert status["state"] == names.STATE_LOST
    reasons = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert reasons == {
        names.CONDITION_READY: ("False", "SourceLost"),
        names.CONDITION_SOURCE_AVAILABLE: ("False", "AgentLostObject"),
    }


def test_every_action_the_decisions_return_has_an_executor() -> None:
    kinds = {c for c in vars(actions).values() if isinstance(c, type) and issubclass(c, actions.Action)}
    kinds.discard(actions.Action)
    assert kinds == set(Reconciler._executors)


def test_object_held_by_its_agent_is_ready_with_its_counts_and_transport() -> None:
    status = desired_object_status(put_object(), AVAILABLE, [claim()], NOW_DT)
    assert status["state"] == names.STATE_READY and ready_reason(status) == ("True", "Ready")
    assert (status["objectId"], status["bytes"], status["tensorCount"]) == ("o-w", 64, 1)
    assert (status["references"], status["claims"]) == (2, 1)  # the owner's own reference and the claim
    assert status["sourcePodUID"] == "pod-uid-1"
    assert status["transport"] == {"backend": "nixl", "agentEndpoint": "10.0.0.5:8471"}
    for cond in status["conditions"]:
        assert set(cond) == REQUIRED and cond["lastTransitionTime"] == NOW


def test_deleted_object_with_claims_is_releasing_and_counts_only_the_claims() -> None:
    status = desired_object_status(put_object(deleting=True), AVAILABLE, [claim()], NOW_DT)
    assert status["state"] == names.STATE_RELEASING and ready_reason(status) == ("False", "WaitingForClaims")
    assert status["references"] == 1


def test_object_whose_source_pod_went_is_lost_and_keeps_the_transport_it_had() -> None:
    transport = {"backend": "nixl", "agentEndpoint": "10.0.0.5:8471"}
    obj = put_object(
        status=GPUObjectStatus.from_json(
            {"state": names.STATE_READY, "sourcePodUID": "pod-uid-1", "transport": transport}
        )
    )
    status = desired_object_status(obj, GONE, [], NOW_DT)
    assert status["state"] == names.STATE_LOST and ready_reason(status) == ("False", "SourceLost")
    source = next(c for c in status["conditions"] if c["type"] == names.CONDITION_SOURCE_AVAILABLE)
    assert (source["status"], source["reason"]) == ("False", "SourcePodDeleted")
    assert status["sourcePodUID"] == "pod-uid-1" and status["transport"] == transport


def test_declared_object_not_yet_materialized_is_pending_without_an_object_id() -> None:
    status = desired_object_status(declared_object(), AVAILABLE, [], NOW_DT)
    assert status["state"] == names.STATE_PENDING and ready_reason(status) == ("False", "Materializing")
    assert "objectId" not in status
    # Never materialized, its source gone: still Pending (nothing was lost), saying why.
    gone = desired_object_status(declared_object(), GONE, [], NOW_DT)
    assert gone["state"] == names.STATE_PENDING
    assert next(c for c in gone["conditions"] if c["type"] == names.CONDITION_READY)["message"] == GONE.message


def test_failed_object_stays_failed_with_the_reason_it_failed_for() -> None:
    failed = failed_status(generation=1, reason="MaterializeFailed", message="507", now=NOW)
    status = desired_object_status(declared_object(status=GPUObjectStatus.from_json(failed)), AVAILABLE, [], NOW_DT)
    assert status["state"] == names.STATE_FAILED and ready_reason(status) == ("False", "MaterializeFailed")


def test_claim_of_an_object_not_there_yet_is_pending_and_of_one_gone_is_lost() -> None:
    pending = desired_claim_status(claim(), None, None, NOW_DT)
    assert pending["state"] == "Pending" and pending["conditions"][0]["reason"] == "ObjectNotFound"
    bound_before = claim(status=GPUObjectClaimStatus(state="Bound", object_uid="obj-uid-1"))
    lost = desired_claim_status(bound_before, None, None, NOW_DT)
    assert lost["state"] == "Lost" and lost["conditions"][0]["reason"] == "ObjectGone"
    assert lost["objectUID"] == "obj-uid-1" and lost["observedGeneration"] == 1


def test_claim_is_bound_to_a_live_object_and_lost_with_its_source() -> None:
    bound = desired_claim_status(claim(), put_object(), AVAILABLE, NOW_DT)
    assert bound["state"] == "Bound" and bound["conditions"][0]["status"] == "True"
    assert (bound["objectUID"], bound["bytes"], bound["sourcePod"]) == ("obj-uid-1", 64, "src")
    lost = desired_claim_status(claim(), put_object(), GONE, NOW_DT)
    assert lost["state"] == "Lost" and lost["conditions"][0]["reason"] == "SourceLost"


def test_stream_counts_live_items_and_never_lowers_emitted() -> None:
    stream = StreamInfo("ml", "tokens", "s-uid", producer_pod="src", status=GPUObjectStreamStatus(emitted=9))
    tally = StreamTally()
    for item in (put_object(stream=("tokens", 2)), put_object(stream=("tokens", 3), deleting=True)):
        tally.add(item, +1)
    status = desired_stream_status(stream, tally)
    assert status == {"observedGeneration": 1, "emitted": 9, "liveItems": 1, "bytes": 64}
    fresh = StreamInfo("ml", "tokens", "s-uid", producer_pod="src")
    assert desired_stream_status(fresh, tally)["emitted"] == 4
