"""Fixtures for operator tests: a namespace per test, and the real operator watching only it."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_dev.testing.workload import WorkloadProcess, free_port
from tests.conftest import failed

# Fast enough for tests; the production defaults are in operator/gpuobj_operator/main.py.
FAST_ARGS = [
    "--audit-interval",
    "0.5",
    "--leak-settle",
    "0.5",
    "--leak-grace",
    "2",
    "--lease-seconds",
    "3",
    "--resync-interval",
    "5",
]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "agent-token"
    path.write_text(secrets.token_hex(16))
    path.chmod(0o600)
    return path


@pytest.fixture
def namespace(gpuobj_cluster: ClusterHandle) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    gpuobj_cluster.kubectl("create", "namespace", name)
    yield name
    gpuobj_cluster.kubectl("delete", "namespace", name, "--wait=false")


def start_operator(
    cluster: ClusterHandle, token_file: Path, namespace: str, identity: str = "op-1", extra: list[str] | None = None
) -> OperatorProcess:
    return OperatorProcess(
        cluster.kubeconfig,
        token_file,
        identity=identity,
        lease_namespace=namespace,
        extra_args=["--namespace", namespace, *FAST_ARGS, *(extra or [])],
    ).start()


@pytest.fixture
def operator(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> Iterator[OperatorProcess]:
    op = start_operator(gpuobj_cluster, token_file, namespace).wait_ready()
    yield op
    if failed(request):
        print(f"\n--- operator output ---\n{op.output()}")
        print(gpuobj_cluster.kubectl("get", "gpuobj,pods,events", "-n", namespace, "-o", "wide", check=False).stdout)
    rc = op.stop()
    assert rc == 0, f"operator exited {rc}:\n{op.output()}"


class Pods:
    """Workload pods for one test: a Pod object (no kubelet) plus a real process running the client library."""

    def __init__(self, cluster: ClusterHandle, namespace: str, token_file: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.token_file = token_file
        self.workloads: dict[str, WorkloadProcess] = {}
        self.uids: dict[str, str] = {}

    def workload(self, name: str, env: dict[str, str] | None = None) -> WorkloadProcess:
        port = free_port()

        async def create() -> dict:
            async with self.cluster.client() as kube:
                return await create_agent_pod(kube, self.namespace, name, port=port)

        pod = asyncio.run(create())
        self.uids[name] = pod["metadata"]["uid"]
        w = WorkloadProcess(
            pod_name=name,
            namespace=self.namespace,
            pod_uid=pod["metadata"]["uid"],
            port=port,
            token_file=self.token_file,
            kubeconfig=self.cluster.kubeconfig,
            env=env,
        )
        self.workloads[name] = w
        return w.start()

    def restart_process(self, name: str) -> WorkloadProcess:
        """The container restarts: same pod (uid, address), a new process with an empty store."""
        old = self.workloads[name]
        old.kill()
        w = WorkloadProcess(
            pod_name=name,
            namespace=self.namespace,
            pod_uid=self.uids[name],
            port=int(old.env["GPUOBJ_AGENT_PORT"]),
            token_file=self.token_file,
            kubeconfig=self.cluster.kubeconfig,
        )
        self.workloads[name] = w
        return w.start()

    def endpoint(self, name: str) -> str:
        return self.workloads[name].endpoint

    def delete_pod(self, name: str, kill_process: bool = True) -> None:
        if kill_process and name in self.workloads:
            self.workloads[name].kill()

        async def delete() -> None:
            async with self.cluster.client() as kube:
                await delete_pod(kube, self.namespace, name)

        asyncio.run(delete())

    def close(self) -> None:
        for w in self.workloads.values():
            try:
                w.stop(timeout=30)
            except AssertionError:
                w.kill()


@pytest.fixture
def pods(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, namespace: str, token_file: Path
) -> Iterator[Pods]:
    p = Pods(gpuobj_cluster, namespace, token_file)
    yield p
    if failed(request):
        for name, w in p.workloads.items():
            print(f"\n--- workload {name} output ---\n{w.output()}")
    p.close()


def kube(cluster: ClusterHandle, fn):
    """Run ``await fn(kube)`` with a fresh API client (tests are synchronous)."""

    async def go():
        async with cluster.client() as client:
            return await fn(client)

    return asyncio.run(go())
