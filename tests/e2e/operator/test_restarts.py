"""Restart safety: an operator killed mid-free, and an agent that restarts, lose nothing and free nothing twice."""

from __future__ import annotations

import json

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from tests.e2e.operator.conftest import Pods, start_operator
from tests.e2e.operator.test_lifecycle import assert_api_empty, state, wait_object

pytestmark = pytest.mark.nixl


def _agent_post(endpoint: str, path: str, token_file, method: str = "POST", body: dict | None = None) -> dict:
    status, answer = agent_http.request(
        endpoint,
        method,
        path,
        token=token_file.read_text().strip(),
        body=json.dumps(body or {}).encode(),
        headers=agent_http.meant_for(endpoint),
    )
    assert status < 300, (path, status, answer)
    return json.loads(answer or b"{}")


def test_operator_killed_in_the_middle_of_a_free_frees_exactly_once_after_restart(
    gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, token_file
) -> None:
    # The first operator runs before the pod starts: a TLS agent waits for its signer's certificate.
    first = start_operator(gpuobj_cluster, token_file, namespace, identity="op-a").wait_ready()
    src = pods.workload("src")
    # Flushed: the GPUObject is recorded, so the release is the operator's free (an unrecorded one is freed
    # by the pod itself, without the operator).
    src.run("ref = client.put([torch.ones(1 << 16)], name='weights'); client.flush(); oid = ref.address.object_id")
    object_id = src.eval("oid")
    # A reader is mid-transfer: the agent's free must wait for it, which holds the operator inside the free.
    # (A read is a pod's act: the test reads with the pod's own token, and over TLS its certificate.)
    reader_token = pods.agent_token("src")
    read = _agent_post(pods.endpoint("src"), f"/v1/objects/{object_id}/reads", reader_token, body={"reader": "test"})
    try:
        src.run("ref.release()")
        first.wait_for_line(r"freeing .*weights", timeout=30)
        first.kill()  # SIGKILL while the free is in flight
    finally:
        first.kill()
    _agent_post(pods.endpoint("src"), f"/v1/reads/{read['readId']}", reader_token, method="DELETE")
    second = start_operator(gpuobj_cluster, token_file, namespace, identity="op-b").wait_ready()
    try:
        wait_object(gpuobj_cluster, namespace, "weights", lambda o: o is None)
        # Exactly one effective free on the agent; a repeated one is a no-op, never an error
        # (owner-side metadata GC, docs/design.md).
        assert agent_http.metric(pods.endpoint("src"), "gpuobj_agent_frees_total", {"result": "freed"}) == 1
        agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
        assert_api_empty(gpuobj_cluster, namespace)
    finally:
        assert second.stop() == 0, second.output()


def test_agent_restart_is_reconciled_by_the_audit(
    gpuobj_cluster: ClusterHandle, namespace: str, pods: Pods, token_file, operator
) -> None:
    src = pods.workload("src")
    src.run("ref = client.put([torch.ones(256)], name='kv-cache')")
    wait_object(gpuobj_cluster, namespace, "kv-cache", lambda o: state(o) == "Ready")
    pods.restart_process("src")  # same pod, new agent incarnation: the bytes are gone
    lost = wait_object(gpuobj_cluster, namespace, "kv-cache", lambda o: o is None or state(o) == "Lost")
    if lost is not None:
        reasons = {c["type"]: c["reason"] for c in lost["status"]["conditions"]}
        # The probe sees the new process first (its record names the old one); the audit is the backstop.
        assert reasons["SourceAvailable"] in ("SourceAgentRestarted", "AgentLostObject")
    # Nothing claims it: the Lost object is cleaned up without a free.
    wait_object(gpuobj_cluster, namespace, "kv-cache", lambda o: o is None)
    # Exactly once: where the status write turns it Lost (the audit used to count it a second time).
    operator.wait_metric("gpuobj_lost_objects_total", None, 1)
    assert operator.metric("gpuobj_lost_objects_total") == 1
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)
