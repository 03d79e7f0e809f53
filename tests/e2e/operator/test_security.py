"""Issue 11's probes against the real control plane, as a compromised workload pod would run them.

Each runs as the attacker's own identity (its pod-bound ServiceAccount token, the chart's workload
role) and asserts the refusal and that nothing changed: the victim's object is still there and
still readable, and everything is released at the end.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gpuobj_contract import metric_names as m
from gpuobj_contract import names
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import WORKLOAD_SA, install_identities, request_token, write_token_kubeconfig
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod, delete_pod
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, ApiError, KubeClient
from gpuobj_kube.config import from_kubeconfig
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl


def as_pod(pods: Pods, name: str, fn):
    """Run ``await fn(client)`` with the API credentials of pod ``name`` (its bound ServiceAccount token)."""

    async def go():
        async with KubeClient(from_kubeconfig(pods.credentials[name].kubeconfig)) as client:
            return await fn(client)

    return asyncio.run(go())


def refused(pods: Pods, name: str, fn) -> ApiError:
    try:
        as_pod(pods, name, fn)
    except ApiError as exc:
        return exc
    raise AssertionError("the API server accepted it")


def agent_call(endpoint: str, method: str, path: str, token: str, headers: dict | None = None) -> tuple[int, dict]:
    """A request with ``token``; over TLS with a certificate of the identity the token names, as its holder
    would present it, so that the authorization behind the channel binding is what answers."""
    status, answer = agent_http.request(
        endpoint,
        method,
        path,
        token=token,
        body=b"{}" if method != "GET" else None,
        headers=agent_http.meant_for(endpoint) if headers is None else headers,  # headers={}: names no pod
    )
    return status, json.loads(answer or b"{}")


def object_of(pods: Pods, cluster: ClusterHandle, namespace: str) -> dict:
    victim = pods.workload("victim")
    victim.run("ref = client.put([torch.arange(1024, dtype=torch.float32)], name='secret')")
    return wait_object(cluster, namespace, "secret", lambda o: o and (o.get("status") or {}).get("state") == "Ready")


def test_a_workload_cannot_record_or_claim_for_another_pod(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    victim_obj = object_of(pods, gpuobj_cluster, namespace)
    pods.workload("attacker")
    spec = victim_obj["spec"]
    # Probe: a namespace peer copies the victim's objectId and source into a new GPUObject (to delete it and
    # have the real object freed). Admission refuses: the source is not the requesting pod.
    copy = {"metadata": {"name": "copy"}, "spec": {"source": spec["source"], "objectId": spec["objectId"],
                                                    "tensors": spec["tensors"]}}  # fmt: skip
    exc = refused(pods, "attacker", lambda k: k.create(GPUOBJECTS, copy, namespace))
    assert exc.status in (403, 422) and "source" in exc.message, exc
    # Probe: a declared object naming the victim as source (its agent would allocate 256 MiB).
    big = {"metadata": {"name": "big"}, "spec": {"source": {"podName": "victim"}, "objectId": "o-big",
                                                  "tensors": [{"shape": [1 << 26], "dtype": "float32"}]}}  # fmt: skip
    assert refused(pods, "attacker", lambda k: k.create(GPUOBJECTS, big, namespace)).status in (403, 422)
    # Probe: a claim for another pod, or owned by another pod, without being the sharer.
    victim_uid = pods.uids["victim"]
    for meta, holder in (
        ({"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "victim", "uid": victim_uid}]}, "victim"),
        ({"annotations": {names.ANNOTATION_SHARED_BY: "victim"}}, "victim"),
    ):
        claim = {"metadata": {"name": "c", **meta}, "spec": {"objectName": "secret", "holder": {"podName": holder}}}
        assert refused(pods, "attacker", lambda k, c=claim: k.create(CLAIMS, c, namespace)).status in (403, 422)
    # A ServiceAccount token not bound to a pod (what `kubectl create token` gives) records nothing at all.
    token, _ = request_token(gpuobj_cluster, namespace, WORKLOAD_SA)
    unbound = Path(pods.credentials["attacker"].kubeconfig).with_name("unbound-token")
    unbound.write_text(token)
    config = from_kubeconfig(
        write_token_kubeconfig(gpuobj_cluster, unbound, unbound.with_name("unbound.kubeconfig"), namespace)
    )

    async def create_unbound():
        async with KubeClient(config) as k:
            own = {**copy, "spec": {**copy["spec"], "source": {"podName": "attacker"}}}
            await k.create(GPUOBJECTS, own, namespace)

    with pytest.raises(ApiError, match="bound"):
        asyncio.run(create_unbound())
    # The documented paths still work as the same identities: the victim shares with the attacker pod.
    shared = pods.workloads["victim"].eval_pickle("client.share(ref, 'attacker')")
    reader = pods.workloads["attacker"]
    reader.run(f"got = client.adopt(load_pickle({shared!r}))")
    assert reader.eval("float(client.fetch(got)[0].sum())") == float(sum(range(1024)))
    # Nothing changed for the victim; then everything is released.
    assert wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is not None)["spec"] == spec
    reader.run("got.release()")
    pods.workloads["victim"].run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("victim"), pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_workload_token_cannot_act_as_the_operator_and_another_namespace_cannot_read(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    victim_obj = object_of(pods, gpuobj_cluster, namespace)
    object_id = victim_obj["spec"]["objectId"]
    pods.workload("peer")
    peer_token = pods.agent_token("peer").read_text()
    endpoint = pods.endpoint("victim")
    # Probe 1: a workload's own token at a pod's agent: inventory, free, materialize are the operator's.
    for method, path in (("GET", "/v1/objects"), ("POST", f"/v1/objects/{object_id}/free"),
                         ("POST", "/v1/streams/s/free")):  # fmt: skip
        status, answer = agent_call(endpoint, method, path, peer_token)
        assert status == 403 and "not the gpuobj operator" in answer["error"], (path, status, answer)
    # Issue 21: the operator's token replayed at an agent without naming its pod (200 and `freed: true`
    # before), or naming another pod: 409, before the token is looked at, and the answer names no uid.
    operator_token = pods.token_file.read_text()
    for headers in ({}, {names.HEADER_POD_UID: pods.uids["peer"]}):
        for method, path in (("GET", "/v1/objects"), ("POST", f"/v1/objects/{object_id}/free")):
            status, answer = agent_call(endpoint, method, path, operator_token, headers)
            assert status == 409 and pods.uids["victim"] not in answer["error"], (path, headers, status, answer)
    # A pod of another namespace (its own bound token there) cannot read it.
    other = f"{namespace}-b"
    gpuobj_cluster.create_namespace(other)
    try:
        gpuobj_cluster.kubectl("create", "serviceaccount", WORKLOAD_SA, "-n", other)

        async def make_pod():
            async with gpuobj_cluster.client() as k:
                return await create_agent_pod(k, other, "thief", port=1, service_account=WORKLOAD_SA)

        thief = asyncio.run(make_pod())
        token, _ = request_token(
            gpuobj_cluster, other, WORKLOAD_SA, audience=names.AGENT_AUDIENCE, pod=("thief", thief["metadata"]["uid"])
        )
        status, answer = agent_call(endpoint, "POST", f"/v1/objects/{object_id}/reads", token)
        assert status == 403 and "may not read" in answer["error"], answer
        assert "metadata" not in answer
    finally:
        gpuobj_cluster.kubectl("delete", "namespace", other, "--wait=false")
    # The victim's object is untouched and still readable by its namespace.
    inventory = agent_http.inventory(endpoint, pods.token_file)
    assert [o["id"] for o in inventory["objects"]] == [object_id]
    assert [o["inflightReads"] for o in inventory["objects"]] == [0]
    pods.workloads["victim"].run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is None)
    agent_http.assert_holds_nothing(endpoint, pods.token_file)


def test_a_pod_pointing_at_another_pods_agent_gets_nothing_reclaimed(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    """Confused deputy: a labelled pod whose agent address is the victim's. The operator names the pod uid
    it means; the victim's agent serves another pod and refuses (409): no audit, no "leak", no reclaim."""
    object_of(pods, gpuobj_cluster, namespace)
    victim_port = int(pods.endpoint("victim").rsplit(":", 1)[1])
    errors = operator.metric(m.AUDIT_RUNS, {"result": "error"})
    kube(gpuobj_cluster, lambda k: create_agent_pod(k, namespace, "decoy", port=victim_port))
    try:
        # Several audit rounds of the decoy fail (the operator's audit interval here is 0.5 s, leak grace 2 s).
        from gpuobj_dev.testing.waits import wait_until

        wait_until(lambda: operator.metric(m.AUDIT_RUNS, {"result": "error"}) >= errors + 6, "audits of the decoy", 60)
        assert operator.metric(m.RECLAIMED_BYTES) == 0
        assert wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is not None)["status"]["state"] == "Ready"
        assert len(agent_http.inventory(pods.endpoint("victim"), pods.token_file)["objects"]) == 1
    finally:
        kube(gpuobj_cluster, lambda k: delete_pod(k, namespace, "decoy"))
    pods.workloads["victim"].run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("victim"), pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)


