"""One active operator at a time: a second replica waits on the Lease and takes over when the leader dies."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gpuobj_contract import names
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.pods import create_agent_pod
from gpuobj_kube.client import GPUOBJECTS, LEASES, wait_for
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


def _freed_by(cluster: ClusterHandle, namespace: str, name: str) -> str:
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    # "Freed" (free answered agent-gone) or "Released" (the probes had already found no agent listening).
    (freed,) = [e for e in events if e["reason"] in ("Freed", "Released") and e["involvedObject"]["name"] == name]
    return freed["reportingInstance"]


def test_second_replica_waits_and_takes_over_when_the_leader_dies(
    gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> None:
    async def make_pod() -> str:
        async with gpuobj_cluster.client() as kube:
            return (await create_agent_pod(kube, namespace, "src", port=1))["metadata"]["uid"]

    pod_uid = asyncio.run(make_pod())
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
