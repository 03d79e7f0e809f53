"""Count the API server's requests (its own apiserver_request_total), by verb and resource.

Why from the server: it counts what really reached it from every client (workloads, the
operator, kube-controller-manager), which is what "API writes per cycle" means.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from gpuobj_dev.testing.cluster import ClusterHandle

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE"})


def request_counts(cluster: ClusterHandle, resources: set[str] | None = None) -> Counter[tuple[str, str]]:
    """(verb, resource) -> requests so far, for gpuobj's resources unless `resources` says otherwise."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    wanted = resources or {"gpuobjects", "gpuobjectclaims", "gpuobjectstreams", "events", "pods"}
    counts: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name != "apiserver_request_total":
                continue
            resource = s.labels.get("resource", "")
            if resource in wanted:
                counts[(s.labels.get("verb", ""), resource)] += int(s.value)
    return counts


def delta(after: Counter[tuple[str, str]], before: Counter[tuple[str, str]]) -> Counter[tuple[str, str]]:
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0})


def writes(counts: Counter[tuple[str, str]]) -> int:
    return sum(n for (verb, _), n in counts.items() if verb.upper() in WRITE_VERBS)
