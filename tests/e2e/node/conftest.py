"""One real node for the tests in tests/e2e/node: a dev control plane with kube-scheduler, a kubelet and
containerd (gpuobj_dev.node), the images built from the Dockerfile and loaded into it.

Skips, with the reason, only where the host cannot run a node (not root, no cgroups, no apt-get for
the Debian packages). Its teardown asserts `down` left nothing behind: no process, mount, network
namespace, veth, bridge, iptables chain or cgroup.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev import node as devnode
from gpuobj_dev.cluster import DevCluster
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.waits import wait_until

NODE_UNAVAILABLE = devnode.unavailable_reason()


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[ClusterHandle]:
    if NODE_UNAVAILABLE:
        pytest.skip(NODE_UNAVAILABLE)
    state_dir = Path(tempfile.mkdtemp(prefix="gpuobj-test-node-"))
    cluster = DevCluster(state_dir, tie_to_parent=True, node=True, log=lambda msg: print(f"\n[dev-node] {msg}"))
    started = time.monotonic()
    state = cluster.up(timeout=float(os.environ.get("GPUOBJ_NODE_TIMEOUT", "300")))
    print(f"\n[dev-node] control plane + node (images included) up in {time.monotonic() - started:.0f}s")
    try:
        yield ClusterHandle(cluster, state)
    finally:
        node = cluster.node()
        cluster.down(quiet=True)
        assert node.leftovers() == [], "dev-cluster down left parts of the node behind"


class Pods:
    """kubectl for pods on the node, in one namespace that is deleted afterwards."""

    def __init__(self, cluster: ClusterHandle, namespace: str) -> None:
        self.cluster = cluster
        self.ns = namespace

    def kubectl(self, *args: str, **kw):
        return self.cluster.kubectl("-n", self.ns, *args, **kw)

    def apply(self, *docs: dict) -> None:
        self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))

    def get(self, kind: str, name: str) -> dict:
        return json.loads(self.kubectl("get", kind, name, "-o", "json").stdout)

    def pod(self, name: str) -> dict:
        return self.get("pod", name)

    def ready(self, name: str) -> dict | None:
        pod = self.pod(name)
        conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
        return pod if conditions.get("Ready") == "True" else None

    def wait_ready(self, name: str, timeout: float = 180) -> dict:
        return wait_until(lambda: self.ready(name), f"pod {self.ns}/{name} Ready", timeout=timeout, interval=0.5)

    def logs(self, name: str, container: str | None = None, previous: bool = False) -> str:
        args = ["logs", name, *(["-c", container] if container else []), *(["--previous"] if previous else [])]
        return self.kubectl(*args).stdout

    def restarts(self, name: str) -> int:
        statuses = self.pod(name).get("status", {}).get("containerStatuses", [])
        return sum(s.get("restartCount", 0) for s in statuses)


@pytest.fixture
def pods(node_cluster: ClusterHandle, request: pytest.FixtureRequest) -> Iterator[Pods]:
    name = "node-" + request.node.name.replace("_", "-")[:40].strip("-").lower()
    node_cluster.kubectl("create", "namespace", name)
    yield Pods(node_cluster, name)
    node_cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s")
