"""gpuobj on real pods: `helm install` of charts/gpuobj with the images built from the Dockerfile, the
operator in its own pod with in-cluster credentials, two workload pods made from
deploy/examples/workload-pod.yaml, and bytes moved by NIXL (UCX over TCP) between pod IPs.

The example is adapted only where a test must (image, pull policy, the program, resources for a 2-core
machine); its identity, token mount, ports, probes and securityContext are used as they are.
"""

from __future__ import annotations

import base64
import copy
import http.client
import json
import re
import socket
import ssl
import urllib.request
from pathlib import Path

import pytest
import yaml

from gpuobj_contract import agent_tls, metric_names
from gpuobj_dev import images
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.waits import wait_until
from tests.e2e.deploy.support import CHART, DEPLOY
from tests.e2e.node.conftest import Pods, dump_cluster

pytestmark = [pytest.mark.node, pytest.mark.timeout(1200)]

DRIVER = Path(__file__).with_name("workload_driver.py")
RELEASE = "gpuobj"
SYSTEM_NS = "gpuobj-system"
AGENT_PORT = 8471  # the container port named gpuobj-agent in the example


def chart_values(workload_ns: str, *, tls: bool = True) -> dict:
    """The chart's values for these tests; TLS to agents as asked (on: the chart's default)."""
    repository, tag = images.OPERATOR_IMAGE.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "workloads": {"bindings": [{"namespace": workload_ns, "serviceAccounts": ["gpuobj-workload"]}]},
        "agentTLS": {"enabled": tls},
    }


def workload_docs(pod_names: list[str], *, tls: bool = True) -> list[dict]:
    """deploy/examples/workload-pod.yaml: its ServiceAccount and RoleBinding, and one Pod per name (with TLS
    off, its agent serves plain HTTP and its probes say so)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "workload-pod.yaml").read_text()) if d]
    example = next(d for d in docs if d["kind"] == "Pod")
    out = [d for d in docs if d["kind"] != "Pod"]
    for name in pod_names:
        pod = copy.deepcopy(example)
        pod["metadata"]["name"] = name
        pod["spec"]["terminationGracePeriodSeconds"] = 5
        (container,) = pod["spec"]["containers"]
        container["image"] = images.AGENT_IMAGE
        container["imagePullPolicy"] = "Never"
        container["args"] = [DRIVER.read_text()]
        container["ports"].append({"name": "test-driver", "containerPort": 9000})
        container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}}
        if not tls:
            for env in container["env"]:
                if env["name"] == "GPUOBJ_AGENT_TLS":
                    env["value"] = "off"
            for probe in ("readinessProbe", "livenessProbe"):
                container[probe]["httpGet"]["scheme"] = "HTTP"
        out.append(pod)
    return out


class _VerifiedHTTPS(http.client.HTTPSConnection):
    """HTTPS to an IP that verifies the certificate for another name (the agent's pod DNS name)."""

    def __init__(self, ip: str, port: int, server_hostname: str, context: ssl.SSLContext) -> None:
        super().__init__(ip, port, timeout=10, context=context)
        self.server_hostname = server_hostname

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.server_hostname)  # type: ignore[attr-defined]


class Workload:
    """One workload pod, driven over its test-only HTTP API on the pod IP."""

    def __init__(self, pods: Pods, name: str) -> None:
        self.pods = pods
        self.name = name

    @property
    def ip(self) -> str:
        return self.pods.pod(self.name)["status"]["podIP"]

    def agent_get(self, path: str) -> bytes:
        """GET on this pod's agent port as the example's probes do: HTTPS when its agent serves TLS (then the
        certificate is verified against the chart's agent CA, for the name `<pod uid>.pod.gpuobj.io`)."""
        pod = self.pods.pod(self.name)
        (container,) = pod["spec"]["containers"]
        mode = next((e.get("value") for e in container["env"] if e["name"] == "GPUOBJ_AGENT_TLS"), "off")
        ip = pod["status"]["podIP"]
        if mode == "off":
            conn: http.client.HTTPConnection = http.client.HTTPConnection(ip, AGENT_PORT, timeout=10)
        else:
            ca = base64.b64decode(
                Pods(self.pods.cluster, SYSTEM_NS).get("secret", f"{RELEASE}-{agent_tls.CA_SECRET_SUFFIX}")["data"][
                    "tls.crt"
                ]
            )
            name = agent_tls.pod_dns_name(pod["metadata"]["uid"])
            conn = _VerifiedHTTPS(ip, AGENT_PORT, name, ssl.create_default_context(cadata=ca.decode()))
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200, f"GET {path} at {self.name}'s agent: {r.status} {body[:300]!r}"
            return body
        finally:
            conn.close()

    def call(self, op: str, **args) -> dict:
        req = urllib.request.Request(
            f"http://{self.ip}:9000/{op}", data=json.dumps(args).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{self.name} {op} failed: {e.read().decode()}") from None

    def store_bytes(self) -> float:
        text = self.agent_get("/metrics").decode()
        found = re.findall(rf"^{metric_names.AGENT_STORE_BYTES}(?:{{[^}}]*}})? (\S+)$", text, flags=re.M)
        return sum(float(v) for v in found)


def gpuobjects(pods: Pods, kind: str = "gpuobjects") -> list[str]:
    return pods.kubectl("get", kind, "-o", "name").stdout.split()


@pytest.fixture(scope="module")
def e2e(node_cluster: ClusterHandle):
    """The chart installed with the local operator image, and the producer and consumer workload pods.

    Teardown in the order a careful operator would: workload pods first (their claims are garbage-collected
    and the operator frees what they held), then `helm uninstall`, then the namespaces."""
    ns = "gpuobj-e2e"
    node_cluster.kubectl("create", "namespace", ns)
    pods = Pods(node_cluster, ns)
    values = Path(node_cluster.cluster.state_dir) / "e2e-values.yaml"
    values.write_text(yaml.safe_dump(chart_values(ns)))
    node_cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NS,
        "--create-namespace",
        "-f",
        str(values),
        "--wait",
        "--timeout",
        "10m",
        timeout=700,
    )
    try:
        try:
            pods.apply(*workload_docs(["producer", "consumer"]))
            for name in ("producer", "consumer"):
                pods.wait_ready(name, timeout=600)
        except BaseException:
            dump_cluster(node_cluster, "the workload pods did not become Ready")
            raise
        print("\n" + node_cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout)
        yield pods
    finally:
        pods.kubectl("delete", "pod", "producer", "consumer", "--ignore-not-found", "--wait=true", "--timeout=120s")
        wait_until(lambda: gpuobjects(pods) == [], "every GPUObject freed once its pods are gone", 120, 0.5)
        node_cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "5m", timeout=400)
        node_cluster.kubectl("delete", "namespace", SYSTEM_NS, ns, "--wait=true", "--timeout=120s")


