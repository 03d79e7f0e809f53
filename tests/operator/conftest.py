"""Fixtures for operator tests: a namespace per test, and the real operator watching only it."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj.testing.cluster import ClusterHandle
from gpuobj.testing.operator import OperatorProcess

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
def operator(gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str) -> Iterator[OperatorProcess]:
    op = start_operator(gpuobj_cluster, token_file, namespace).wait_ready()
    yield op
    rc = op.stop()
    assert rc == 0, f"operator exited {rc}:\n{op.output()}"
