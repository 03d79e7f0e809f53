"""The gpuobj leaked-bytes Grafana dashboard, as code (grafana-foundation-sdk).

Why code: every query is built from gpuobj_contract.metric_names, so a renamed metric breaks a
test here instead of a panel in production, and ``panel_queries()`` lets the tests run
every panel's PromQL against a real Prometheus.

    python -m gpuobj_dev.observability.dashboard --write   # regenerate the committed JSON
    python -m gpuobj_dev.observability.dashboard --check   # non-zero if it differs from the code
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.builders.common import (
    GraphThresholdsStyleConfig,
    ReduceDataOptions,
    StackingConfig,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as gc
from grafana_foundation_sdk.models import dashboard as gm
from grafana_foundation_sdk.models import units

from gpuobj_contract import metric_names as m
from gpuobj_dev.observability import generated
from gpuobj_dev.observability import queries as q

OUTPUT = generated.REPO_ROOT / "deploy" / "grafana" / "gpuobj-leaks-dashboard.json"

UID = "gpuobj-leaks"
TITLE = "gpuobj: leaked GPU bytes"
DATASOURCE_VAR = "datasource"
DATASOURCE = gm.DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel and its legend template."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    """What a panel shows and what to do when it is red; ``build_dashboard`` renders it."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    red_at: float | None = None  # values >= red_at are red; None: no threshold
    kind: str = "timeseries"  # or "stat"
    width: int = 8
    height: int = 8
    stack: bool = False
    green_band: tuple[float, float] | None = None  # stat: green inside [lo, hi), red outside


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...] = field(default_factory=tuple)