# Plain: the readers live in two more namespaces, where no operator runs to sign their agents' certificates
# (a namespaced operator answers the CSRs of its own namespace only).
@pytest.mark.plain_agents
def test_an_object_shared_with_a_namespace_is_readable_there_and_nowhere_else(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, tmp_path: Path
) -> None:
    """Namespaces are the boundary; spec.sharedWith opens one object to the pods of the namespaces it names."""
    src = pods.workload("src")
    src.run("ref = client.put([torch.arange(256, dtype=torch.float32)], name='open', shared_with=[SHARED])"
            .replace("SHARED", repr(f"{namespace}-b")))  # fmt: skip
    src.run("closed = client.put([torch.ones(256)], name='closed')")
    obj = wait_object(
        gpuobj_cluster, namespace, "open", lambda o: o and (o.get("status") or {}).get("state") == "Ready"
    )
    assert obj["spec"]["sharedWith"] == [f"{namespace}-b"]
    addresses = {name: src.eval_pickle(f"{name}.address") for name in ("ref", "closed")}
    others: list[Pods] = []
    try:
        for suffix in ("b", "c"):
            other = f"{namespace}-{suffix}"
            gpuobj_cluster.create_namespace(other)
            install_identities(gpuobj_cluster, other)
            others.append(Pods(gpuobj_cluster, other, pods.token_file, tmp_path / other, plain=pods.plain))
            reader = others[-1].workload("reader")
            outcome = {}
            for name, address in addresses.items():
                reader.run(
                    f"try:\n    got = client.fetch(load_pickle({address!r}))\n    outcome = float(got[0].sum())\n"
                    f"except Exception as exc:\n    outcome = repr(exc)"
                )
                outcome[name] = reader.eval("outcome")
            if suffix == "b":
                assert outcome["ref"] == float(sum(range(256))), outcome  # granted
                assert "403" in outcome["closed"] or "may not read" in outcome["closed"], outcome
            else:
                assert all("403" in o or "may not read" in o for o in outcome.values()), outcome
    finally:
        for p in others:
            p.close()
        for suffix in ("b", "c"):
            gpuobj_cluster.kubectl("delete", "namespace", f"{namespace}-{suffix}", "--wait=false", check=False)
    src.run("ref.release(); closed.release()")
    wait_object(gpuobj_cluster, namespace, "open", lambda o: o is None)
    wait_object(gpuobj_cluster, namespace, "closed", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_hand_off_is_released_at_the_source_by_its_receiver_only(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    """Issue 21: with a claim's name, any pod of the source's namespace released a hand-off at the source
    (`POST /v1/claims/{claim}/release`: 200) and so could free the object. The release is bound to the
    holder: another pod gets the answer an unknown claim gets (404), and the claim stays."""
    victim = pods.workload("victim")
    victim.run("ref = client.put([torch.arange(64, dtype=torch.float32)], name='handed')")
    wait_object(gpuobj_cluster, namespace, "handed", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    reader = pods.workload("reader")
    victim.run("shared = client.share(ref, 'reader'); client.flush(30); ref.release()")
    claim = victim.eval("shared.claim_name")
    reader.run(f"got = client.adopt(load_pickle({victim.eval_pickle('shared')!r}))")
    pods.workload("peer")
    path = f"/v1/claims/{claim}/release"
    status, answer = agent_call(pods.endpoint("victim"), "POST", path, pods.agent_token("peer").read_text())
    assert status == 404, (status, answer)
    # Nothing changed: the claim is recorded and still the only reference; the receiver still reads.
    assert kube(gpuobj_cluster, lambda k: k.get(CLAIMS, claim, namespace))["metadata"]["name"] == claim
    assert reader.eval("float(client.fetch(got)[0].sum())") == float(sum(range(64)))
    # The receiver's own release goes to the source (the hand-off path) and frees the object.
    status, answer = agent_call(pods.endpoint("victim"), "POST", path, pods.agent_token("reader").read_text())
    assert status == 200 and answer == {"released": True}, (status, answer)
    reader.run("got.detach()")  # released at the source already
    wait_object(gpuobj_cluster, namespace, "handed", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("victim"), pods.token_file)
    assert_api_empty(gpuobj_cluster, namespace)
