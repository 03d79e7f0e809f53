"""Every operator panel and rule query, run by a real Prometheus scraping the real operator.

The operator runs against the real control plane and is driven through real failure paths
(no agent process is needed for them): a source pod whose agent port has nothing listening
(frees complete as "agent-gone", audits fail) and a source pod whose "agent" endpoint is an
HTTP server that is not an agent (frees fail with agent-404). The agent panels need real
agents (gpuobj_dev.testing.agent_workload.AgentProcess) and are exercised by the lead's follow-up test.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpuobj_contract import metric_names as m
from gpuobj_contract import names
from gpuobj_dev.observability import dashboard, queries, rules
from gpuobj_dev.observability.scrape import OPERATOR_JOB
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import OPERATOR_SA, credentials, install_identities
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_dev.testing.prometheus import Prometheus, Result, sample_value
from gpuobj_kube.client import GPUOBJECTS, PODS, NotFound
from gpuobj_kube.informer import wait_for
from tests.e2e.operator.conftest import start_operator

# What Kubernetes service discovery would attach to the operator's target (see scrape.py).
OPERATOR_TARGET_LABELS = {"namespace": "gpuobj-system", "pod": "gpuobj-operator-0"}

# Operator panels that this scenario cannot fill: a leak (and the part of it held by gone holders) needs an
# agent that answers its inventory.
EMPTY_WITHOUT_AGENTS = {
    "Leaked bytes by namespace and pod",
    "Reclaimed bytes by namespace",
    "Leaked bytes held by gone holders",
}


def is_agent_query(expr: str) -> bool:
    return any(n.startswith("gpuobj_agent_") for n in queries.referenced_metrics(expr))


def positive(result: Result) -> bool:
    return bool(result) and all(sample_value(s) > 0 for s in result)


@pytest.fixture
def namespace(gpuobj_cluster: ClusterHandle) -> Iterator[str]:
    name = f"obs-{uuid.uuid4().hex[:8]}"
    gpuobj_cluster.create_namespace(name)
    install_identities(gpuobj_cluster, name)
    yield name
    gpuobj_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def token_file(gpuobj_cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The operator runs as its ServiceAccount (start_operator finds the kubeconfig next to this file)."""
    creds = credentials(gpuobj_cluster, namespace, OPERATOR_SA, tmp_path / "operator")
    yield creds.agent_token
    creds.stop()


def gpuobject(name: str, pod: dict) -> dict:
    return {
        "metadata": {"name": name, "finalizers": [names.FINALIZER_FREE]},
        "spec": {
            "source": {"podName": pod["metadata"]["name"], "podUID": pod["metadata"]["uid"]},
            "objectId": f"o-{name}",
            "tensors": [{"shape": [1024], "dtype": "float32"}],
        },
    }


async def start_objects(cluster: ClusterHandle, namespace: str, operator: OperatorProcess) -> None:
    """One object kept on a dead agent, one whose free fails (its "agent" is the operator's own HTTP port)."""
    metrics = urlsplit(operator.metrics_url)
    async with cluster.client() as kube:
        dead = await create_agent_pod(kube, namespace, "dead-agent", port=1)
        wrong = await create_agent_pod(kube, namespace, "not-an-agent", host=metrics.hostname, port=metrics.port)
        await kube.create(GPUOBJECTS, gpuobject("kept", dead), namespace)
        await kube.create(GPUOBJECTS, gpuobject("stuck", wrong), namespace)
        await kube.delete(GPUOBJECTS, "stuck", namespace)


async def put_and_free(cluster: ClusterHandle, namespace: str, name: str) -> None:
    """An object on the dead agent, deleted: its free completes as agent-gone."""
    async with cluster.client() as kube:
        dead = await kube.get(PODS, "dead-agent", namespace)
        await kube.create(GPUOBJECTS, gpuobject(name, dead), namespace)
        await kube.delete(GPUOBJECTS, name, namespace)
        await wait_for(kube, GPUOBJECTS, name, namespace, lambda o: o is None, timeout=30)


async def clean_up(cluster: ClusterHandle, namespace: str) -> None:
    """The failing free never completes by itself: drop its finalizer, then the pods and objects."""
    async with cluster.client() as kube:
        for name in ("stuck", "kept"):
            try:
                await kube.patch(GPUOBJECTS, name, {"metadata": {"finalizers": None}}, namespace)
                await kube.delete(GPUOBJECTS, name, namespace)
            except NotFound:
                pass
        for pod in ("dead-agent", "not-an-agent"):
            await delete_pod(kube, namespace, pod)


