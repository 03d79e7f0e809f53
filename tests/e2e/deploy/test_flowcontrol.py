"""The chart's API Priority and Fairness objects on the real API server: they apply, and the API server puts
the operator's requests and the workloads' gpuobj.io requests in the chart's flow schemas (it names the
schema it chose in every response's `X-Kubernetes-PF-FlowSchema-UID` header). Behaviour, not timing.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
import uuid

from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import request_token
from gpuobj_dev.testing.waits import wait_until
from tests.e2e.deploy.support import find, render

FLOWCONTROL_KINDS = ("PriorityLevelConfiguration", "FlowSchema")


def _flow_schema_of(cluster: ClusterHandle, token: str, path: str) -> str:
    """The uid of the flow schema the API server classified this request into (answered or refused)."""
    ctx = ssl.create_default_context(cafile=str(cluster.cluster.pki.ca.cert))
    req = urllib.request.Request(f"{cluster.state.server}{path}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return resp.headers["X-Kubernetes-PF-FlowSchema-UID"]
    except urllib.error.HTTPError as exc:  # a 403 is classified too: APF runs before authorization
        return exc.headers["X-Kubernetes-PF-FlowSchema-UID"]


def test_the_charts_flow_schemas_apply_and_classify_the_operator_and_the_workloads(
    gpuobj_cluster: ClusterHandle,
) -> None:
    k = gpuobj_cluster.kubectl
    suffix = uuid.uuid4().hex[:6]
    release, release_ns, workload_ns = f"apf-{suffix}", f"gpuobj-apf-{suffix}", f"gpuobj-apf-wl-{suffix}"
    docs = [d for d in render(release, release_ns) if d["kind"] in FLOWCONTROL_KINDS]
    assert sorted(d["kind"] for d in docs) == sorted(FLOWCONTROL_KINDS * 2)
    operator_sa = f"{release}-gpuobj-operator"
    objects = [f"{d['kind'].lower()}.flowcontrol.apiserver.k8s.io/{d['metadata']['name']}" for d in docs]
    for ns in (release_ns, workload_ns):
        k("create", "namespace", ns)
    try:
        k("create", "serviceaccount", "-n", release_ns, operator_sa)
        k("create", "serviceaccount", "-n", workload_ns, "trainer")
        k("apply", "--server-side", "--field-manager=gpuobj-deploy-test", "-f", "-",
          input="\n---\n".join(json.dumps(d) for d in docs))  # fmt: skip
        schemas = {d["metadata"]["name"] for d in find(docs, "FlowSchema")}
        assert schemas == {f"{release}-gpuobj-operator", f"{release}-gpuobj-workloads"}

        def uid(name: str) -> str:
            return json.loads(k("get", "flowschema", name, "-o", "json").stdout)["metadata"]["uid"]

        operator_fs, workloads_fs = uid(f"{release}-gpuobj-operator"), uid(f"{release}-gpuobj-workloads")

        def not_dangling() -> bool:
            for name in schemas:
                status = json.loads(k("get", "flowschema", name, "-o", "json").stdout).get("status") or {}
                dangling = [c for c in status.get("conditions", []) if c["type"] == "Dangling"]
                if not dangling or dangling[0]["status"] != "False":
                    return False
            return True

        wait_until(not_dangling, timeout=30, what="the chart's flow schemas name existing priority levels")

        operator_token, _ = request_token(gpuobj_cluster, release_ns, operator_sa)
        workload_token, _ = request_token(gpuobj_cluster, workload_ns, "trainer")
        gpuobjects = f"/apis/gpuobj.io/v1alpha1/namespaces/{workload_ns}/gpuobjects"

        def classified(token: str, path: str, uid: str) -> bool:
            # The API server reads new flow schemas a moment after they are created: wait for it.
            return _flow_schema_of(gpuobj_cluster, token, path) == uid

        # The operator: every request of its ServiceAccount, gpuobj.io or not, in its own schema.
        wait_until(lambda: classified(operator_token, gpuobjects, operator_fs), timeout=30, what="operator's FS")
        assert _flow_schema_of(gpuobj_cluster, operator_token, f"/api/v1/namespaces/{workload_ns}/pods") == operator_fs
        # A workload: its gpuobj.io requests in the workloads' schema, the rest left to the cluster's own.
        wait_until(lambda: classified(workload_token, gpuobjects, workloads_fs), timeout=30, what="workloads' FS")
        other = _flow_schema_of(gpuobj_cluster, workload_token, f"/api/v1/namespaces/{workload_ns}/pods")
        assert other not in (operator_fs, workloads_fs)
    finally:
        k("delete", "--ignore-not-found", *objects)
        k("delete", "namespace", release_ns, workload_ns, "--wait=false")
