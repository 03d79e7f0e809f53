"""Prometheus alert rules for gpuobj, generated from gpuobj_contract.metric_names.

Why generated: the rules and the dashboard read the same expressions
(gpuobj_dev.observability.queries), so an alert and the panel that explains it never disagree,
and a renamed metric fails here instead of silently never firing.

    python -m gpuobj_dev.observability.rules --write   # regenerate deploy/prometheus/gpuobj-rules.yaml
    python -m gpuobj_dev.observability.rules --check   # non-zero if the committed file differs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import yaml

from gpuobj_contract import metric_names as m
from gpuobj_dev.observability import generated
from gpuobj_dev.observability import queries as q

OUTPUT = generated.REPO_ROOT / "deploy" / "prometheus" / "gpuobj-rules.yaml"
GIB = 1024**3
# Leaked bytes that page someone (critical) rather than open a ticket.
LARGE_LEAK_BYTES = 1 * GIB


@dataclass(frozen=True)
class Alert:
    """One alerting rule; ``runbook`` is the first thing to do, the README has the rest."""

    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str

    def to_rule(self) -> dict:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook": self.runbook,
            },
        }


LEAK_RUNBOOK = (
    "kubectl get events -n {{ $labels.namespace }} --field-selector involvedObject.name={{ $labels.pod }}; "
    "kubectl get gpuobj -n {{ $labels.namespace }}. The operator reclaims leaked bytes after its grace period "
    "(Event LeakReclaimed); if it does not, check audit errors and free failures (dashboard gpuobj-leaks). "
    "See deploy/prometheus/README.md#gpuobjectleakedbytes."
)


def groups() -> list[dict]:
    """The rule groups, in the order they are written."""
    leaks = [
        Alert(
            "GPUObjectLeakedBytes",
            f"{q.LEAKED_BY_POD} > 0",
            "10m",
            "warning",
            "GPU object store of {{ $labels.namespace }}/{{ $labels.pod }} holds unreferenced bytes",
            "Pod {{ $labels.namespace }}/{{ $labels.pod }} has held {{ $value | humanize1024 }}B that no GPUObject "
            "or claim references for more than 10 minutes.",
            LEAK_RUNBOOK,
        ),
        Alert(
            "GPUObjectLeakedBytesLarge",
            f"{q.LEAKED_BY_POD} >= {LARGE_LEAK_BYTES}",
            "15m",
            "critical",
            "{{ $labels.namespace }}/{{ $labels.pod }} leaks at least 1 GiB of GPU object memory",
            "Pod {{ $labels.namespace }}/{{ $labels.pod }} has held {{ $value | humanize1024 }}B of unreferenced "
            "memory for more than 15 minutes; the audit is not reclaiming it and the node may run out of memory.",
            LEAK_RUNBOOK,
        ),
        Alert(
            "GPUObjectLeakedBytesPersistent",
            f"{q.LEAKED_BY_POD} > 0",
            "1h",
            "critical",
            "Leak in {{ $labels.namespace }}/{{ $labels.pod }} not reclaimed for an hour",
            "Pod {{ $labels.namespace }}/{{ $labels.pod }} has held {{ $value | humanize1024 }}B of unreferenced "
            "memory for over an hour: reclamation is failing (audit errors, free failures, or an agent that refuses "
            "frees).",
            LEAK_RUNBOOK,
        ),
        Alert(
            "GPUObjectClaimHeldLong",
            f"{q.CLAIM_HELD_OVER_1H} > 0",
            "15m",
            "warning",
            "Claims in {{ $labels.namespace }} have held GPU objects for over an hour",
            "Namespace {{ $labels.namespace }} has {{ $value | humanize1024 }}B of GPU objects held by claims more "
            "than an hour old: a reader that never let go (a hung process without a ttl keeps its object Releasing).",
            "kubectl get gclaim -n {{ $labels.namespace }} --sort-by=.metadata.creationTimestamp; the oldest claims' "
            "holder pods are the suspects. Give the namespace a default claim ttl (chart value claimTTL.namespaces). "
            "See deploy/prometheus/README.md#gpuobjectclaimheldlong.",
        ),
    ]
    frees = [
        Alert(
            "GPUObjectFreeFailures",
            f"{q.rate(m.FREE_FAILURES, 'reason', '5m')} > 0",
            "5m",
            "warning",
            "gpuobj frees are failing ({{ $labels.reason }})",
            "The operator's frees have failed with reason {{ $labels.reason }} at {{ $value | humanize }}/s for "
            "5 minutes; the objects' memory stays allocated until a retry succeeds.",
            "Read the operator's log for the failing pod; check that the source pod's agent is running and "
            "reachable on its agent port and that its token matches. "
            "See deploy/prometheus/README.md#gpuobjectfreefailures.",
        ),
        Alert(
            "GPUObjectFreeLatencyHigh",
            f"{q.quantile(0.99, m.FREE_LATENCY, window='5m')} > 0.1",
            "15m",
            "warning",
            "gpuobj free latency p99 above 100 ms",
            "p99 from last reference gone to the agent's free acknowledgement is {{ $value | humanizeDuration }} "
            "(target under 100 ms) for 15 minutes.",
            "Look at 'Free wait for in-flight reads' and 'In-flight reads' on the dashboard (slow readers delay "
            "frees) and at the operator's CPU. See deploy/prometheus/README.md#gpuobjectfreelatencyhigh.",
        ),
        Alert(
            "GPUObjectClaimsMarkerFailing",
            f'sum(rate({m.CLAIMS_MARKER_WRITES}{{result="failed"}}[10m])) > 0',
            "15m",
            "warning",
            "gpuobj cannot write its claims progress marker",
            "The operator's writes to its claims progress marker have failed at {{ $value | humanize }}/s for "
            "15 minutes: frees whose last reference is the owner's release wait for a read of the claims "
            "(40-100 ms each) instead of a few milliseconds.",
            "grep 'claims progress marker' in the operator's log; check the Role <release>-gpuobj-operator-progress-"
            "marker and the claims admission policy. See deploy/prometheus/README.md#gpuobjectclaimsmarkerfailing.",
        ),
        Alert(
            "GPUObjectAuditFailing",
            f'sum(rate({m.AUDIT_RUNS}{{result="error"}}[10m])) > 0',
            "30m",
            "warning",
            "gpuobj agent audits keep failing",
            "Agent inventory audits have failed at {{ $value | humanize }}/s for 30 minutes: leaked bytes on the "
            "unaudited agents are neither measured nor reclaimed.",
            "grep 'audit of' in the operator's log to find the agents it cannot reach. "
            "See deploy/prometheus/README.md#gpuobjectauditfailing.",
        ),
    ]
    agents = [
        Alert(
            "GPUObjectNIXLRegistrationsNotUndone",
            f"{q.AGENT_REGISTERED_NOT_STORED} > 0",
            "5m",
            "warning",
            "Agent {{ $labels.namespace }}/{{ $labels.pod }} has NIXL registrations for memory it no longer stores",
            "Agent {{ $labels.namespace }}/{{ $labels.pod }} ({{ $labels.instance }}) has had "
            "{{ $value | humanize1024 }}B more registered with NIXL than it stores for 5 minutes: deregistrations "
            "were skipped (deregister after free), the memory stays pinned and stale readers could read it.",
            "Compare gpuobj_agent_nixl_registrations_total by op on that agent; restart the pod to release the "
            "registrations and file a bug with its log. "
            "See deploy/prometheus/README.md#gpuobjectnixlregistrationsnotundone.",
        ),
    ]
    operator = [
        Alert(
            "GPUObjectOperatorNoLeader",
            f"absent({m.OPERATOR_LEADER} == 1)",
            "5m",
            "critical",
            "No gpuobj operator is leading",
            "No gpuobj operator replica has reported holding the leader lease for 5 minutes (operator down, not "
            "scraped, or stuck acquiring the lease): nothing is freed, audited or reclaimed.",
            "kubectl -n <operator namespace> get pods,lease; kubectl logs deploy/<operator>. Check the Prometheus "
            "target for the operator. See deploy/prometheus/README.md#gpuobjectoperatornoleader.",
        ),
        Alert(
            "GPUObjectOperatorMultipleLeaders",
            f"sum({m.OPERATOR_LEADER}) > 1",
            "5m",
            "warning",
            "More than one gpuobj operator reports being leader",
            "{{ $value }} operator replicas report holding the leader lease for 5 minutes; two leaders could free "
            "the same objects twice.",
            "kubectl -n <operator namespace> get lease -o yaml; restart the replicas that do not hold it. "
            "See deploy/prometheus/README.md#gpuobjectoperatormultipleleaders.",
        ),
    ]
    return [
        {"name": "gpuobj.leaks", "rules": [a.to_rule() for a in leaks]},
        {"name": "gpuobj.frees", "rules": [a.to_rule() for a in frees]},
        {"name": "gpuobj.agents", "rules": [a.to_rule() for a in agents]},
        {"name": "gpuobj.operator", "rules": [a.to_rule() for a in operator]},
    ]


def alert_names() -> list[str]:
    return [r["alert"] for g in groups() for r in g["rules"]]


def rule_exprs() -> list[tuple[str, str]]:
    """Every (alert name, PromQL) pair: tests run them against a real Prometheus."""
    return [(r["alert"], r["expr"]) for g in groups() for r in g["rules"]]


HEADER = (
    "# gpuobj alert rules. Generated by dev/gpuobj_dev/observability/rules.py\n"
    "# from contract/gpuobj_contract/metric_names.py:\n"
    "# edit the code and run `python -m gpuobj_dev.observability.rules --write`, not this file.\n"
    "# Unit tests: gpuobj-rules.test.yaml (promtool test rules). Label policy: README.md.\n"
)


def render() -> str:
    # No line folding: a folded "{{ $labels.pod }}" is valid YAML but unreadable.
    body = yaml.safe_dump({"groups": groups()}, sort_keys=False, default_flow_style=False, width=1 << 16)
    return HEADER + body


def main(argv: list[str] | None = None) -> int:
    return generated.main("python -m gpuobj_dev.observability.rules", __doc__.splitlines()[0], render, OUTPUT, argv)


if __name__ == "__main__":
    sys.exit(main())
