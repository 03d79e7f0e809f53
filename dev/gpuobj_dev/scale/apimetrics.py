"""The API server's own figures, scraped from its /metrics: mutating latency p99 and request counts.

Why the API server's: `apiserver_request_duration_seconds` is every mutating call's latency as its client
saw it (the p99 the bench judges against 1 s), `apiserver_request_total` counts every client's requests,
the operator's, the fleet's and kwok's alike. Two more families say where a slow write waited:
`apiserver_request_sli_duration_seconds` is the same latency without the time queued in API Priority and
Fairness (and in webhooks): what SIG-scalability's API-call latency SLO is measured on since Kubernetes
1.27. `apiserver_flowcontrol_request_wait_duration_seconds` is that queued time, per priority level: a
flood queues in its own level, and other levels' waits show whether it slowed anyone else. Scraping is
measurement, not workload: it uses the admin client. Only these families are parsed (the full text is
several MB).
"""

from __future__ import annotations

import re
import ssl
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuobj_dev.testing.cluster import ClusterHandle

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY"})
# What an object's life makes the cluster write, whoever writes it (client, operator): gpuobj.io resources
# (objects, claims, their statuses, streams) and Events. Not leases, pods or nodes: those are written
# whether objects exist or not (kwok's heartbeats, the operator's Lease).
OBJECT_GROUPS = frozenset({"gpuobj.io"})
OBJECT_RESOURCES = frozenset({"events"})
_SAMPLE = re.compile(
    r"^(apiserver_request_duration_seconds_bucket|apiserver_request_sli_duration_seconds_bucket|apiserver_request_total"
    r"|apiserver_flowcontrol_request_wait_duration_seconds_bucket)\{([^}]*)\} (\S+)$"
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class ApiSnapshot:
    """Cumulative counts at one instant; subtract two to get a window."""

    buckets: dict[float, float] = field(default_factory=dict)  # mutating requests with latency <= le
    requests: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (verb, group, resource[/sub]) -> count
    object_codes: dict[str, float] = field(default_factory=dict)  # object writes (see object_writes) by answer code
    # object writes by "VERB resource code" (code as the API server answered: 201, 409, 429, 504...)
    object_answers: dict[str, float] = field(default_factory=dict)
    # mutating latency buckets by "VERB resource[/sub]": which writes make a phase's p99
    buckets_by_resource: dict[str, dict[float, float]] = field(default_factory=dict)
    # mutating latency without the time queued in API Priority and Fairness (the SLO's SLI)
    sli_buckets: dict[float, float] = field(default_factory=dict)
    # time requests waited in API Priority and Fairness queues, by priority level (reads and writes)
    apf_wait: dict[str, dict[float, float]] = field(default_factory=dict)

    def minus(self, earlier: ApiSnapshot) -> ApiSnapshot:
        return ApiSnapshot(
            {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            {k: n - earlier.requests.get(k, 0.0) for k, n in self.requests.items()},
            {c: n - earlier.object_codes.get(c, 0.0) for c, n in self.object_codes.items()},
            {a: n - earlier.object_answers.get(a, 0.0) for a, n in self.object_answers.items()},
            {
                r: {le: n - earlier.buckets_by_resource.get(r, {}).get(le, 0.0) for le, n in b.items()}
                for r, b in self.buckets_by_resource.items()
            },
            {le: n - earlier.sli_buckets.get(le, 0.0) for le, n in self.sli_buckets.items()},
            {
                lv: {le: n - earlier.apf_wait.get(lv, {}).get(le, 0.0) for le, n in b.items()}
                for lv, b in self.apf_wait.items()
            },
        )

    def mutating_sli_p99(self) -> float | None:
        """The mutating p99 without APF queueing: what the API server took once it began serving a write."""
        return quantile(self.sli_buckets, 0.99)

    def apf_wait_p99_by_level(self) -> dict[str, tuple[float, float | None]]:
        """Priority level -> (requests, p99 of their time queued), most requests first: who waited, and where."""
        out = {lv: (b.get(float("inf"), 0.0), quantile(b, 0.99)) for lv, b in self.apf_wait.items()}
        return dict(sorted(((lv, v) for lv, v in out.items() if v[0] > 0), key=lambda kv: -kv[1][0]))

    def mutating_p99_by_resource(self) -> dict[str, tuple[float, float | None]]:
        """ "VERB resource" -> (requests, their p99), most requests first: whose writes were slow."""
        out = {r: (b.get(float("inf"), 0.0), quantile(b, 0.99)) for r, b in self.buckets_by_resource.items()}
        return dict(sorted(((r, v) for r, v in out.items() if v[0] > 0), key=lambda kv: -kv[1][0]))

    def object_writes_by_answer(self) -> dict[str, float]:
        """`object_writes` by "VERB resource code", largest first: which answers a write's resends got (a 429
        from a full priority-level queue, a 504 time-out, a 409 or 404 for a resend whose first try landed)."""
        return dict(sorted(((a, n) for a, n in self.object_answers.items() if n > 0), key=lambda kv: -kv[1]))

    def object_writes_refused(self) -> float:
        """Object writes the API server answered with anything but 2xx (429 when its queues were full, 409,
        5xx, 504 time-outs): requests it served, and a client sent again; part of `object_writes`."""
        return sum(n for code, n in self.object_codes.items() if not code.startswith("2"))

    def mutating_p99(self) -> float | None:
        return quantile(self.buckets, 0.99)

    def writes(self, *, groups: frozenset[str] | None = None, resources: frozenset[str] | None = None) -> float:
        """Mutating requests, optionally only of these API groups or resources."""
        total = 0.0
        for (verb, group, resource), n in self.requests.items():
            if verb not in MUTATING:
                continue
            filtered = groups is not None or resources is not None
            if filtered and not ((groups and group in groups) or (resources and resource.split("/")[0] in resources)):
                continue
            total += n
        return total

    def object_writes(self) -> float:
        """Mutating requests objects cause (OBJECT_GROUPS, OBJECT_RESOURCES): what a write class is charged."""
        return self.writes(groups=OBJECT_GROUPS, resources=OBJECT_RESOURCES)

    def object_writes_by_resource(self) -> dict[str, float]:
        """`object_writes` by "VERB resource", largest first."""
        out: dict[str, float] = {}
        for (verb, group, resource), n in self.requests.items():
            if verb in MUTATING and n > 0 and _is_object(group, resource):
                out[f"{verb} {resource}"] = out.get(f"{verb} {resource}", 0.0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def writes_by_resource(self) -> dict[str, float]:
        """Mutating requests by "VERB resource", largest first: which writes a figure is made of."""
        out: dict[str, float] = {}
        for (verb, _, resource), n in self.requests.items():
            if verb in MUTATING and n > 0:
                out[f"{verb} {resource}"] = out.get(f"{verb} {resource}", 0.0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def reads(self) -> float:
        return sum(n for (verb, _, _), n in self.requests.items() if verb in ("GET", "LIST"))


def _is_object(group: str, resource: str) -> bool:
    return group in OBJECT_GROUPS or resource.split("/")[0] in OBJECT_RESOURCES


def per_object(writes: float, objects: int) -> float | None:
    """Writes charged to each of `objects` (None when there were none to charge)."""
    return writes / objects if objects > 0 else None


def worst(values: Iterable[float | None]) -> float | None:
    """The largest of the figures that exist (a window with no mutating request has no p99)."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear within a bucket)."""
    edges = sorted(buckets)
    if not edges:
        return None
    total = buckets[edges[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_edge, lower_count = 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if edge == float("inf"):
                return lower_edge
            width = count - lower_count
            return lower_edge + (edge - lower_edge) * ((rank - lower_count) / width if width else 1.0)
        lower_edge, lower_count = edge, count
    return edges[-1]


def parse(text: str) -> ApiSnapshot:
    buckets: dict[float, float] = defaultdict(float)
    requests: dict[tuple[str, str, str], float] = defaultdict(float)
    codes: dict[str, float] = defaultdict(float)
    answers: dict[str, float] = defaultdict(float)
    by_resource: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    sli: dict[float, float] = defaultdict(float)
    waits: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for line in text.splitlines():
        if not line.startswith(("apiserver_request_", "apiserver_flowcontrol_request_wait")):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        value = float(m.group(3))
        verb = labels.get("verb", "")
        if m.group(1) == "apiserver_flowcontrol_request_wait_duration_seconds_bucket":
            waits[labels.get("priority_level", "")][float(labels["le"])] += value
        elif m.group(1) == "apiserver_request_sli_duration_seconds_bucket":
            if verb in MUTATING:
                sli[float(labels["le"])] += value
        elif m.group(1) == "apiserver_request_total":
            resource = labels.get("resource", "")
            if labels.get("subresource"):  # gpuobjects/status apart from gpuobjects: who writes which
                resource = f"{resource}/{labels['subresource']}"
            requests[(verb, labels.get("group", ""), resource)] += value
            if verb in MUTATING and _is_object(labels.get("group", ""), resource):
                codes[labels.get("code", "")] += value
                answers[f"{verb} {resource} {labels.get('code', '')}"] += value
        elif verb in MUTATING:
            buckets[float(labels["le"])] += value
            resource = labels.get("resource", "")
            if labels.get("subresource"):
                resource = f"{resource}/{labels['subresource']}"
            by_resource[f"{verb} {resource}"][float(labels["le"])] += value
    return ApiSnapshot(
        dict(buckets),
        dict(requests),
        dict(codes),
        dict(answers),
        {r: dict(b) for r, b in by_resource.items()},
        dict(sli),
        {lv: dict(b) for lv, b in waits.items()},
    )


def scrape(handle: ClusterHandle, timeout: float = 30.0) -> ApiSnapshot:
    pki = handle.cluster.pki
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    ctx.load_cert_chain(str(pki.root / "admin.crt"), str(pki.root / "admin.key"))
    with urllib.request.urlopen(handle.state.server + "/metrics", context=ctx, timeout=timeout) as resp:
        return parse(resp.read().decode())
