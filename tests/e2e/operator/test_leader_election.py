"""One active operator at a time: a second replica waits on the Lease and takes over when the leader dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from gpuobj_contract import names
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.pods import create_agent_pod
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import GPUOBJECTS, LEASES
from gpuobj_kube.informer import wait_for
from tests.e2e.operator.conftest import start_operator


async def _put_and_delete(cluster: ClusterHandle, namespace: str, name: str, pod_uid: str) -> None:
    """A GPUObject whose agent is gone (nothing listens): its free completes as 'agent-gone'."""
    async with cluster.client() as kube:
        body = {
            "metadata": {"name": name, "finalizers": [names.FINALIZER_FREE]},
            "spec": {
                "source": {"podName": "src", "podUID": pod_uid},
                "objectId": f"o-{name}",
                "tensors": [{"shape": [8], "dtype": "float32"}],
            },
        }
        await kube.create(GPUOBJECTS, body, namespace)
        await kube.delete(GPUOBJECTS, name, namespace)
        await wait_for(kube, GPUOBJECTS, name, namespace, lambda o: o is None, timeout=30)


def _source_pod_uid(cluster: ClusterHandle, namespace: str) -> str:
    """A labelled agent pod "src" whose agent nothing listens for (port 1): frees answer agent-gone."""

    async def make() -> str:
        async with cluster.client() as kube:
            return (await create_agent_pod(kube, namespace, "src", port=1))["metadata"]["uid"]

    return asyncio.run(make())


def _freed_by(cluster: ClusterHandle, namespace: str, name: str) -> str:
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    # "Freed" (free answered agent-gone) or "Released" (the probes had already found no agent listening).
    (freed,) = [e for e in events if e["reason"] in ("Freed", "Released") and e["involvedObject"]["name"] == name]
    return freed["reportingInstance"]


def test_second_replica_waits_and_takes_over_when_the_leader_dies(
    gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> None:
    pod_uid = _source_pod_uid(gpuobj_cluster, namespace)
    # A lease long enough that a loaded two-core machine never misses a renewal.
    lease = ["--lease-seconds", "10"]
    leader = start_operator(gpuobj_cluster, token_file, namespace, identity="op-a", extra=lease).wait_ready()
    standby = start_operator(gpuobj_cluster, token_file, namespace, identity="op-b", extra=lease)
    try:
        standby.wait_for_line("waiting for leadership", timeout=30)
        assert standby.metric("gpuobj_operator_leader") == 0

        asyncio.run(_put_and_delete(gpuobj_cluster, namespace, "first", pod_uid))
        assert _freed_by(gpuobj_cluster, namespace, "first") == "op-a"
        assert standby.metric("gpuobj_frees_total") == 0

        leader.kill()  # a crash: the lease is not handed over, the standby waits for it to expire
        standby.wait_ready(timeout=60)

        async def holder() -> str:
            async with gpuobj_cluster.client() as kube:
                return (await kube.get(LEASES, "gpuobj-operator", namespace))["spec"]["holderIdentity"]

        assert asyncio.run(holder()) == "op-b"

        asyncio.run(_put_and_delete(gpuobj_cluster, namespace, "second", pod_uid))
        assert _freed_by(gpuobj_cluster, namespace, "second") == "op-b"
    finally:
        leader.kill()
        assert standby.stop() == 0, standby.output()


def _terms(op) -> int:
    """How many terms as leader this process began (each starts with a fresh LIST)."""
    return op.output().count("synced and reconciling")


def test_a_leader_that_loses_its_lease_in_an_api_outage_stays_up_and_leads_again(
    gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> None:
    pod_uid = _source_pod_uid(gpuobj_cluster, namespace)
    op = start_operator(gpuobj_cluster, token_file, namespace, identity="op-a").wait_ready()  # 3 s lease
    try:
        asyncio.run(_put_and_delete(gpuobj_cluster, namespace, "before", pod_uid))
        pid = op.proc.pid
        gpuobj_cluster.cluster.stop_component("kube-apiserver")
        try:
            # Longer than the lease: the leader cannot renew, so it stops acting...
            op.wait_for_line("lost leadership", timeout=60)
            op.wait_for_line("trying to lead again", timeout=30)
        finally:
            gpuobj_cluster.cluster.start_component("kube-apiserver")
        # ... but stays up, and leads again (a fresh LIST, a new term) once the API server is back.
        wait_until(lambda: _terms(op) >= 2, "a second term as leader", 60, 0.2)
        assert op.proc.poll() is None and op.proc.pid == pid, op.output()
        asyncio.run(_put_and_delete(gpuobj_cluster, namespace, "after", pod_uid))
        assert _freed_by(gpuobj_cluster, namespace, "after") == "op-a"
        assert op.metric("gpuobj_operator_leader") == 1
        # Standing by, it did nothing: no audit, no free between losing the lease and leading again. (The
        # first term's auditor, informers and workers once went on beside the standby and the next term:
        # every free was then executed once per term the process had led.)
        lines = list(op.lines)
        lost = next(i for i, line in enumerate(lines) if "lost leadership" in line)
        led = next(i for i, line in enumerate(lines) if i > lost and "leading as op-a" in line)
        acted = [line for line in lines[lost + 1 : led] if "audit of" in line or "freeing" in line]
        assert acted == [], acted
    finally:
        assert op.stop() == 0, op.output()


def test_a_paused_leader_replaced_by_another_stands_by_and_leads_again_when_that_one_goes(
    gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> None:
    async def holder() -> str:
        async with gpuobj_cluster.client() as kube:
            return (await kube.get(LEASES, "gpuobj-operator", namespace))["spec"]["holderIdentity"]

    pod_uid = _source_pod_uid(gpuobj_cluster, namespace)
    lease = ["--lease-seconds", "4"]
    a = start_operator(gpuobj_cluster, token_file, namespace, identity="op-a", extra=lease).wait_ready()
    b = start_operator(gpuobj_cluster, token_file, namespace, identity="op-b", extra=lease)
    try:
        b.wait_for_line("waiting for leadership", timeout=30)
        os.kill(a.proc.pid, signal.SIGSTOP)  # past its lease: b takes over
        try:
            b.wait_ready(timeout=60)
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        # a wakes up to a lease that is no longer its own: it stops acting and stands by.
        a.wait_for_line("lost leadership", timeout=60)
        wait_until(lambda: a.metric("gpuobj_operator_leader") == 0, "op-a standing by", 30, 0.2)
        asyncio.run(_put_and_delete(gpuobj_cluster, namespace, "while-b-leads", pod_uid))
        assert _freed_by(gpuobj_cluster, namespace, "while-b-leads") == "op-b"
        assert asyncio.run(holder()) == "op-b"
        # b goes (a clean stop hands the lease over): a, the same process, leads again within seconds.
        assert b.stop() == 0, b.output()
        wait_until(lambda: _terms(a) >= 2, "op-a's second term", 60, 0.2)
        assert a.proc.poll() is None
        asyncio.run(_put_and_delete(gpuobj_cluster, namespace, "after-b", pod_uid))
        assert _freed_by(gpuobj_cluster, namespace, "after-b") == "op-a"
    finally:
        b.kill()
        assert a.stop() == 0, a.output()


def test_clean_shutdown_hands_the_lease_over_at_once(
    gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> None:
    first = start_operator(gpuobj_cluster, token_file, namespace, identity="op-a", extra=["--lease-seconds", "600"])
    first.wait_ready()
    second = start_operator(gpuobj_cluster, token_file, namespace, identity="op-b", extra=["--lease-seconds", "600"])
    try:
        second.wait_for_line("waiting for leadership", timeout=30)
        assert first.stop() == 0
        # With a 600 s lease, only the release on SIGTERM lets the second lead within the timeout.
        second.wait_ready(timeout=30)
    finally:
        first.kill()
        assert second.stop() == 0, second.output()
