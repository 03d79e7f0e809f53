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
from tests.conftest import failed

NODE_UNAVAILABLE = devnode.unavailable_reason()


def dump_cluster(cluster: ClusterHandle, why: str) -> None:
    """Print what a reader of a failed node test needs, before teardown removes it: every pod (wide), the
    CSRs, `kubectl describe` of each pod outside kube-system and the logs of each of its containers (the
    previous run's too, after a restart), and the namespaces' Events. Best effort: a dump never fails a test."""

    def run(*args: str) -> str:
        try:
            proc = cluster.kubectl(*args, check=False, timeout=60)
        except Exception as exc:  # a dump must not hide the failure it explains
            return f"(kubectl {' '.join(args)}: {exc})"
        return proc.stdout + (f"\n(stderr) {proc.stderr}" if proc.returncode else "")

    out = [f"===== node cluster dump: {why} ====="]
    out += ["--- kubectl get pods -A -o wide", run("get", "pods", "-A", "-o", "wide")]
    out += ["--- kubectl get csr", run("get", "csr")]
    try:
        listed = json.loads(cluster.kubectl("get", "pods", "-A", "-o", "json", check=False, timeout=60).stdout or "{}")
    except Exception as exc:
        listed = {}
        out.append(f"(listing pods: {exc})")
    namespaces: set[str] = set()
    for pod in listed.get("items", []):
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        if ns == "kube-system":
            continue
        namespaces.add(ns)
        out += [f"--- kubectl -n {ns} describe pod {name}", run("-n", ns, "describe", "pod", name)]
        statuses = pod.get("status", {}).get("containerStatuses", [])
        for c in pod["spec"].get("containers", []):
            out += [f"--- logs {ns}/{name} -c {c['name']}", run("-n", ns, "logs", name, "-c", c["name"], "--tail=300")]
            if any(s["name"] == c["name"] and s.get("restartCount", 0) for s in statuses):
                out += [f"--- previous logs {ns}/{name} -c {c['name']}"]
                out.append(run("-n", ns, "logs", name, "-c", c["name"], "--previous", "--tail=300"))
    for ns in sorted(namespaces):
        out += [f"--- events in {ns}", run("-n", ns, "get", "events", "--sort-by=.lastTimestamp")]
    print("\n" + "\n".join(out) + f"\n===== end of dump: {why} =====", flush=True)


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


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A node test that failed prints the cluster's pods, their logs and Events (see dump_cluster)."""
    yield
    if failed(request) and "node_cluster" in request.fixturenames:
        dump_cluster(request.getfixturevalue("node_cluster"), f"{request.node.nodeid} failed")


@pytest.fixture
def pods(node_cluster: ClusterHandle, request: pytest.FixtureRequest) -> Iterator[Pods]:
    name = "node-" + request.node.name.replace("_", "-")[:40].strip("-").lower()
    node_cluster.kubectl("create", "namespace", name)
    yield Pods(node_cluster, name)
    node_cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s")