def operator_pod(cluster: ClusterHandle) -> str:
    (name,) = Pods(cluster, SYSTEM_NS).kubectl("get", "pods", "-o", "name").stdout.split()
    return name.removeprefix("pod/")


def test_operator_pod_runs_with_in_cluster_credentials(node_cluster: ClusterHandle, e2e: Pods) -> None:
    system = Pods(node_cluster, SYSTEM_NS)
    op = system.wait_ready(operator_pod(node_cluster))
    assert op["spec"]["containers"][0]["image"] == images.OPERATOR_IMAGE
    assert op["spec"]["serviceAccountName"] == f"{RELEASE}-operator"
    # Ready means leading and synced: it reached the API server from the pod with its ServiceAccount token.
    lease = system.get("lease", f"{RELEASE}-operator")
    assert lease["spec"]["holderIdentity"].startswith(op["metadata"]["name"])


def test_put_share_fetch_release_between_pod_ips(node_cluster: ClusterHandle, e2e: Pods) -> None:
    producer, consumer = Workload(e2e, "producer"), Workload(e2e, "consumer")
    put = producer.call("put", key="w", name="weights", seed=7)
    shared = producer.call("share", key="w", pod="consumer")["shared"]
    consumer.call("adopt", key="w", shared=shared)
    assert consumer.call("fetch", key="w")["digest"] == put["digest"]  # NIXL, UCX over TCP, pod IP to pod IP
    producer.call("flush")
    producer.call("release", key="w")
    producer.call("flush")
    assert gpuobjects(e2e) == ["gpuobject.gpuobj.io/weights"], "the consumer's claim keeps it"
    assert producer.store_bytes() >= put["bytes"]
    consumer.call("release", key="w")
    wait_until(lambda: gpuobjects(e2e) == [] and producer.store_bytes() == 0, "weights freed", 120, 0.5)
    assert gpuobjects(e2e, "gpuobjectclaims") == []


def test_operator_pod_deleted_while_objects_live(node_cluster: ClusterHandle, e2e: Pods) -> None:
    """The Deployment recreates the operator; nothing referenced is freed, and frees work afterwards."""
    producer, consumer = Workload(e2e, "producer"), Workload(e2e, "consumer")
    system = Pods(node_cluster, SYSTEM_NS)
    put = producer.call("put", key="k", name="kept", seed=9)
    consumer.call("adopt", key="k", shared=producer.call("share", key="k", pod="consumer")["shared"])
    producer.call("flush")
    old = operator_pod(node_cluster)
    system.kubectl("delete", "pod", old, "--wait=true", "--timeout=120s")
    new = wait_until(
        lambda: [p for p in system.kubectl("get", "pods", "-o", "name").stdout.split() if old not in p],
        "a new operator pod",
        120,
        0.5,
    )[0].removeprefix("pod/")
    system.wait_ready(new, timeout=300)
    assert consumer.call("fetch", key="k")["digest"] == put["digest"]
    assert gpuobjects(e2e) == ["gpuobject.gpuobj.io/kept"]
    producer.call("release", key="k")
    consumer.call("release", key="k")
    wait_until(lambda: gpuobjects(e2e) == [] and producer.store_bytes() == 0, "kept freed", 120, 0.5)
    assert gpuobjects(e2e, "gpuobjectclaims") == []
    print("\n" + node_cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout)


def test_killed_workload_container_gives_up_its_claims(node_cluster: ClusterHandle, e2e: Pods) -> None:
    """The consumer's process dies holding a claim the producer shared without naming the consumer's
    process; the kubelet restarts the container in the same pod (same UID, so ownerReference garbage
    collection does not apply). The operator scoped the share to the consumer process alive when it was
    made, so the dead process's claim goes (HolderGone) and the bytes are freed."""
    producer, consumer = Workload(e2e, "producer"), Workload(e2e, "consumer")
    producer.call("put", key="c", name="checkpoint", seed=8)
    consumer.call("adopt", key="c", shared=producer.call("share", key="c", pod="consumer")["shared"])
    producer.call("release", key="c")
    producer.call("flush")
    restarts = e2e.restarts("consumer")
    with pytest.raises(OSError):
        consumer.call("exit", code=137)
    wait_until(lambda: e2e.restarts("consumer") > restarts, "consumer restarted", 180, 1)
    e2e.wait_ready("consumer", timeout=600)
    wait_until(lambda: gpuobjects(e2e) == [] and producer.store_bytes() == 0, "the dead holder's object freed", 60, 1)
    assert gpuobjects(e2e, "gpuobjectclaims") == []
