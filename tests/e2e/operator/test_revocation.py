"""Revocation within seconds (issue 21): a token whose pod or ServiceAccount is gone is refused by agents.

Before: the API server refused such a token at once ("service account token has been invalidated"),
but agents, verifying offline, accepted it until it expired (200 on read tickets, 599 s left). Agents
now confirm callers' tokens with TokenReview (docs/security.md, Revocation): the probes below read at
an agent with a pod's own token, delete the pod (or its ServiceAccount), and wait (bounded: 5 s) for
the agent to refuse the same token. The operator's token is rotated under the running operator.
"""

from __future__ import annotations

import time

import pytest

from gpuobj_contract import names
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import ProjectedToken
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_dev.testing.waits import wait_until
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object
from tests.e2e.operator.test_security import agent_call

pytestmark = pytest.mark.nixl

REVOKED_WITHIN = 5.0  # seconds: the bound


def _read(endpoint: str, object_id: str, token: str) -> int:
    status, answer = agent_call(endpoint, "POST", f"/v1/objects/{object_id}/reads", token)
    if status == 200:
        # Ends the read early. It may be refused if the token was revoked between the two calls: the
        # read then ends with its lease. What the caller is allowed is judged by the read above.
        agent_call(endpoint, "DELETE", f"/v1/reads/{answer['readId']}", token)
    return status


@pytest.mark.parametrize("deleted", ["pod", "serviceaccount"])
def test_a_token_of_a_deleted_pod_or_serviceaccount_is_refused_within_seconds(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, tmp_path, deleted: str
) -> None:
    src = pods.workload("src")
    src.run("ref = client.put([torch.ones(256)], name='kept')")
    obj = wait_object(
        gpuobj_cluster, namespace, "kept", lambda o: o and (o.get("status") or {}).get("state") == "Ready"
    )
    object_id = obj["spec"]["objectId"]
    # A reader pod of the namespace, with its own ServiceAccount (so that deleting it touches no one else).
    sa = "short-lived"
    gpuobj_cluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
    reader = kube(gpuobj_cluster, lambda k: create_agent_pod(k, namespace, "reader", port=1, service_account=sa))
    token_file = ProjectedToken(gpuobj_cluster, namespace, sa, tmp_path / "reader-token", audience=names.AGENT_AUDIENCE,
                                pod=("reader", reader["metadata"]["uid"]))  # fmt: skip
    token_file.refresh()
    token = token_file.path.read_text()
    endpoint = pods.endpoint("src")
    assert _read(endpoint, object_id, token) == 200
    if deleted == "pod":
        kube(gpuobj_cluster, lambda k: delete_pod(k, namespace, "reader"))
    else:
        gpuobj_cluster.kubectl("delete", "serviceaccount", sa, "-n", namespace)
    gone = time.monotonic()
    status = wait_until(
        lambda: (s := _read(endpoint, object_id, token)) != 200 and s, "the token refused", REVOKED_WITHIN
    )
    print(f"\nrevocation ({deleted} deleted): refused with {status} after {time.monotonic() - gone:.2f} s")
    assert status == 401
    # Other callers are untouched: the source's namespace peers still read, the operator still frees.
    assert _read(endpoint, object_id, pods.agent_token("src").read_text()) == 200
    if deleted == "serviceaccount":
        kube(gpuobj_cluster, lambda k: delete_pod(k, namespace, "reader"))
    src.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "kept", lambda o: o is None)
    agent_http.assert_holds_nothing(endpoint, pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_the_operators_token_rotates_under_the_running_operator(
    gpuobj_cluster: ClusterHandle, namespace: str, operator_identity, operator: OperatorProcess, pods: Pods
) -> None:
    """The chart's operator token lives 600 s (the kubelet's minimum) and is renewed at 80%: the operator
    re-reads it on every call, so frees keep working across a rotation, with the new token only."""
    src = pods.workload("src")
    src.run("a = client.put([torch.ones(64)], name='before')")
    wait_object(gpuobj_cluster, namespace, "before", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    old = operator_identity.agent_token.read_text()
    agent_token = next(t for t in operator_identity.tokens if t.path == operator_identity.agent_token)
    agent_token.refresh()  # what the kubelet does at 80% of the token's life
    assert operator_identity.agent_token.read_text() != old
    src.run("a.release()")
    wait_object(gpuobj_cluster, namespace, "before", lambda o: o is None)  # freed by the operator, new token
    src.run("b = client.put([torch.ones(64)], name='after')")
    wait_object(gpuobj_cluster, namespace, "after", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    src.run("b.release()")
    wait_object(gpuobj_cluster, namespace, "after", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)
