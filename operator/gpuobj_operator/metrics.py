"""Operator metrics. Names come from gpuobj_contract.metric_names (the dashboard's contract).

State gauges are read from the ledger at scrape time (KubeRay's collector habit), so
they can never drift from what the operator believes; leaked-bytes series are removed
when their pod goes away.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuobj_contract import metric_names as m
from gpuobj_operator.claim_ttl import AGE_BUCKETS, age_bucket
from gpuobj_operator.ledger import Ledger

FREE_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LedgerCollector(Collector):
    def __init__(self, ledger: Callable[[], Ledger]) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ledger = self._ledger()
        objects = GaugeMetricFamily(m.OBJECTS, "GPUObjects by state", labels=["state"])
        sizes = GaugeMetricFamily(m.OBJECT_BYTES, "Bytes of GPUObjects by state", labels=["state"])
        for state, (count, size) in sorted(ledger.objects_by_state().items()):
            objects.add_metric([state], count)
            sizes.add_metric([state], size)
        claims = GaugeMetricFamily(m.CLAIMS, "GPUObjectClaims")
        claims.add_metric([], len(ledger.claims))
        yield objects
        yield sizes
        yield claims
        yield from claim_age_families(ledger, dt.datetime.now(dt.UTC))
        yield from _quota_families(ledger)


def claim_age_families(ledger: Ledger, now: dt.datetime) -> Iterator[GaugeMetricFamily]:
    """Per namespace: the age of its oldest live claim, and the bytes its claims hold by the age of each
    object's oldest claim (a hung reader without a ttl shows as bytes moving to over_1h). O(claims) at a
    scrape; every namespace the operator knows (its pods, objects, claims, a default ttl) gets its series,
    0 when nothing is held, so the panels and the alert read 0 rather than nothing."""
    known = {ns for ns, _ in ledger.pods} | {ns for ns, _ in ledger.objects} | set(ledger.claim_ttl.namespaces)
    oldest_age: dict[str, float] = dict.fromkeys(known, 0.0)
    oldest_claim: dict[tuple[str, str], dt.datetime] = {}  # object key -> its oldest claim's creation
    for claim in ledger.claims.values():
        oldest_age.setdefault(claim.namespace, 0.0)
        if claim.deleting:
            continue
        created = claim.created or now  # unknown: just seen
        oldest_age[claim.namespace] = max(oldest_age[claim.namespace], (now - created).total_seconds())
        obj = ledger.objects.get(claim.object_key)
        if obj is not None and (not claim.object_uid or claim.object_uid == obj.uid):  # holds these bytes
            oldest_claim[claim.object_key] = min(oldest_claim.get(claim.object_key, created), created)
    held = {(ns, label): 0 for ns in oldest_age for _, label in AGE_BUCKETS}
    for key, created in oldest_claim.items():
        held[(key[0], age_bucket(created, now))] += ledger.objects[key].bytes
    oldest = GaugeMetricFamily(
        m.CLAIM_OLDEST_AGE, "Age of the namespace's oldest live GPUObjectClaim (0: none)", labels=["namespace"]
    )
    for namespace, age in sorted(oldest_age.items()):
        oldest.add_metric([namespace], age)
    sizes = GaugeMetricFamily(
        m.CLAIM_HELD_BYTES,
        "Bytes of GPUObjects that claims hold, by the age of each object's oldest claim",
        labels=["namespace", "age"],
    )
    for (namespace, label), size in sorted(held.items()):
        sizes.add_metric([namespace, label], size)
    yield oldest
    yield sizes


def _quota_families(ledger: Ledger) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per namespace: its quota, what it holds and what was refused (quota.py's running sums, O(namespaces))."""
    book = ledger.quota
    quota = GaugeMetricFamily(m.NAMESPACE_QUOTA_BYTES, "Byte quota of the namespace's GPUObjects", labels=["namespace"])
    used = GaugeMetricFamily(
        m.NAMESPACE_USED_BYTES,
        "Bytes of the namespace's admitted GPUObjects (counted against its quota)",
        labels=["namespace"],
    )
    refused = CounterMetricFamily(
        m.QUOTA_REFUSALS.removesuffix("_total"), "GPUObjects refused over their namespace's quota", labels=["namespace"]
    )
    for namespace in sorted(set(book.limits.namespaces) | set(book.used) | set(book.refusals)):
        limit = book.limits.limit(namespace)
        if limit is not None:
            quota.add_metric([namespace], limit)
        used.add_metric([namespace], book.used.get(namespace, 0))
        refused.add_metric([namespace], book.refusals.get(namespace, 0))
    yield quota
    yield used
    yield refused


