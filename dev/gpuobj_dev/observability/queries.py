"""PromQL shared by the dashboard and the alert rules, built from gpuobj_contract.metric_names.

Why: a panel that shows a leak and the alert that pages on it must compute the same
number; one expression, two consumers. Labels follow gpuobj_dev.observability.scrape:
plain ``namespace``/``pod``, never ``exported_*``.
"""

from __future__ import annotations

import re

from gpuobj_contract import metric_names as m

# Grafana's own interval macros; Prometheus does not know them (see ``for_prometheus``).
GRAFANA_MACROS = ("$__rate_interval", "$__interval", "$__range")

# The identity of one agent: the pod Kubernetes scraped (target labels) and its address.
AGENT_LABELS = "namespace, pod, instance"

# Several operator replicas may briefly export the same leak (handover): max, not sum.
LEAKED_BY_POD = f"max by (namespace, pod) ({m.LEAKED_BYTES})"
LEAKED_TOTAL = f"sum({LEAKED_BY_POD}) or vector(0)"
# Bytes held by claims over an hour old (a hung reader without a ttl shows here), per namespace; max: the
# same ledger's series from several operator replicas count once.
CLAIM_HELD_OVER_1H = f'max by (namespace) ({m.CLAIM_HELD_BYTES}{{age="over_1h"}})'

AGENT_REGISTERED = f"sum by ({AGENT_LABELS}) ({m.AGENT_NIXL_REGISTERED_BYTES})"
AGENT_STORED = f"sum by ({AGENT_LABELS}) ({m.AGENT_STORE_BYTES})"
# An agent that stores nothing may export no store series at all: compare against zero then.
AGENT_REGISTERED_NOT_STORED = f"{AGENT_REGISTERED} - ({AGENT_STORED} or {AGENT_REGISTERED} * 0)"


def rate(counter: str, by: str = "", window: str = "$__rate_interval") -> str:
    """``sum [by (...)] (rate(counter[window]))``: per-second rate of a counter, aggregated."""
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({counter}[{window}]))"


def quantile(q: float, histogram: str, by: str = "", window: str = "$__rate_interval") -> str:
    """``histogram_quantile`` over the rate of a histogram's ``_bucket`` series."""
    grouping = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({grouping}) (rate({histogram}_bucket[{window}])))"


def for_prometheus(expr: str, rate_interval: str = "1m", interval: str = "15s", range_: str = "1h") -> str:
    """Replace Grafana's macros so an expression runs against Prometheus' HTTP API directly."""
    values = {"$__rate_interval": rate_interval, "$__interval": interval, "$__range": range_}
    return re.sub(r"\$__(rate_interval|interval|range)\b", lambda mt: values[mt.group(0)], expr)


def referenced_metrics(expr: str) -> set[str]:
    """Metric names an expression reads, with histogram ``_bucket``/``_sum``/``_count`` folded back."""
    names = set()
    for name in re.findall(r"\b(gpuobj_[a-z0-9_]+)\b", expr):
        names.add(re.sub(r"_(bucket|sum|count)$", "", name) if name.endswith(("_bucket", "_sum", "_count")) else name)
    return names
