"""The live view end to end (docs/live-view.md): the real API server's aggregator proxies `kubectl get
liveobjects` to the operator, which authenticates the front proxy, asks a SubjectAccessReview for the user,
and lists what the namespace's agents hold, recorded or not.

The operator runs as its ServiceAccount with the chart's live-view bindings (rendered by helm); the
APIService is the chart's, pointed at the operator process through a Service with hand-made endpoints
(no kube-proxy and no kubelet here: the aggregator routes to endpoint IPs)."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev.pki import DevPKI
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import OPERATOR_SA
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_dev.testing.workload import free_port
from tests.conftest import failed
from tests.e2e.deploy.support import find, one, render
from tests.e2e.operator.conftest import Pods, start_operator

pytestmark = pytest.mark.nixl

SERVICE = "gpuobj-live-view"
APISERVICE = "v1alpha1.live.gpuobj.io"
LONG_WINDOW = {"GPUOBJ_WRITE_WINDOW": "3600"}  # kept unrecorded for the whole test: only the live view shows it


def host_ip() -> str:
    """An address of this machine the API server can dial that Endpoints accept (not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        return str(s.getsockname()[0])


def apply(cluster: ClusterHandle, docs: list[dict]) -> None:
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))


def chart_objects(namespace: str, suffix: str) -> list[dict]:
    """The chart's live-view RBAC, for the test's operator ServiceAccount; cluster-wide names made unique."""
    docs = render(values={"liveView": {"enabled": True}})
    rbac = [
        *find(docs, "ClusterRoleBinding", "t-gpuobj-operator-live-view:auth-delegator"),
        *find(docs, "RoleBinding", "t-gpuobj-operator-live-view:auth-reader"),
        *find(docs, "ClusterRole", "t-gpuobj-operator-live-view:reader"),
    ]
    assert len(rbac) == 3, [d["metadata"]["name"] for d in rbac]
    for d in rbac:
        d["metadata"]["name"] += f"-{suffix}"
        d["metadata"]["labels"] = {}  # the test's reader role is bound by hand, not aggregated
        for s in d.get("subjects", ()):
            s.update(name=OPERATOR_SA, namespace=namespace)
    return rbac


@pytest.fixture
def live_view(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, namespace: str, token_file: Path, tmp_path: Path
) -> Iterator[str]:
    """The operator serving the live view, registered with the API server's aggregator; yields the
    name of the chart's reader ClusterRole."""
    suffix = uuid.uuid4().hex[:8]
    rbac = chart_objects(namespace, suffix)
    apply(gpuobj_cluster, rbac)
    ip, port = host_ip(), free_port()
    pki = DevPKI(tmp_path / "live-view-pki")
    pki.create()
    pair = pki.issue("serving", SERVICE, server_names=(f"{SERVICE}.{namespace}.svc",), server_ips=(ip,))
    cert_dir = tmp_path / "live-view-cert"
    cert_dir.mkdir()
    shutil.copy(pair.cert, cert_dir / "tls.crt")
    shutil.copy(pair.key, cert_dir / "tls.key")
    op: OperatorProcess = start_operator(
        gpuobj_cluster,
        token_file,
        namespace,
        extra=["--live-view-port", str(port), "--live-view-cert-dir", str(cert_dir)],
    ).wait_ready()
    chart_apiservice = one(render(values={"liveView": {"enabled": True}}), "APIService", APISERVICE)
    chart_apiservice["metadata"]["labels"] = {"gpuobj.io/test": suffix}
    chart_apiservice["spec"]["service"] = {"name": SERVICE, "namespace": namespace, "port": 443}
    chart_apiservice["spec"]["caBundle"] = base64.b64encode(pki.ca.cert.read_bytes()).decode()
    meta = {"name": SERVICE, "namespace": namespace}
    apply(
        gpuobj_cluster,
        [
            {"apiVersion": "v1", "kind": "Service", "metadata": meta,
             "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}]}},
            {"apiVersion": "v1", "kind": "Endpoints", "metadata": meta,
             "subsets": [{"addresses": [{"ip": ip}], "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}]},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {**meta, "labels": {"kubernetes.io/service-name": SERVICE}},
             "addressType": "IPv4", "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
             "ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
            chart_apiservice,
        ],
    )  # fmt: skip
    try:
        gpuobj_cluster.kubectl("wait", "--for=condition=Available", f"apiservice/{APISERVICE}", "--timeout=60s")
        yield rbac[2]["metadata"]["name"]
    finally:
        if failed(request):
            print(gpuobj_cluster.kubectl("get", "apiservice", APISERVICE, "-o", "yaml", check=False).stdout)
            print(f"\n--- operator output ---\n{op.output()}")
        # First the APIService: an unavailable one would block every later test's namespace deletion.
        gpuobj_cluster.kubectl("delete", "apiservice", APISERVICE, "--wait=true", check=False)
        for d in rbac:
            if d["kind"] != "RoleBinding":
                gpuobj_cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], check=False)
        gpuobj_cluster.kubectl("delete", "rolebinding", "-n", "kube-system", rbac[1]["metadata"]["name"], check=False)
        rc = op.stop()
        assert rc == 0, f"operator exited {rc}:\n{op.output()}"


def test_a_namespace_reader_sees_an_unrecorded_object_and_others_are_refused(
    gpuobj_cluster: ClusterHandle, namespace: str, live_view: str, pods: Pods
) -> None:
    reader, stranger = f"alice-{namespace}", f"bob-{namespace}"
    gpuobj_cluster.kubectl(
        "create", "rolebinding", "live-reader", "-n", namespace, f"--clusterrole={live_view}", f"--user={reader}"
    )
    src = pods.workload("src", LONG_WINDOW)
    src.run("ref = client.put([torch.ones(1 << 14)], name='young')")  # 64 KiB, inside the write window
    assert src.eval("ref.pending") is True  # not a GPUObject: only the agent's inventory knows it
    object_id = src.eval("ref.address.object_id")
    assert gpuobj_cluster.kubectl("get", "gpuobjects", "-n", namespace, "-o", "name").stdout.strip() == ""

    def listed() -> list[str] | None:
        out = gpuobj_cluster.kubectl("--as", reader, "get", "liveobjects", "-n", namespace, "--no-headers").stdout
        rows = [line.split() for line in out.splitlines()]
        return next((row for row in rows if row[0] == f"src.{object_id}"), None)

    row = wait_until(listed, "the live view to list the unrecorded object", timeout=30, interval=0.2)
    name, pod, size, holders, state = row[:5]
    # Queued in the client's write-behind, no GPUObject: "pending", and the Recorded column is empty.
    assert (pod, size, holders, state, len(row)) == ("src", str(4 << 14), "1", "pending", 6), row
    got = json.loads(
        gpuobj_cluster.kubectl("--as", reader, "get", "liveobjects", name, "-n", namespace, "-o", "json").stdout
    )
    assert got["status"]["bytes"] == 4 << 14 and got["status"]["pod"] == "src"
    paged = gpuobj_cluster.kubectl(
        "--as", reader, "get", "liveobjects", "-n", namespace, "--chunk-size=1", "-o", "name"
    )
    assert f"livegpuobject.live.gpuobj.io/{name}" in paged.stdout.split()

    refused = gpuobj_cluster.kubectl("--as", stranger, "get", "liveobjects", "-n", namespace, check=False)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr
    everywhere = gpuobj_cluster.kubectl("--as", reader, "get", "liveobjects", "-A", check=False)
    assert everywhere.returncode != 0 and "Forbidden" in everywhere.stderr, everywhere.stderr  # no cluster-wide grant
