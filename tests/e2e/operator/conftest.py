"""Fixtures for operator tests: a namespace per test, and the real operator watching only it.

Everyone runs as their own ServiceAccount with the chart's RBAC (gpuobj_dev.testing.identities):
the operator as `gpuobj-operator`, each workload pod as `gpuobj-workload` with tokens bound to its
pod. The admin credentials only play the cluster admin and the kubelet (namespaces, pod status).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev.testing.agent_tls import PLAIN
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import (
    OPERATOR_SA,
    WORKLOAD_SA,
    Credentials,
    credentials,
    install_identities,
    operator_subject,
)
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_dev.testing.workload import WorkloadProcess, free_port
from tests.conftest import failed

# Fast enough for tests; the production defaults are in operator/gpuobj_operator/flags.py.
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
    "--liveness-interval",
    "0.25",
]


@pytest.fixture
def namespace(gpuobj_cluster: ClusterHandle) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    gpuobj_cluster.create_namespace(name)
    install_identities(gpuobj_cluster, name)
    yield name
    gpuobj_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def operator_identity(gpuobj_cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[Credentials]:
    creds = credentials(gpuobj_cluster, namespace, OPERATOR_SA, tmp_path / "operator")
    yield creds
    creds.stop()


@pytest.fixture
def token_file(operator_identity: Credentials) -> Path:
    """The operator's agent-audience token: what a test presents when it plays the operator at an agent."""
    return operator_identity.agent_token


def start_operator(
    cluster: ClusterHandle, token_file: Path, namespace: str, identity: str = "op-1", extra: list[str] | None = None
) -> OperatorProcess:
    """The operator as its ServiceAccount: `token_file` is its agent token, next to its kubeconfig."""
    return OperatorProcess(
        token_file.with_name("kubeconfig"),
        token_file,
        identity=identity,
        lease_namespace=namespace,
        extra_args=["--namespace", namespace, *FAST_ARGS, *(extra or [])],
    ).start()


@pytest.fixture
def operator(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> Iterator[OperatorProcess]:
    plain = ["--agent-tls", "off"] if plain_agents(request) else []
    op = start_operator(gpuobj_cluster, token_file, namespace, extra=plain).wait_ready()
    yield op
    if failed(request):
        print(f"\n--- operator output ---\n{op.output()}")
        print(gpuobj_cluster.kubectl("get", "gpuobj,pods,events", "-n", namespace, "-o", "wide", check=False).stdout)
    rc = op.stop()
    assert rc == 0, f"operator exited {rc}:\n{op.output()}"


def plain_agents(request: pytest.FixtureRequest) -> bool:
    """The test is marked `plain_agents`: its operator and pods run without TLS to agents."""
    return request.node.get_closest_marker("plain_agents") is not None


class Pods:
    """Workload pods for one test: a Pod object (no kubelet) plus a real process running the client library.

    Their agents serve TLS with a certificate from the operator's signer (the harness default), so the
    operator must run before a pod starts; ``plain`` pods serve plain HTTP."""

    def __init__(
        self, cluster: ClusterHandle, namespace: str, token_file: Path, folder: Path, plain: bool = False
    ) -> None:
        self.plain = plain
        self.cluster = cluster
        self.namespace = namespace
        self.token_file = token_file
        self.folder = folder
        self.workloads: dict[str, WorkloadProcess] = {}
        self.uids: dict[str, str] = {}
        self.credentials: dict[str, Credentials] = {}
        self.extra_env: dict[str, dict[str, str]] = {}  # per workload, kept across container restarts

    def _process(self, name: str, port: int) -> WorkloadProcess:
        creds = self.credentials[name]
        return WorkloadProcess(
            pod_name=name,
            namespace=self.namespace,
            pod_uid=self.uids[name],
            port=port,
            token_file=creds.agent_token,
            kubeconfig=creds.kubeconfig,
            env={"GPUOBJ_OPERATOR_SERVICEACCOUNT": operator_subject(self.namespace), **self.extra_env.get(name, {})},
        )

    def workload(self, name: str, env: dict[str, str] | None = None) -> WorkloadProcess:
        port = free_port()

        async def create() -> dict:
            async with self.cluster.client() as kube:
                return await create_agent_pod(kube, self.namespace, name, port=port, service_account=WORKLOAD_SA)

        pod = asyncio.run(create())
        self.uids[name] = pod["metadata"]["uid"]
        self.credentials[name] = credentials(
            self.cluster, self.namespace, WORKLOAD_SA, self.folder / name, pod=(name, self.uids[name])
        )
        self.extra_env[name] = {**(PLAIN if self.plain else {}), **(env or {})}
        w = self._process(name, port)
        self.workloads[name] = w
        return w.start()

    def agent_token(self, name: str) -> Path:
        """The pod's own agent-audience token (what it presents when it reads elsewhere)."""
        return self.credentials[name].agent_token

    def restart_process(self, name: str) -> WorkloadProcess:
        """The container restarts: same pod (uid, address), a new process with an empty store."""
        old = self.workloads[name]
        old.kill()
        w = self._process(name, int(old.env["GPUOBJ_AGENT_PORT"]))
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
        for creds in self.credentials.values():
            creds.stop()


@pytest.fixture
def pods(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, namespace: str, token_file: Path, tmp_path: Path
) -> Iterator[Pods]:
    p = Pods(gpuobj_cluster, namespace, token_file, tmp_path / "pods", plain=plain_agents(request))
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
