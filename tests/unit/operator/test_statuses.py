"""Every status the operator writes comes from a pure builder (gpuobj_operator.statuses)."""

from __future__ import annotations

from gpuobj_contract import names
from gpuobj_operator import ledger
from gpuobj_operator.reconciler import Reconciler
from gpuobj_operator.statuses import (
    agent_lost_object_status,
    condition,
    failed_status,
    materialized_status,
    pending_status,
)

NOW = "2026-12-01T12:00:00Z"
REQUIRED = {"type", "status", "reason", "message", "observedGeneration", "lastTransitionTime"}


def test_condition_keeps_its_transition_time_while_status_holds() -> None:
    first = condition([], "Ready", "True", "Materialized", "ok", 1, NOW)
    again = condition([first], "Ready", "True", "Materialized", "still ok", 2, "2026-12-01T13:00:00Z")
    flipped = condition([again], "Ready", "False", "SourceLost", "gone", 2, "2026-12-01T14:00:00Z")
    assert set(first) == REQUIRED
    assert again["lastTransitionTime"] == NOW and again["observedGeneration"] == 2
    assert flipped["lastTransitionTime"] == "2026-12-01T14:00:00Z"


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


def test_every_action_the_ledger_returns_has_an_executor() -> None:
    actions = {c for c in vars(ledger).values() if isinstance(c, type) and issubclass(c, ledger.Action)}
    actions.discard(ledger.Action)
    assert actions == set(Reconciler._executors)
