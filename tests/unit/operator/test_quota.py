"""Per-namespace byte quotas: the running sums and the refusals, driven without a server.

The same code runs for real in tests/e2e/operator/test_namespace_quota.py (operator, agents, API server).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from types import MappingProxyType

import pytest
from prometheus_client import generate_latest

from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_operator.actions import DeleteClaim, DeleteObject, Emit, Free, Materialize, PatchObjectStatus
from gpuobj_operator.decisions import decide_object
from gpuobj_operator.flags import build_parser, settings_from
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.model import ClaimInfo, ObjectInfo, PodInfo
from gpuobj_operator.quota import QuotaBook, QuotaLimits, parse_bytes, parse_namespace_quota

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
KIB = 1024


def obj(name: str, nbytes: int, *, ns: str = "team-a", pod: str = "p1", uid: str | None = None, **kw) -> ObjectInfo:
    """A library put of ``nbytes`` bytes (uint8) from pod ``pod``."""
    kw.setdefault("spec_object_id", f"o-{name}")
    return ObjectInfo(
        ns,
        name,
        uid or f"uid-{name}",
        source_pod=pod,
        source_pod_uid=f"uid-{pod}",
        tensors=[{"shape": [nbytes], "dtype": "uint8", "device": "cpu"}],
        finalized=True,
        **kw,
    )


def ledger_with(quota: dict[str, int], default: int | None = None, *pods: PodInfo) -> Ledger:
    ledger = Ledger(quota=QuotaBook(QuotaLimits(MappingProxyType(quota), default)))
    for p in pods or (PodInfo("team-a", "p1", "uid-p1", "Running", "10.0.0.1:8471"),):
        ledger.upsert_pod(p)
    ledger.synced = True
    return ledger


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8Gi", 8 << 30), ("512Mi", 512 << 20), ("500M", 500_000_000), ("1048576", 1 << 20), ("1k", 1000), ("0", 0)],
)
def test_byte_quantities_parse_as_kubernetes_writes_them(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "8GB", "1.5Gi", "-1", "Gi", "8 Gi x"])
def test_a_bad_quantity_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="byte quantity"):
        parse_bytes(text)


def test_operator_flags_give_the_settings_and_bad_ones_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["--namespace-quota", "team-a=8Gi", "--namespace-quota", "team-b=1Mi", "--default-namespace-quota", "2Gi"]
    )
    limits = settings_from(args).quota
    assert dict(limits.namespaces) == {"team-a": 8 << 30, "team-b": 1 << 20}
    assert limits.limit("team-a") == 8 << 30 and limits.limit("elsewhere") == 2 << 30
    assert settings_from(build_parser().parse_args([])).quota.limit("team-a") is None
    for bad in (["--namespace-quota", "team-a"], ["--namespace-quota", "team-a=lots"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
        assert "NAMESPACE=BYTES" in capsys.readouterr().err or "byte quantity" in capsys.readouterr().err
    assert parse_namespace_quota(" team-c = 1Ki") == ("team-c", KIB)


# ---------------------------------------------------------------- the running sum


def test_objects_of_every_pod_of_a_namespace_add_up_and_the_one_over_the_quota_is_refused() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    ledger.upsert_object(obj("first", 60 * KIB, pod="p1"), 0.0)
    ledger.upsert_object(obj("second", 60 * KIB, pod="p2"), 0.0)  # another pod, same namespace
    ledger.upsert_object(obj("small", 40 * KIB, pod="p2"), 0.0)  # fits exactly beside the first
    book = ledger.quota
    assert book.used == {"team-a": 100 * KIB}
    assert book.refusal(ledger.objects[("team-a", "first")]) is None
    why = book.refusal(ledger.objects[("team-a", "second")])
    assert why is not None and "team-a" in why and "quota of 102400 bytes" in why and "61440 held" in why
    assert book.refusals == {"team-a": 1}


def test_another_namespace_and_a_namespace_without_a_quota_are_unaffected() -> None:
    ledger = ledger_with({"team-a": 10 * KIB})
    ledger.upsert_object(obj("a", 10 * KIB), 0.0)
    ledger.upsert_object(obj("b", 10 * KIB, ns="team-b"), 0.0)
    ledger.upsert_object(obj("c", 1 << 30, ns="team-b"), 0.0)
    assert ledger.quota.used == {"team-a": 10 * KIB, "team-b": 10 * KIB + (1 << 30)}
    assert not any(ledger.quota.refusal(o) for o in ledger.objects.values())


def test_the_default_quota_applies_to_namespaces_not_listed() -> None:
    ledger = ledger_with({"big": 1 << 30}, 10 * KIB)
    ledger.upsert_object(obj("x", 20 * KIB, ns="big"), 0.0)
    ledger.upsert_object(obj("y", 20 * KIB, ns="other"), 0.0)
    assert ledger.quota.refusal(ledger.objects[("big", "x")]) is None
    assert ledger.quota.refusal(ledger.objects[("other", "y")]) is not None


def test_bytes_count_until_the_record_is_gone_then_the_quota_admits_again() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    first = obj("first", 80 * KIB)
    ledger.upsert_object(first, 0.0)
    deleting = dataclasses.replace(first, deleting=True, resource_version="2")
    ledger.upsert_object(deleting, 0.0)
    assert ledger.quota.used == {"team-a": 80 * KIB}, "a deleted object's bytes are held until its free"
    ledger.remove_object(deleting)
    assert ledger.quota.used == {}, "nothing held: no series left behind"
    ledger.upsert_object(obj("next", 80 * KIB), 0.0)
    assert ledger.quota.refusal(ledger.objects[("team-a", "next")]) is None


def test_a_refused_object_is_not_counted_stays_refused_and_its_name_can_be_reused() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    ledger.upsert_object(obj("first", 80 * KIB), 0.0)
    refused = obj("second", 80 * KIB)
    ledger.upsert_object(refused, 0.0)
    ledger.remove_object(ledger.objects[("team-a", "first")])
    ledger.upsert_object(dataclasses.replace(refused, resource_version="3"), 0.0)
    assert ledger.quota.refusal(ledger.objects[("team-a", "second")]) is not None, "refused for good"
    assert ledger.quota.used == {}
    ledger.remove_object(refused)
    ledger.upsert_object(obj("second", 80 * KIB, uid="uid-second-2"), 0.0)
    assert ledger.quota.refusal(ledger.objects[("team-a", "second")]) is None
    assert ledger.quota.used == {"team-a": 80 * KIB}


def test_objects_admitted_before_are_kept_after_a_restart_even_over_a_lowered_quota() -> None:
    ledger = ledger_with({"team-a": 10 * KIB})  # a fresh operator (a new ledger) with a lowered quota
    ledger.upsert_object(obj("ready", 50 * KIB, status=crd.GPUObjectStatus(state=names.STATE_READY)), 0.0)
    ledger.upsert_object(obj("going", 50 * KIB, deleting=True), 0.0)
    refused_status = crd.GPUObjectStatus.from_json(
        {
            "state": names.STATE_FAILED,
            "conditions": [
                {
                    "type": names.CONDITION_READY,
                    "status": "False",
                    "reason": "QuotaExceeded",
                    "message": "x",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        }
    )
    ledger.upsert_object(obj("refused", 50 * KIB, status=refused_status, deleting=True), 0.0)
    ledger.upsert_object(obj("new", 1), 0.0)
    book = ledger.quota
    assert book.used == {"team-a": 100 * KIB}
    assert book.refusal(ledger.objects[("team-a", "ready")]) is None
    assert book.refusal(ledger.objects[("team-a", "going")]) is None
    assert book.refusal(ledger.objects[("team-a", "refused")]) == "x", "a refusal outlives an operator restart"
    assert book.refusal(ledger.objects[("team-a", "new")]) is not None


def test_a_failed_declared_object_holds_no_bytes() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    declared = obj("d", 80 * KIB, spec_object_id=None)
    ledger.upsert_object(declared, 0.0)
    assert ledger.quota.used == {"team-a": 80 * KIB}, "reserved before it is materialized"
    failed = dataclasses.replace(declared, status=crd.GPUObjectStatus(state=names.STATE_FAILED), resource_version="2")
    ledger.upsert_object(failed, 0.0)
    assert ledger.quota.used == {}


def test_without_quotas_nothing_is_ever_refused() -> None:
    ledger = ledger_with({})
    ledger.upsert_object(obj("huge", 1 << 40), 0.0)
    assert ledger.quota.refusal(ledger.objects[("team-a", "huge")]) is None


# ---------------------------------------------------------------- the decisions


def test_a_refused_put_is_failed_announced_and_deleted_with_its_claims() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    ledger.upsert_object(obj("first", 80 * KIB), 0.0)
    ledger.upsert_object(obj("second", 80 * KIB), 0.0)
    ledger.upsert_claim(ClaimInfo("team-a", "c", "uid-c", object_name="second", holder_pod="p1"), 0.0)
    assert decide_object(ledger, ("team-a", "first"), NOW) == [] or all(
        not isinstance(a, DeleteObject) for a in decide_object(ledger, ("team-a", "first"), NOW)
    )
    actions = decide_object(ledger, ("team-a", "second"), NOW)
    patch = next(a for a in actions if isinstance(a, PatchObjectStatus))
    assert patch.status["state"] == names.STATE_FAILED
    ready = next(c for c in patch.status["conditions"] if c["type"] == names.CONDITION_READY)
    assert ready["reason"] == "QuotaExceeded" and "quota" in ready["message"]
    assert patch.status["bytes"] == 80 * KIB
    assert any(isinstance(a, Emit) and a.reason == "QuotaExceeded" and a.type == "Warning" for a in actions)
    assert [a.key for a in actions if isinstance(a, DeleteClaim)] == [("team-a", "c")]
    assert [a.reason for a in actions if isinstance(a, DeleteObject)] == ["QuotaExceeded"]


def test_once_deleted_a_refused_put_is_freed_at_its_source_even_if_a_claim_came_late() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    ledger.upsert_object(obj("first", 80 * KIB), 0.0)
    second = obj("second", 80 * KIB)
    ledger.upsert_object(second, 0.0)
    failed = crd.GPUObjectStatus(state=names.STATE_FAILED)
    ledger.upsert_object(dataclasses.replace(second, status=failed, deleting=True, resource_version="5"), 0.0)
    ledger.upsert_claim(ClaimInfo("team-a", "late", "uid-late", object_name="second", holder_pod="p1"), 0.0)
    assert [type(a) for a in decide_object(ledger, ("team-a", "second"), NOW)] == [DeleteClaim]
    ledger.remove_claim(ledger.claims[("team-a", "late")], 0.0)
    (free,) = decide_object(ledger, ("team-a", "second"), NOW)
    assert isinstance(free, Free) and free.reason == "QuotaExceeded" and free.bytes == 80 * KIB


def test_a_refused_declared_object_is_failed_and_never_materialized() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    declared = obj("d", 200 * KIB, spec_object_id=None)
    ledger.upsert_object(declared, 0.0)
    actions = decide_object(ledger, declared.key, NOW)
    assert not any(isinstance(a, Materialize | DeleteObject) for a in actions)
    assert any(isinstance(a, PatchObjectStatus) and a.status["state"] == names.STATE_FAILED for a in actions)
    failed = crd.GPUObjectStatus.from_json(actions[0].status)  # type: ignore[attr-defined]
    ledger.upsert_object(dataclasses.replace(declared, status=failed, resource_version="2"), 0.0)
    assert decide_object(ledger, declared.key, NOW) == [], "Failed for good: no second Event, no materialize"


def test_an_admitted_declared_object_is_materialized() -> None:
    ledger = ledger_with({"team-a": 100 * KIB})
    declared = obj("d", 100 * KIB, spec_object_id=None)
    ledger.upsert_object(declared, 0.0)
    assert [type(a) for a in decide_object(ledger, declared.key, NOW)] == [Materialize]


# ---------------------------------------------------------------- the metrics


def test_quota_used_and_refusals_are_exported_per_namespace() -> None:
    ledger = ledger_with({"team-a": 100 * KIB, "idle": 5 * KIB})
    ledger.upsert_object(obj("first", 80 * KIB), 0.0)
    ledger.upsert_object(obj("second", 80 * KIB), 0.0)
    ledger.upsert_object(obj("b", 7, ns="team-b"), 0.0)
    text = generate_latest(OperatorMetrics(lambda: ledger).registry).decode()
    assert 'gpuobj_namespace_quota_bytes{namespace="team-a"} 102400.0' in text
    assert 'gpuobj_namespace_quota_bytes{namespace="idle"} 5120.0' in text
    assert 'gpuobj_namespace_quota_bytes{namespace="team-b"}' not in text, "no quota set there"
    assert 'gpuobj_namespace_used_bytes{namespace="team-a"} 81920.0' in text
    assert 'gpuobj_namespace_used_bytes{namespace="idle"} 0.0' in text
    assert 'gpuobj_namespace_used_bytes{namespace="team-b"} 7.0' in text
    assert 'gpuobj_quota_refusals_total{namespace="team-a"} 1.0' in text
    assert 'gpuobj_quota_refusals_total{namespace="team-b"} 0.0' in text