def rows() -> tuple[RowSpec, ...]:
    """The dashboard's content, top to bottom: leaks first."""
    leaks = RowSpec(
        "Leaked bytes",
        (
            PanelSpec(
                "Leaked bytes by namespace and pod",
                "Bytes that an agent's store holds but no GPUObject or claim references, per pod holding them "
                "(measured by the operator's audit). Red: something leaked. The operator reclaims leaked bytes after "
                "its grace period and posts an Event; if a line stays up, run `kubectl get events -n <namespace> "
                "--field-selector involvedObject.name=<pod>` and `kubectl get gpuobj -n <namespace>`, and check the "
                "'Audit runs' and 'Free failures' panels: reclamation is failing.",
                units.BytesIEC,
                (Query(q.LEAKED_BY_POD, "{{namespace}}/{{pod}}"),),
                red_at=1,
                width=16,
                height=9,
            ),
            PanelSpec(
                "Leaked bytes (total)",
                "All leaked bytes across the cluster now. Red: non-zero; see the panel on the left for the pods.",
                units.BytesIEC,
                (Query(q.LEAKED_TOTAL),),
                red_at=1,
                kind="stat",
                width=4,
                height=9,
            ),
            PanelSpec(
                "Bytes reclaimed in range",
                "Leaked bytes the operator reclaimed during the dashboard's time range. Non-zero means leaks happened "
                "and were cleaned up: look for the 'Reclaimed' Events to find the workload that leaks.",
                units.BytesIEC,
                (Query(f"sum(increase({m.RECLAIMED_BYTES}[$__range])) or vector(0)"),),
                kind="stat",
                width=4,
                height=9,
            ),
            PanelSpec(
                "Reclaimed bytes by namespace",
                "Rate at which the audit reclaims leaked bytes, per namespace of the leaking pod. A steady rate means "
                "a workload keeps leaking (objects dropped without releasing references): fix the workload.",
                units.BytesPerSecondIEC,
                (Query(q.rate(m.RECLAIMED_BYTES, "namespace"), "{{namespace}}"),),
                width=12,
                height=7,
            ),
            PanelSpec(
                "Leaked bytes held by gone holders",
                "The part of the leaked bytes that only claims of a gone holder still reference: the holder's process "
                "died or restarted while its pod stayed, or its pod is gone. The operator drops such claims within "
                "seconds (Event HolderGone); a line that stays up means it cannot reach the API server.",
                units.BytesIEC,
                (Query(f"max by (namespace, pod) ({m.DEAD_HOLDER_BYTES})", "{{namespace}}/{{pod}}"),),
                red_at=1,
                width=6,
                height=7,
            ),
            PanelSpec(
                "Claims dropped",
                "Claims the operator deleted because their holder pod or agent process is gone, or their TTL ran "
                "out (Events HolderGone, Expired). A steady rate of 'process' means containers keep crashing.",
                units.Short,
                (Query(q.rate(m.CLAIMS_DROPPED, "holder"), "{{holder}}"),),
                width=6,
                height=7,
            ),
            PanelSpec(
                "Bytes held by claims, by claim age",
                "Bytes of GPUObjects that claims hold, by the age of each object's oldest claim. Bytes that move to "
                "10m_to_1h and over_1h are held by a reader that has not let go: a hung reader without a ttl keeps "
                "its object Releasing for as long as its process lives. Find it with `kubectl get gclaim -n <ns>` "
                "and give the namespace a default claim ttl (chart value claimTTL.namespaces).",
                units.BytesIEC,
                (Query(f"sum by (namespace, age) ({m.CLAIM_HELD_BYTES})", "{{namespace}} {{age}}"),),
                stack=True,
                width=12,
                height=7,
            ),
            PanelSpec(
                "Oldest claim age",
                "Age of each namespace's oldest live claim (0: none). A line that only grows is a claim nobody "
                "releases; a namespace default claim ttl caps it.",
                units.Seconds,
                (Query(f"max by (namespace) ({m.CLAIM_OLDEST_AGE})", "{{namespace}}"),),
                width=12,
                height=7,
            ),
        ),
    )
    objects = RowSpec(
        "Objects (operator)",
        (
            PanelSpec(
                "Bytes by state",
                "Bytes of GPUObjects by status.state, as the leading operator's ledger sees them. Bytes in Lost or "
                "Freeing that do not drain mean a source pod died or a free is stuck: see 'Free failures'.",
                units.BytesIEC,
                (Query(f"sum by (state) ({m.OBJECT_BYTES})", "{{state}}"),),
                stack=True,
            ),
            PanelSpec(
                "Objects by state",
                "GPUObjects by status.state. A growing count while workloads are steady means references are not "
                "being released: check the claims panel and `kubectl get gclaim -A`.",
                units.Short,
                (Query(f"sum by (state) ({m.OBJECTS})", "{{state}}"),),
                stack=True,
            ),
            PanelSpec(
                "Claims",
                "GPUObjectClaims (references held by pods). Claims are garbage-collected with their pod; a count "
                "that never falls points to pods that keep claims they no longer use.",
                units.Short,
                (Query(f"sum({m.CLAIMS})", "claims"),),
            ),
            PanelSpec(
                "Namespace bytes and quotas",
                "Bytes of each namespace's admitted GPUObjects against the byte quota a platform team set for it "
                "(chart values quota.namespaces, quota.default). A used line at its quota line refuses new puts.",
                units.BytesIEC,
                (
                    Query(f"max by (namespace) ({m.NAMESPACE_USED_BYTES})", "{{namespace}} used"),
                    Query(f"max by (namespace) ({m.NAMESPACE_QUOTA_BYTES})", "{{namespace}} quota"),
                ),
            ),
            PanelSpec(
                "Objects refused over quota",
                "GPUObjects refused per second because their namespace would exceed its byte quota: each is Failed "
                "(reason QuotaExceeded, with an Event) and its bytes freed. Raise the quota or find the namespace "
                "that keeps objects it no longer uses.",
                units.OpsPerSecond,
                (Query(q.rate(m.QUOTA_REFUSALS, "namespace"), "{{namespace}}"),),
            ),
        ),
    )
    frees = RowSpec(
        "Frees",
        (
            PanelSpec(
                "Free latency p50 / p99",
                "From the last reference gone to the source agent's acknowledgement. Targets: p50 < 20 ms, "
                "p99 < 100 ms; red above 100 ms. High latency means agents are slow to answer (in-flight reads, "
                "overloaded pods) or the operator's work queue is backed up.",
                units.Seconds,
                (
                    Query(q.quantile(0.5, m.FREE_LATENCY), "p50"),
                    Query(q.quantile(0.99, m.FREE_LATENCY), "p99"),
                ),
                red_at=0.1,
            ),
            PanelSpec(
                "Frees by result",
                "Frees the operator completed per second, by result (freed, noop: already gone, agent-gone: its pod "
                "died, source-lost). A sudden drop while objects pile up in 'Objects by state' means frees stalled.",
                units.OpsPerSecond,
                (Query(q.rate(m.FREES, "result"), "{{result}}"),),
            ),
            PanelSpec(
                "How frees knew every claim",
                "Per second, how each free learned every claim made before the object's deletion: its in-order claims "
                "watch had passed it (ledger), passed it after a write to the operator's progress marker (marker: "
                "the owner's release went last), or a read of the claims (read: slow on an API server with a claims "
                "watch cache). Marker writes that fail slow frees down to reads; see docs/operator-free-path.md.",
                units.OpsPerSecond,
                (
                    Query(q.rate(m.CLAIMS_CHECKS, "how"), "{{how}}"),
                    Query(q.rate(m.CLAIMS_MARKER_WRITES, "result"), "marker write {{result}}"),
                ),
            ),
            PanelSpec(
                "Free failures by reason",
                "Free attempts that failed per second. Red: frees are failing and bytes stay allocated; the reason "
                "label says why (agent unreachable, auth, ...). Check the source agent's pod and the operator's log.",
                units.OpsPerSecond,
                (Query(q.rate(m.FREE_FAILURES, "reason"), "{{reason}}"),),
                red_at=1e-9,
            ),
            PanelSpec(
                "Objects lost",
                "GPUObjects that became Lost per second because their source pod died. Borrowers see it in their "
                "fetch errors; a steady rate means source pods are crashing.",
                units.OpsPerSecond,
                (Query(q.rate(m.LOST_OBJECTS), "lost"),),
            ),
            PanelSpec(
                "Audit runs by result",
                "Agent inventory audits per second, by result. Leaks are only measured while audits succeed: if this "
                "is zero or shows errors, 'Leaked bytes' is stale.",
                units.OpsPerSecond,
                (Query(q.rate(m.AUDIT_RUNS, "result"), "{{result}}"),),
            ),
            PanelSpec(
                "Watch events by resource and selection",
                "Events the API server sends this operator's watches of GPUObjects and streams per second, by "
                "selection: 'shard' (its own namespaces' label selector), 'unlabelled' (objects no writer labelled, "
                "relabelled at once), 'all' (one shard: no selector). Steady 'unlabelled' traffic means a writer "
                "skips the shard label (docs/scale.md, Several operators).",
                units.OpsPerSecond,
                (Query(q.rate(m.WATCH_EVENTS, "resource, selection"), "{{resource}} {{selection}}"),),
            ),
            PanelSpec(
                "Operator leaders",
                "Operator replicas holding the leader lease. Red unless exactly 1: with no leader nothing is freed or "
                "audited; check the operator Deployment and its Lease.",
                units.Short,
                (Query(f"sum({m.OPERATOR_LEADER}) or vector(0)"),),
                kind="stat",
                green_band=(1, 2),
            ),
        ),
    )
    agents = RowSpec(
        "Agents",
        (
            PanelSpec(
                "NIXL-registered vs stored bytes per agent",
                "Per agent: bytes registered with NIXL and bytes held in its store. Registered should track stored; "
                "registered above stored means deregistrations were skipped (memory pinned and readable after "
                "free): see the next panel and restart the agent's pod if it persists.",
                units.BytesIEC,
                (
                    Query(q.AGENT_REGISTERED, "registered {{namespace}}/{{pod}} {{instance}}"),
                    Query(q.AGENT_STORED, "stored {{namespace}}/{{pod}} {{instance}}"),
                ),
                width=12,
            ),
            PanelSpec(
                "NIXL registrations not undone (registered - stored)",
                "Registered bytes minus stored bytes per agent. Red above zero: registrations outlive their objects "
                "(alert GPUObjectNIXLRegistrationsNotUndone).",
                units.BytesIEC,
                (Query(q.AGENT_REGISTERED_NOT_STORED, "{{namespace}}/{{pod}} {{instance}}"),),
                red_at=1,
                width=12,
            ),
            PanelSpec(
                "Stored bytes by device",
                "Bytes in all agents' stores, by device (cpu, cuda:N). If this grows while 'Bytes by state' does not, "
                "agents hold memory the operator does not know about: see 'Leaked bytes'.",
                units.BytesIEC,
                (Query(f"sum by (device) ({m.AGENT_STORE_BYTES})", "{{device}}"),),
                stack=True,
            ),
            PanelSpec(
                "Stored objects per agent",
                "Objects each agent's store holds. Compare with 'Objects by state': objects an agent holds that the "
                "operator does not list are leaks the next audit will count.",
                units.Short,
                (Query(f"sum by ({q.AGENT_LABELS}) ({m.AGENT_STORE_OBJECTS})", "{{namespace}}/{{pod}} {{instance}}"),),
            ),
            PanelSpec(
                "NIXL registrations and deregistrations",
                "Register and deregister operations per second over all agents. Over time they must balance; "
                "registrations outpacing deregistrations while stored bytes are flat is the seed-001 leak.",
                units.OpsPerSecond,
                (Query(q.rate(m.AGENT_NIXL_REGISTRATIONS, "op"), "{{op}}"),),
            ),
            PanelSpec(
                "Transfer throughput",
                "Bytes moved by NIXL reads per second, by direction. A drop to zero while workloads run means fetches "
                "are failing: see 'Agent errors by kind'.",
                units.BytesPerSecondIEC,
                (Query(q.rate(m.AGENT_TRANSFER_BYTES, "direction"), "{{direction}}"),),
            ),
            PanelSpec(
                "Transfer latency p50 / p99",
                "Duration of one NIXL transfer, by direction. Rising latency at steady throughput points at a "
                "congested link or a transport fallback (UCX over TCP instead of shared memory or RDMA).",
                units.Seconds,
                (
                    Query(q.quantile(0.5, m.AGENT_TRANSFER_SECONDS, "direction"), "p50 {{direction}}"),
                    Query(q.quantile(0.99, m.AGENT_TRANSFER_SECONDS, "direction"), "p99 {{direction}}"),
                ),
            ),
            PanelSpec(
                "Agent frees by result",
                "Frees the agents executed per second: freed, or noop (a repeated or late free, harmless).",
                units.OpsPerSecond,
                (Query(q.rate(m.AGENT_FREES, "result"), "{{result}}"),),
            ),
            PanelSpec(
                "Free wait for in-flight reads p99",
                "How long agents' frees waited for in-flight NIXL reads of the object to finish (a free never "
                "deregisters memory under a reader). Long waits delay frees: a reader is slow or stuck; see "
                "'In-flight reads'.",
                units.Seconds,
                (Query(q.quantile(0.99, m.AGENT_FREE_WAIT_SECONDS), "p99"),),
            ),
            PanelSpec(
                "In-flight reads",
                "NIXL reads of stored objects in progress now, per agent. A count that never returns to zero is a "
                "stuck reader; frees of the objects it reads will wait.",
                units.Short,
                (Query(f"sum by ({q.AGENT_LABELS}) ({m.AGENT_INFLIGHT_READS})", "{{namespace}}/{{pod}} {{instance}}"),),
            ),
            PanelSpec(
                "Agent errors by kind",
                "Agent errors per second, by kind. Red: investigate the agent's log for that kind.",
                units.OpsPerSecond,
                (Query(q.rate(m.AGENT_ERRORS, "kind"), "{{kind}}"),),
                red_at=1e-9,
            ),
            PanelSpec(
                "Agent free duration p50 / p99",
                "One free request at an agent, received to answered (waiting for in-flight reads included). The "
                "operator's free latency adds the API round trips to this.",
                units.Seconds,
                (
                    Query(q.quantile(0.5, m.AGENT_FREE_SECONDS), "p50"),
                    Query(q.quantile(0.99, m.AGENT_FREE_SECONDS), "p99"),
                ),
            ),
            PanelSpec(
                "Read tickets",
                "Read tickets issued, ended by their reader, or expired (the reader died or stalled past its lease). "
                "Expired tickets that keep rising point at crashing or wedged readers.",
                units.OpsPerSecond,
                (Query(q.rate(m.AGENT_READ_TICKETS, "result"), "{{result}}"),),
            ),
        ),
    )
    fencing = RowSpec(
        "Fencing stale readers",
        (
            PanelSpec(
                "Freed bytes waiting for their fence",
                "Bytes already freed but held until the NIXL agent that exposed them is retired, so that a reader "
                "with stale metadata gets a clean error instead of reading reused memory or crashing the source. "
                "Should return to zero within a second; a plateau means a read lease is holding a rotation back.",
                units.BytesIEC,
                (
                    Query(
                        f"sum by ({q.AGENT_LABELS}) ({m.AGENT_QUARANTINED_BYTES})", "{{namespace}}/{{pod}} {{instance}}"
                    ),
                ),
            ),
            PanelSpec(
                "Free to memory released p50 / p99",
                "From a free to the release of its memory (the fence's latency). Objects no reader ever saw are "
                "released at once and do not appear here.",
                units.Seconds,
                (
                    Query(q.quantile(0.5, m.AGENT_QUARANTINE_SECONDS), "p50"),
                    Query(q.quantile(0.99, m.AGENT_QUARANTINE_SECONDS), "p99"),
                ),
            ),
            PanelSpec(
                "NIXL agents per pod",
                "NIXL agents alive per pod agent, by state (active, sealed). Sealed agents wait for their readers "
                "before they are destroyed; a growing count means rotations are not finishing.",
                units.Short,
                (Query(f"sum by ({q.AGENT_LABELS}, state) ({m.AGENT_NIXL_GENERATIONS})", "{{pod}} {{state}}"),),
            ),
            PanelSpec(
                "NIXL agent rotations and migrations",
                "Rotations: NIXL agents replaced to fence stale readers. Migrations: live objects re-registered in "
                "the newer agent during a rotation.",
                units.OpsPerSecond,
                (
                    Query(q.rate(m.AGENT_NIXL_ROTATIONS), "rotations"),
                    Query(q.rate(m.AGENT_MIGRATIONS), "migrations"),
                ),
            ),
        ),
    )
    return (leaks, objects, frees, agents, fencing)


