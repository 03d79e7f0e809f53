"""gpuobj on real pods: `helm install` of charts/gpuobj with the images built from the Dockerfile, the
operator in its own pod with in-cluster credentials, two workload pods made from
deploy/examples/workload-pod.yaml, and bytes moved by NIXL (UCX over TCP) between pod IPs.

The example is adapted only where a test must (image, pull policy, the program, resources for a 2-core
machine); its identity, token mount, ports, probes and securityContext are used as they are.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from gpuobj_contract import metric_names
from gpuobj_dev import images
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.waits import wait_until
from tests.deploy.support import CHART, DEPLOY
from tests.node.conftest import Pods

pytestmark = [pytest.mark.node, pytest.mark.timeout(2400)]

DRIVER = Path(__file__).with_name("workload_driver.py")
RELEASE = "gpuobj"
SYSTEM_NS = "gpuobj-system"


def chart_values(workload_ns: str) -> dict:
    repository, tag = images.OPERATOR_IMAGE.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "workloads": {"bindings": [{"namespace": workload_ns, "serviceAccounts": ["gpuobj-workload"]}]},
    }


def workload_docs(pod_names: list[str]) -> list[dict]:
    """deploy/examples/workload-pod.yaml: its ServiceAccount and RoleBinding, and one Pod per name."""
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
        out.append(pod)
    return out


class Workload:
    """One workload pod, driven over its test-only HTTP API on the pod IP."""

    def __init__(self, pods: Pods, name: str) -> None:
        self.pods = pods
        self.name = name

    @property
    def ip(self) -> str:
        return self.pods.pod(self.name)["status"]["podIP"]

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
        with urllib.request.urlopen(f"http://{self.ip}:8471/metrics", timeout=10) as r:
            text = r.read().decode()
        found = re.findall(rf"^{metric_names.AGENT_STORE_BYTES}(?:{{[^}}]*}})? (\S+)$", text, flags=re.M)
        return sum(float(v) for v in found)


def gpuobjects(pods: Pods, kind: str = "gpuobjects") -> list[str]:
    return pods.kubectl("get", kind, "-o", "name").stdout.split()


@pytest.fixture
def installed(node_cluster: ClusterHandle, pods: Pods):
    """The chart, installed with the local operator image; uninstalled afterwards."""
    values = Path(pods.cluster.cluster.state_dir) / "e2e-values.yaml"
    values.write_text(yaml.safe_dump(chart_values(pods.ns)))
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
    yield
    node_cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "5m", timeout=400)
    node_cluster.kubectl("delete", "namespace", SYSTEM_NS, "--wait=true", "--timeout=120s")


def test_real_pod_lifecycle(node_cluster: ClusterHandle, pods: Pods, installed: None) -> None:
    system = Pods(node_cluster, SYSTEM_NS)
    (operator_pod,) = system.kubectl("get", "pods", "-o", "name").stdout.split()
    operator_pod = operator_pod.removeprefix("pod/")
    op = system.wait_ready(operator_pod)
    assert op["spec"]["containers"][0]["image"] == images.OPERATOR_IMAGE
    assert op["spec"]["serviceAccountName"] == f"{RELEASE}-operator"

    pods.apply(*workload_docs(["producer", "consumer"]))
    for name in ("producer", "consumer"):
        pods.wait_ready(name, timeout=600)
    producer, consumer = Workload(pods, "producer"), Workload(pods, "consumer")
    print("\n" + node_cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout)

    # put -> share -> adopt -> fetch (NIXL between pod IPs) -> release both -> freed.
    put = producer.call("put", key="w", name="weights", seed=7)
    shared = producer.call("share", key="w", pod="consumer")["shared"]
    consumer.call("adopt", key="w", shared=shared)
    assert consumer.call("fetch", key="w")["digest"] == put["digest"]
    producer.call("release", key="w")
    assert gpuobjects(pods) == ["gpuobject.gpuobj.io/weights"], "the consumer's claim keeps it"
    assert producer.store_bytes() >= put["bytes"]
    consumer.call("release", key="w")
    wait_until(lambda: gpuobjects(pods) == [] and producer.store_bytes() == 0, "weights freed", 120, 0.5)

    # A workload container dies holding a claim: the kubelet restarts it; its claim must not keep bytes.
    put = producer.call("put", key="c", name="checkpoint", seed=8)
    consumer.call("adopt", key="c", shared=producer.call("share", key="c", pod="consumer")["shared"])
    producer.call("release", key="c")
    restarts = pods.restarts("consumer")
    with pytest.raises(OSError):
        consumer.call("exit", code=137)
    wait_until(lambda: pods.restarts("consumer") > restarts, "consumer restarted", 180, 1)
    pods.wait_ready("consumer", timeout=600)
    wait_until(lambda: gpuobjects(pods) == [] and producer.store_bytes() == 0, "the dead holder's object freed", 180, 1)

    # The operator pod is deleted while an object is live: the Deployment recreates it, nothing is freed wrongly.
    put = producer.call("put", key="k", name="kept", seed=9)
    shared = producer.call("share", key="k", pod="consumer")["shared"]
    consumer.call("adopt", key="k", shared=shared)
    system.kubectl("delete", "pod", operator_pod, "--wait=true", "--timeout=120s")
    new_op = wait_until(
        lambda: [p for p in system.kubectl("get", "pods", "-o", "name").stdout.split() if operator_pod not in p],
        "a new operator pod",
        120,
        0.5,
    )[0].removeprefix("pod/")
    system.wait_ready(new_op, timeout=300)
    assert consumer.call("fetch", key="k")["digest"] == put["digest"]
    assert gpuobjects(pods) == ["gpuobject.gpuobj.io/kept"]
    producer.call("release", key="k")
    consumer.call("release", key="k")
    wait_until(lambda: gpuobjects(pods) == [] and producer.store_bytes() == 0, "kept freed", 120, 0.5)
    assert gpuobjects(pods, "gpuobjectclaims") == []
    print(node_cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout)
