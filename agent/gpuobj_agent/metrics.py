"""Prometheus metrics of one agent; names come only from `gpuobj_contract.metric_names`.

Why a registry per agent: tests and benchmarks run several agents in one process, and
each /metrics must describe its own. Levels (store bytes, registered bytes, in-flight
reads, quarantine) are read from the store at scrape time, so they can never drift from
the truth; events (frees, transfers, errors) are counted where they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuobj_contract import metric_names as mn

# Every kind the agent counts under gpuobj_agent_errors_total, so each series exists from the start at 0.
ERROR_KINDS = (
    "internal",  # a bug: a request failed with a 500
    "free_timeout",  # reads did not finish within the free wait bound (503)
    "nixl_register",
    "nixl_deregister",
    "nixl_notifications",
    "nixl_agent_create",
    "nixl_agent_destroy",
    "fencer",
    "fetch_transfer",
    "fetch_lease_expired",
)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Levels:
    """A snapshot of the store's levels, taken at scrape time."""

    store_bytes: dict[str, int] = field(default_factory=dict)  # by device
    store_objects: int = 0
    registered_bytes: int = 0
    inflight_reads: int = 0
    quarantined_bytes: int = 0
    generations: dict[str, int] = field(default_factory=dict)  # by state


class _LevelsCollector(Collector):
    def __init__(self, snapshot: Callable[[], Levels]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families(Levels())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(self._snapshot())

    @staticmethod
    def _families(levels: Levels) -> Iterator[GaugeMetricFamily]:
        store = GaugeMetricFamily(mn.AGENT_STORE_BYTES, "Bytes held by the object store", labels=["device"])
        for device, value in sorted(levels.store_bytes.items()):
            store.add_metric([device], value)
        yield store
        yield GaugeMetricFamily(mn.AGENT_STORE_OBJECTS, "Objects held by the object store", value=levels.store_objects)
        yield GaugeMetricFamily(
            mn.AGENT_NIXL_REGISTERED_BYTES, "Bytes registered with NIXL for remote reads", value=levels.registered_bytes
        )
        yield GaugeMetricFamily(mn.AGENT_INFLIGHT_READS, "Read tickets in flight", value=levels.inflight_reads)
        yield GaugeMetricFamily(
            mn.AGENT_QUARANTINED_BYTES,
            "Freed bytes held until the NIXL agent that exposed them is destroyed",
            value=levels.quarantined_bytes,
        )
        gens = GaugeMetricFamily(mn.AGENT_NIXL_GENERATIONS, "NIXL agents alive, by state", labels=["state"])
        for state, value in sorted(levels.generations.items()):
            gens.add_metric([state], value)
        yield gens


class AgentMetrics:
    """The agent's metric families on a private registry."""

    def __init__(self, snapshot: Callable[[], Levels]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.registrations = Counter(
            mn.AGENT_NIXL_REGISTRATIONS, "NIXL memory registrations and deregistrations", ["op"], registry=r
        )
        self.transfer_bytes = Counter(
            mn.AGENT_TRANSFER_BYTES,
            "Bytes moved by NIXL reads (in: fetched here, out: read from here under a ticket)",
            ["direction"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            mn.AGENT_TRANSFER_SECONDS,
            "Duration of reads (in: whole fetch, out: ticket issued to ended)",
            ["direction"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.frees = Counter(mn.AGENT_FREES, "Free requests by result", ["result"], registry=r)
        self.free_wait = Histogram(
            mn.AGENT_FREE_WAIT_SECONDS, "Time a free waited for in-flight reads", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.free_seconds = Histogram(
            mn.AGENT_FREE_SECONDS, "Time to serve one free request", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.errors = Counter(mn.AGENT_ERRORS, "Errors by kind", ["kind"], registry=r)
        self.quarantine_seconds = Histogram(
            mn.AGENT_QUARANTINE_SECONDS,
            "Time from a free to the release of its memory (fence latency)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rotations = Counter(mn.AGENT_NIXL_ROTATIONS, "NIXL agents replaced to fence stale readers", registry=r)
        self.migrations = Counter(mn.AGENT_MIGRATIONS, "Live objects re-registered in a newer NIXL agent", registry=r)
        self.tickets = Counter(mn.AGENT_READ_TICKETS, "Read tickets by outcome", ["result"], registry=r)
        r.register(_LevelsCollector(snapshot))
        # Pre-create the labelled series a dashboard queries, so they exist at zero.
        for op in ("register", "deregister"):
            self.registrations.labels(op=op)
        for result in ("freed", "noop"):
            self.frees.labels(result=result)
        for direction in ("in", "out"):
            self.transfer_bytes.labels(direction=direction)
        for result in ("issued", "ended", "expired"):
            self.tickets.labels(result=result)
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)

    def error(self, kind: str) -> None:
        assert kind in ERROR_KINDS, kind
        self.errors.labels(kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