class OperatorMetrics:
    def __init__(self, ledger: Callable[[], Ledger], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        r.register(LedgerCollector(ledger))
        self.leaked_bytes = Gauge(
            m.LEAKED_BYTES, "Bytes agents hold that nothing references", ["namespace", "pod"], registry=r
        )
        self.dead_holder_bytes = Gauge(
            m.DEAD_HOLDER_BYTES,
            "Leaked bytes (part of gpuobj_leaked_bytes) held only by claims whose holder process or pod is gone",
            ["namespace", "pod"],
            registry=r,
        )
        self.claims_dropped = Counter(
            m.CLAIMS_DROPPED.removesuffix("_total"),
            "Claims the operator deleted: holder pod or agent process gone, or TTL expired",
            ["holder"],
            registry=r,
        )
        self.reclaimed_bytes = Counter(
            m.RECLAIMED_BYTES.removesuffix("_total"), "Leaked bytes reclaimed by the audit", ["namespace"], registry=r
        )
        self.free_latency = Histogram(
            m.FREE_LATENCY,
            "From the last reference gone to the agent's free acknowledgement",
            buckets=FREE_LATENCY_BUCKETS,
            registry=r,
        )
        self.frees = Counter(m.FREES.removesuffix("_total"), "Frees completed, by result", ["result"], registry=r)
        self.free_failures = Counter(
            m.FREE_FAILURES.removesuffix("_total"), "Free attempts that failed", ["reason"], registry=r
        )
        self.claims_checks = Counter(
            m.CLAIMS_CHECKS.removesuffix("_total"),
            "How a free knew every claim up to the object's deletion: its claims watch had passed it (ledger), "
            "had passed it after a write to the progress marker (marker), or a read of the claims (read)",
            ["how"],
            registry=r,
        )
        self.claims_marker_writes = Counter(
            m.CLAIMS_MARKER_WRITES.removesuffix("_total"),
            "Writes to the claims progress marker, each moving the claims watch past every free waiting then",
            ["result"],
            registry=r,
        )
        self.lost = Counter(
            m.LOST_OBJECTS.removesuffix("_total"), "GPUObjects that became Lost (source gone first)", registry=r
        )
        self.audits = Counter(m.AUDIT_RUNS.removesuffix("_total"), "Agent inventory audits", ["result"], registry=r)
        self.leader = Gauge(m.OPERATOR_LEADER, "1 while this replica holds the leader lease", registry=r)
        self.watch_events = Counter(
            m.WATCH_EVENTS.removesuffix("_total"),
            "Events the API server sent the GPUObject and stream watches: a shard's selection is what it is sent",
            ["resource", "selection"],
            registry=r,
        )
        self._leak_series: set[tuple[str, str]] = set()
        self._namespaces: set[str] = set()
        # Known label values start at 0, so rate() and increase() see their first step.
        for result in ("freed", "noop", "agent-gone", "source-lost"):
            self.frees.labels(result)
        self.free_failures.labels("unreachable")
        for holder in ("pod", "process", "ttl", "quota"):
            self.claims_dropped.labels(holder)
        for result in ("ok", "error"):
            self.audits.labels(result)
        for how in ("ledger", "marker", "read"):
            self.claims_checks.labels(how)
        for result in ("written", "failed"):
            self.claims_marker_writes.labels(result)

    def saw_namespace(self, namespace: str) -> None:
        """Start the namespace's reclaimed-bytes counter at 0 when its first agent is audited."""
        if namespace not in self._namespaces:
            self._namespaces.add(namespace)
            self.reclaimed_bytes.labels(namespace)

    def set_leaked(
        self, values: dict[tuple[str, str], int], dead_holder: dict[tuple[str, str], int] | None = None
    ) -> None:
        """Replace the leaked-bytes series: pods that disappeared lose their series.

        ``dead_holder``: the part of ``values`` held only by claims of gone holders (same pods)."""
        for labels in self._leak_series - set(values):
            self.leaked_bytes.remove(*labels)
            self.dead_holder_bytes.remove(*labels)
        for labels, value in values.items():
            self.leaked_bytes.labels(*labels).set(value)
            self.dead_holder_bytes.labels(*labels).set((dead_holder or {}).get(labels, 0))
        self._leak_series = set(values)
