"""The real-Prometheus harness: scrapes real exporters, answers queries, waits bounded, stops cleanly."""

from __future__ import annotations

import socket
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from gpuobj_dev.observability import dashboard, queries, rules
from gpuobj_dev.observability.scrape import OPERATOR_JOB
from gpuobj_dev.testing.prometheus import Prometheus, PrometheusError, sample_value
from tests.e2e.observability.conftest import Exporter


def equals(value: float):
    return lambda result: len(result) == 1 and sample_value(result[0]) == value


def test_scrapes_a_real_exporter_answers_queries_and_stops_cleanly(exporter: Exporter) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("harness_test_value", "a value the test sets", registry=registry)
    gauge.set(42)
    address = exporter(registry)
    prom = Prometheus({"test-exporter": [address]}).start()
    try:
        start = time.time()
        prom.wait_for_series("harness_test_value", equals(42), timeout=20)
        (target,) = prom.wait_targets_up(timeout=10)
        assert (target["job"], target["instance"], target["health"]) == ("test-exporter", address, "up")

        gauge.set(7)
        (sample,) = prom.wait_for_series("harness_test_value", equals(7), timeout=20)
        assert sample["metric"] == {"__name__": "harness_test_value", "job": "test-exporter", "instance": address}

        # End the range exactly at the instant the 7 was seen, so its last point is that evaluation.
        seen_at = float(sample["value"][0])
        steps = int((seen_at - start) / 0.25) + 1
        (series,) = prom.query_range("harness_test_value", seen_at - steps * 0.25, seen_at, step=0.25)
        seen = [float(v) for _, v in series["values"]]
        assert 42.0 in seen and seen[-1] == 7.0
        (scalar,) = prom.query("scalar(harness_test_value) * 2")
        assert scalar["metric"] == {} and sample_value(scalar) == 14
    finally:
        prom.stop()
    assert prom.proc is not None and prom.proc.returncode is not None
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", prom.port), timeout=1):
        pass


def test_targets_added_after_start_are_scraped(exporter: Exporter) -> None:
    registry = CollectorRegistry()
    Gauge("harness_late_value", "a target that appears later", registry=registry).set(1)
    with Prometheus({}) as prom:
        assert prom.targets_health() == []
        prom.set_targets({"late": [exporter(registry)]})
        prom.wait_for_series("harness_late_value", equals(1), timeout=20)


def test_operator_job_keeps_the_exporters_namespace_and_pod(exporter: Exporter) -> None:
    """The label policy (dev/gpuobj_dev/observability/scrape.py): Kubernetes-like target labels namespace/pod
    do not overwrite an operator series' own namespace/pod; on other jobs they would (exported_*)."""
    registry = CollectorRegistry()
    Gauge("harness_leak_bytes", "bytes held by a pod", ["namespace", "pod"], registry=registry).labels(
        "ml", "producer-0"
    ).set(4096)
    address = exporter(registry)
    k8s_target = {"namespace": "gpuobj-system", "pod": "gpuobj-operator-0"}
    with Prometheus({OPERATOR_JOB: [address], "default-policy": [address]}, target_labels={address: k8s_target}) as p:
        result = p.wait_for_series("harness_leak_bytes", lambda r: len(r) == 2, timeout=20)
        by_job = {s["metric"]["job"]: s["metric"] for s in result}
        assert by_job[OPERATOR_JOB]["namespace"] == "ml" and by_job[OPERATOR_JOB]["pod"] == "producer-0"
        assert not any(k.startswith("exported_") for k in by_job[OPERATOR_JOB])
        other = by_job["default-policy"]
        assert (other["namespace"], other["exported_namespace"], other["exported_pod"]) == (
            "gpuobj-system",
            "ml",
            "producer-0",
        )


def test_every_dashboard_and_rule_query_parses_and_evaluates() -> None:
    with Prometheus({}) as prom:
        for title, expr in dashboard.panel_queries() + rules.rule_exprs():
            promql = queries.for_prometheus(expr, rate_interval="5s")
            now = time.time()
            try:
                prom.query(promql)
                prom.query_range(promql, now - 60, now, 5)
            except PrometheusError as exc:
                raise AssertionError(f"{title}: {promql}: {exc}") from None
        with pytest.raises(PrometheusError, match="parse error"):
            prom.query("sum by (namespace (gpuobj_leaked_bytes)")


def test_the_rules_file_loads_and_evaluates_in_prometheus() -> None:
    with Prometheus({}, rule_files=[rules.OUTPUT]) as prom:
        assert prom.wait_rules_evaluated(timeout=15) == dict.fromkeys(rules.alert_names(), "ok")
        # Nothing is scraped: the no-leader alert is pending (its for: 5m has not passed), nothing else.
        prom.wait_for_series('ALERTS{alertname="GPUObjectOperatorNoLeader", alertstate="pending"}', timeout=15)
        assert [a["labels"]["alertname"] for a in prom.alerts()] == ["GPUObjectOperatorNoLeader"]


def test_wait_for_series_is_bounded_and_reports_the_last_result() -> None:
    with Prometheus({}) as prom:
        started = time.monotonic()
        with pytest.raises(PrometheusError, match=r"vector\(1\).*last result"):
            prom.wait_for_series("vector(1)", lambda r: False, timeout=1)
        assert time.monotonic() - started < 5
