"""A namespace's default claim ttl and the claim-age gauges (issue 32: a hung reader pins bytes invisibly).

The same code runs for real in tests/e2e/operator/test_claim_ttl.py (operator, agents, API server).
"""

from __future__ import annotations

import datetime as dt
from types import MappingProxyType

import pytest

from gpuobj_operator.actions import DeleteClaim, Requeue
from gpuobj_operator.claim_ttl import ClaimTTLDefaults, age_bucket, parse_duration, parse_namespace_claim_ttl
from gpuobj_operator.decisions import decide_claim
from gpuobj_operator.flags import build_parser, settings_from
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import claim_age_families
from gpuobj_operator.model import ClaimInfo, ObjectInfo, PodInfo

NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)
DEFAULTS = ClaimTTLDefaults(MappingProxyType({"team-a": 600}))


def claim(name: str = "c1", *, ns: str = "team-a", obj: str = "w", age: float = 0.0, **kw) -> ClaimInfo:
    return ClaimInfo(ns, name, f"uid-{name}", obj, created=NOW - dt.timedelta(seconds=age), **kw)


def ledger_with(*claims: ClaimInfo) -> Ledger:
    ledger = Ledger(claim_ttl=DEFAULTS)
    for ns in ("team-a", "team-b"):
        ledger.upsert_pod(PodInfo(ns, "src", f"uid-src-{ns}", "Running", "10.0.0.1:8471"))
        ledger.upsert_object(
            ObjectInfo(ns, "w", f"uid-w-{ns}", "src", [{"shape": [1000], "dtype": "uint8"}], spec_object_id="o"),
            0.0,
        )
    for c in claims:
        ledger.upsert_claim(c, now=0.0)
    ledger.synced = True
    return ledger


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600), ("2h", 7200)])
def test_durations_parse(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "10d", "ten", "team-a"])
def test_bad_durations_and_flags_are_refused_with_the_form_expected(text: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_namespace_claim_ttl(f"team-a={text}" if text != "team-a" else text)


def test_the_effective_ttl_is_the_claims_own_else_its_namespaces_default() -> None:
    assert DEFAULTS.effective(claim(ttl_seconds=30)) == 30
    assert DEFAULTS.effective(claim()) == 600
    assert DEFAULTS.effective(claim(ns="team-b")) is None


def test_a_claim_without_ttl_expires_at_its_namespaces_default() -> None:
    young = ledger_with(claim(age=60))
    assert [a for a in decide_claim(young, ("team-a", "c1"), NOW) if isinstance(a, Requeue)] == [
        Requeue("claim", ("team-a", "c1"), 540.0)
    ]
    old = ledger_with(claim(age=601))
    [drop] = decide_claim(old, ("team-a", "c1"), NOW)
    assert isinstance(drop, DeleteClaim) and drop.holder == "ttl" and "600s" in drop.reason
    elsewhere = ledger_with(claim(ns="team-b", age=10_000))
    assert not any(isinstance(a, (DeleteClaim, Requeue)) for a in decide_claim(elsewhere, ("team-b", "c1"), NOW))


def test_the_flag_sets_the_default_per_namespace() -> None:
    args = build_parser().parse_args(["--namespace-claim-ttl", "team-a=10m", "--namespace-claim-ttl", "b=30s"])
    assert dict(settings_from(args).claim_ttl.namespaces) == {"team-a": 600, "b": 30}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--namespace-claim-ttl", "team-a"])


def test_age_buckets() -> None:
    assert [age_bucket(NOW - dt.timedelta(seconds=s), NOW) for s in (0, 599, 600, 3599, 3600)] == [
        "under_10m",
        "under_10m",
        "10m_to_1h",
        "10m_to_1h",
        "over_1h",
    ]
    assert age_bucket(None, NOW) == "under_10m"


def test_the_gauges_show_the_oldest_claim_and_the_bytes_it_holds_per_namespace() -> None:
    ledger = ledger_with(
        claim("young", age=5),
        claim("hung", age=7200),
        claim("b", ns="team-b", age=900),
        claim("other", ns="team-b", age=9000, object_uid="an-earlier-incarnation"),  # holds no bytes of it
    )
    oldest, held = claim_age_families(ledger, NOW)
    ages = {s.labels["namespace"]: s.value for s in oldest.samples}
    assert ages == {"team-a": 7200.0, "team-b": 9000.0}
    sizes = {(s.labels["namespace"], s.labels["age"]): s.value for s in held.samples}
    # One object per namespace, counted once, in the bucket of its oldest claim; every bucket has a series.
    assert sizes == {
        ("team-a", "under_10m"): 0,
        ("team-a", "10m_to_1h"): 0,
        ("team-a", "over_1h"): 1000,
        ("team-b", "under_10m"): 0,
        ("team-b", "10m_to_1h"): 1000,
        ("team-b", "over_1h"): 0,
    }


def test_a_namespace_without_claims_reads_zero() -> None:
    ledger = Ledger(claim_ttl=DEFAULTS)
    ledger.upsert_pod(PodInfo("team-b", "src", "uid-src", "Running", "10.0.0.1:8471"))
    oldest, held = claim_age_families(ledger, NOW)
    assert {s.labels["namespace"]: s.value for s in oldest.samples} == {"team-a": 0.0, "team-b": 0.0}
    assert {s.value for s in held.samples} == {0} and len(held.samples) == 6