def test_every_operator_panel_and_rule_query_answers_from_the_real_operator(
    gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> None:
    # A namespace quota (far above what this scenario holds), so the quota panel has its series.
    quota = ["--namespace-quota", f"{namespace}=1Gi"]
    # Plain HTTP: the failing free's "agent" is the operator's own HTTP port (its 404 is the failure shown).
    plain = ["--agent-tls", "off"]
    operator = start_operator(gpuobj_cluster, token_file, namespace, extra=[*quota, *plain]).wait_ready()
    address = urlsplit(operator.metrics_url).netloc
    try:
        with Prometheus({OPERATOR_JOB: [address]}, target_labels={address: OPERATOR_TARGET_LABELS}) as prom:
            prom.wait_for_series(f"{m.OPERATOR_LEADER} == 1", timeout=30)
            asyncio.run(start_objects(gpuobj_cluster, namespace, operator))
            # A labelled counter is born at its first increment (value 1), which rate() cannot see: free
            # twice, with Prometheus scraping in between, so the frees panel shows a rate above zero.
            asyncio.run(put_and_free(gpuobj_cluster, namespace, "freed-1"))
            prom.wait_for_series(f'{m.FREES}{{result="agent-gone"}}', positive, timeout=30)
            asyncio.run(put_and_free(gpuobj_cluster, namespace, "freed-2"))
            prom.wait_for_series(f'rate({m.FREES}{{result="agent-gone"}}[1m]) > 0', timeout=30)
            prom.wait_for_series(f'rate({m.FREE_FAILURES}{{reason="agent-404"}}[1m]) > 0', timeout=30)
            prom.wait_for_series(f'{m.AUDIT_RUNS}{{result="error"}}', positive, timeout=30)

            answers: dict[str, Result] = {}
            for title, promql in dashboard_exprs():
                if is_agent_query(promql):
                    continue
                if title in EMPTY_WITHOUT_AGENTS:
                    result = prom.query(promql)
                else:  # the panel shows data once Prometheus has the samples its window needs
                    result = prom.wait_for_series(promql, timeout=15)
                now = time.time()
                assert prom.query_range(promql, now - 60, now, 1) or title in EMPTY_WITHOUT_AGENTS, title
                answers.setdefault(title, result)

            assert sample_value(answers["Operator leaders"][0]) == 1
            frees = {s["metric"]["result"]: sample_value(s) for s in answers["Frees by result"]}
            assert frees["agent-gone"] > 0
            failures = {s["metric"]["reason"]: sample_value(s) for s in answers["Free failures by reason"]}
            assert failures["agent-404"] > 0
            assert failures.get("unreachable", 0) == 0  # known reasons are exported from 0 on
            states = {s["metric"]["state"] for s in answers["Objects by state"]}
            assert states and states == {s["metric"]["state"] for s in answers["Bytes by state"]}
            assert sample_value(answers["Free latency p50 / p99"][0]) >= 0
            assert sample_value(answers["Leaked bytes (total)"][0]) == 0

            # The operator-side alert expressions see the same: free failures fire, a leader exists.
            exprs = dict(rules.rule_exprs())
            (firing,) = prom.query(exprs["GPUObjectFreeFailures"])
            assert firing["metric"] == {"reason": "agent-404"}
            assert prom.query(exprs["GPUObjectOperatorNoLeader"]) == []
            assert prom.query(exprs["GPUObjectLeakedBytes"]) == []
            # The scrape policy: the operator's series carry the target's namespace/pod (no exported_*).
            (leader,) = prom.query(m.OPERATOR_LEADER)
            assert leader["metric"]["namespace"] == "gpuobj-system"
            assert not any(k.startswith("exported_") for k in leader["metric"])
    finally:
        asyncio.run(clean_up(gpuobj_cluster, namespace))
        rc = operator.stop()
    assert rc == 0, operator.output()


def dashboard_exprs() -> list[tuple[str, str]]:
    """Panel queries with Grafana's macros set to a window that covers the whole test."""
    return [(t, queries.for_prometheus(e, rate_interval="1m", range_="5m")) for t, e in dashboard.panel_queries()]