def panel_queries() -> list[tuple[str, str]]:
    """Every (panel title, PromQL) pair, Grafana macros included; see queries.for_prometheus."""
    return [(p.title, t.expr) for row in rows() for p in row.panels for t in p.queries]


def _thresholds(spec: PanelSpec) -> gd.ThresholdsConfig:
    if spec.green_band:
        lo, hi = spec.green_band
        steps = [gm.Threshold(None, "red"), gm.Threshold(lo, "green"), gm.Threshold(hi, "red")]
    elif spec.red_at is not None:
        steps = [gm.Threshold(None, "green"), gm.Threshold(spec.red_at, "red")]
    else:
        steps = [gm.Threshold(None, "green")]
    return gd.ThresholdsConfig().mode(gm.ThresholdsMode.ABSOLUTE).steps(steps)


def _targets(spec: PanelSpec) -> list[gp.Dataquery]:
    return [
        gp.Dataquery().ref_id(chr(ord("A") + i)).expr(t.expr).legend_format(t.legend or "__auto").range()
        for i, t in enumerate(spec.queries)
    ]


def _panel(spec: PanelSpec, panel_id: int) -> gt.Panel | gs.Panel:
    if spec.kind == "stat":
        panel: gt.Panel | gs.Panel = (
            gs.Panel()
            .color_mode(gc.BigValueColorMode.BACKGROUND)
            .graph_mode(gc.BigValueGraphMode.AREA)
            .color_scheme(gd.FieldColor().mode(gm.FieldColorModeId.THRESHOLDS))
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    else:
        panel = (
            gt.Panel()
            .legend(
                VizLegendOptions()
                .show_legend(True)
                .display_mode(gc.LegendDisplayMode.LIST)
                .placement(gc.LegendPlacement.BOTTOM)
            )
            .tooltip(VizTooltipOptions().mode(gc.TooltipDisplayMode.MULTI).sort(gc.SortOrder.DESCENDING))
            .fill_opacity(10)
            .line_width(1)
        )
        if spec.red_at is not None:
            panel = panel.thresholds_style(GraphThresholdsStyleConfig().mode(gc.GraphThresholdsStyleMode.DASHED))
        if spec.stack:
            panel = panel.stacking(StackingConfig().mode(gc.StackingMode.NORMAL))
    return (
        panel.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .min(0)
        .thresholds(_thresholds(spec))
        .span(spec.width)
        .height(spec.height)
        .targets(_targets(spec))
    )


def build_dashboard() -> gm.Dashboard:
    """The whole dashboard model; ``render`` turns it into the committed JSON."""
    board = (
        gd.Dashboard(TITLE)
        .uid(UID)
        .description(
            "GPU memory held by gpuobj agents that nothing references (leaked bytes), with the object, free and "
            "NIXL signals that explain it. Alert runbooks: deploy/prometheus/README.md. Generated by "
            "dev/gpuobj_dev/observability/dashboard.py: edit the code, not the JSON."
        )
        .tags(["gpuobj", "gpu", "leaks"])
        .editable()
        .tooltip(gm.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .with_variable(
            gd.DatasourceVariable(DATASOURCE_VAR)
            .label("Prometheus")
            .description("The Prometheus that scrapes the gpuobj operator and agents")
            .type("prometheus")
        )
    )
    panel_id = 1
    for row in rows():
        board = board.with_row(gd.Row(row.title).id(panel_id).collapsed(False))
        panel_id += 1
        for spec in row.panels:
            board = board.with_panel(_panel(spec, panel_id))
            panel_id += 1
    return board.build()


def render() -> str:
    """The dashboard JSON, byte-for-byte what is committed (sorted keys, trailing newline)."""
    return json.dumps(build_dashboard(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    return generated.main("python -m gpuobj_dev.observability.dashboard", __doc__.splitlines()[0], render, OUTPUT, argv)


if __name__ == "__main__":
    sys.exit(main())
