"""The dev node runs real pods: pod IPs on the bridge, downward API, projected ServiceAccount tokens
used against the API server from inside a pod, probes, and restarts of failed containers.
"""

from __future__ import annotations

import ipaddress
import json

import pytest

from gpuobj_dev import images
from gpuobj_dev import node as devnode
from gpuobj_dev.testing.waits import wait_until
from tests.e2e.node.conftest import Pods

pytestmark = [pytest.mark.node, pytest.mark.timeout(1800)]

RESTRICTED = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# In-cluster, as any client library does it: KUBERNETES_SERVICE_HOST, the projected token and CA.
WHOAMI = """
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode()
req = urllib.request.Request(url + "/apis/authentication.k8s.io/v1/selfsubjectreviews", data=body, method="POST",
    headers={"Authorization": "Bearer " + open(f"{sa}/token").read(), "Content-Type": "application/json"})
user = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))["status"]["userInfo"]
print(json.dumps({"user": user["username"], "ip": os.environ["MY_IP"], "uid": os.environ["MY_UID"]}), flush=True)
import time; time.sleep(86400)
"""


def pod(name: str, args: list[str], **container) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "securityContext": RESTRICTED,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": images.OPERATOR_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c"],
                    "args": args,
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    **container,
                }
            ],
        },
    }


def test_pod_ip_downward_api_and_projected_token(pods: Pods) -> None:
    env = [
        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MY_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    pods.apply(pod("whoami", [WHOAMI], env=env))
    running = wait_until(
        lambda: pods.pod("whoami")["status"].get("podIP") and pods.logs("whoami").strip(),
        "whoami to print",
        timeout=180,
        interval=0.5,
    )
    seen = json.loads(running.splitlines()[0])
    status = pods.pod("whoami")
    assert ipaddress.ip_address(seen["ip"]) in ipaddress.ip_network(devnode.POD_SUBNET)
    assert seen["ip"] == status["status"]["podIP"]
    assert seen["uid"] == status["metadata"]["uid"]
    assert seen["user"] == f"system:serviceaccount:{pods.ns}:default"


def test_probes_gate_readiness_and_failed_containers_restart(pods: Pods) -> None:
    serve = "import http.server as h; h.HTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()"
    probe = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}
    pods.apply(
        pod("served", [serve], readinessProbe=probe, workingDir="/opt"),
        # Liveness fails at once (nothing listens): the kubelet kills and restarts the container.
        pod("unlive", ["import time; time.sleep(86400)"], livenessProbe={**probe, "failureThreshold": 1}),
        pod("crashes", ["raise SystemExit(3)"]),
        # Running, but its readiness probe never succeeds: never Ready.
        pod("unready", ["import time; time.sleep(86400)"], readinessProbe=probe),
    )
    pods.wait_ready("served")
    wait_until(lambda: pods.restarts("unlive") >= 1, "the liveness probe to restart unlive", timeout=180, interval=1)
    wait_until(lambda: pods.restarts("crashes") >= 1, "crashes to be restarted", timeout=180, interval=1)
    last = pods.pod("crashes")["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 3
    unready = pods.pod("unready")["status"]
    assert unready["phase"] == "Running"
    assert unready["containerStatuses"][0]["ready"] is False
