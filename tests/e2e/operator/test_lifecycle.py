"""End to end against the real control plane, the real operator and real agent processes moving bytes with NIXL.

Every test ends by checking that nothing is held: no GPUObject or claim left, no object in
any agent, NIXL registrations back to zero.
"""

from __future__ import annotations

import json

import pytest

from gpuobj_contract import names
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, GPUOBJECTS
from gpuobj_kube.informer import wait_for
from tests.e2e.operator.conftest import Pods, kube

pytestmark = pytest.mark.nixl

ARANGE = "torch.arange({n}, dtype=torch.float32)"


def wait_object(cluster: ClusterHandle, namespace: str, name: str, predicate, timeout: float = 30) -> dict | None:
    return kube(cluster, lambda k: wait_for(k, GPUOBJECTS, name, namespace, predicate, timeout=timeout))


def state(obj: dict | None) -> str | None:
    return ((obj or {}).get("status") or {}).get("state")


def refs(obj: dict | None) -> int | None:
    return ((obj or {}).get("status") or {}).get("references")


def assert_api_empty(cluster: ClusterHandle, namespace: str) -> None:
    objects = kube(cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"]
    claims = user_claims(kube(cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    assert objects == [] and claims == [], (objects, claims)


def test_put_share_fetch_release_frees_on_the_source(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run(f"t = {ARANGE.format(n=1 << 18)}; ref = client.put([t], name='weights'); client.flush()")
    # put queued the GPUObject, with the finalizer (write-behind); flush waited until it was recorded.
    created = kube(gpuobj_cluster, lambda k: k.get(GPUOBJECTS, "weights", namespace))
    assert names.FINALIZER_FREE in created["metadata"]["finalizers"]
    assert created["spec"]["source"] == {
        "podName": "src",
        "podUID": pods.uids["src"],
        "incarnation": src.eval("client.incarnation"),
    }

    shared = src.eval_pickle("client.share(ref, 'reader')")
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval(f"bool(torch.equal(got, {ARANGE.format(n=1 << 18)}))")
    ready = wait_object(gpuobj_cluster, namespace, "weights", lambda o: state(o) == "Ready" and refs(o) == 2)
    assert ready["status"]["bytes"] == 4 << 18 and ready["status"]["claims"] == 1

    src.run("ref.release()")  # the owner's reference goes; the reader's claim holds the bytes
    wait_object(gpuobj_cluster, namespace, "weights", lambda o: state(o) == "Releasing")
    assert [o["id"] for o in agent_http.inventory(pods.endpoint("src"), token_file)["objects"]] != []

    reader.run("h.release()")  # the last reference: freed on the source, then the GPUObject goes
    wait_object(gpuobj_cluster, namespace, "weights", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    assert operator.metric("gpuobj_free_latency_seconds_count") == 1
    assert_api_empty(gpuobj_cluster, namespace)


def test_kubectl_apply_of_the_examples_and_delete_waiting_for_claims(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """deploy/examples: a GPUObject declared with kubectl is materialized by the source agent from a published key."""
    from gpuobj_dev.testing.cluster import REPO

    trainer = pods.workload("trainer-0")
    pods.workload("reader-0")
    examples = REPO / "deploy" / "examples"
    declared = __import__("yaml").safe_load((examples / "gpuobject.yaml").read_text())
    layouts = declared["spec"]["tensors"]
    make = ", ".join(f"torch.full({tuple(t['shape'])!r}, 7, dtype=getattr(torch, {t['dtype']!r}))" for t in layouts)
    trainer.run(f"client.publish({declared['spec']['key']!r}, [{make}])")
    k = gpuobj_cluster.kubectl
    k("apply", "-n", namespace, "-f", str(examples / "gpuobject.yaml"), "-f", str(examples / "gpuobjectclaim.yaml"))
    ready = wait_object(gpuobj_cluster, namespace, "weights", lambda o: state(o) == "Ready" and refs(o) == 2)
    # The materialize answer names the agent process holding the bytes: its liveness rules need it.
    process = agent_http.inventory(pods.endpoint("trainer-0"), token_file)["incarnation"]
    assert process and ready["status"]["transport"]["agentIncarnation"] == process
    table = k("get", "gpuobj", "-n", namespace).stdout
    assert "weights" in table and "Ready" in table and "trainer-0" in table, table
    claim = kube(gpuobj_cluster, lambda c: c.get(CLAIMS, "weights-reader", namespace))
    assert claim["metadata"]["ownerReferences"][0]["name"] == "reader-0"  # the operator made the holder its owner

    # kubectl delete waits while a claim lives ...
    proc = k("delete", "gpuobject", "weights", "-n", namespace, "--timeout=2s", check=False)
    assert proc.returncode != 0
    assert state(wait_object(gpuobj_cluster, namespace, "weights", lambda o: state(o) == "Releasing")) == "Releasing"
    # ... and completes once the claim goes.
    k("delete", "gpuobjectclaim", "weights-reader", "-n", namespace)
    k("wait", "--for=delete", "gpuobject/weights", "-n", namespace, "--timeout=30s")
    agent_http.assert_holds_nothing(pods.endpoint("trainer-0"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_holder_pod_deleted_garbage_collects_its_claim_and_frees(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, holder = pods.workload("src"), pods.workload("holder")
    src.run("ref = client.put([torch.ones(1024)], name='ckpt')")
    shared = src.eval_pickle("client.share(ref, 'holder')")
    holder.run(f"h = client.adopt(load_pickle({shared!r}))")
    src.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "ckpt", lambda o: state(o) == "Releasing")
    pods.delete_pod("holder")  # kube-controller-manager's garbage collector deletes the claim it owned
    wait_object(gpuobj_cluster, namespace, "ckpt", lambda o: o is None, timeout=60)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_source_pod_deleted_makes_objects_lost_fetch_fails_clearly_then_cleaned_up(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("ref = client.put([torch.ones(4096)], name='activations')")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    src.run("client.flush()")  # the object and the reader's claim are recorded before the pod dies
    reader.run(f"h = client.adopt(load_pickle({shared!r}))")
    pods.delete_pod("src")  # the process dies with its pod, and its memory with it
    lost = wait_object(gpuobj_cluster, namespace, "activations", lambda o: state(o) == "Lost")
    condition = next(c for c in lost["status"]["conditions"] if c["type"] == names.CONDITION_SOURCE_AVAILABLE)
    # The pod watch usually tells first; the operator's probe of the dead agent may (SourceAgentGone).
    assert condition["status"] == "False" and condition["reason"] in ("SourcePodDeleted", "SourceAgentGone")
    reader.run(
        "try:\n    client.fetch(h)\n    outcome = 'fetched'\nexcept gpuobj.ObjectLostError as e:\n    outcome = str(e)"
    )
    outcome = reader.eval("outcome")
    assert "is Lost" in outcome and "src" in outcome, outcome
    reader.run("h.release()")  # the last claim: the Lost object is cleaned up without a free
    wait_object(gpuobj_cluster, namespace, "activations", lambda o: o is None)
    operator.wait_metric("gpuobj_frees_total", {"result": "source-lost"}, 1)
    assert operator.metric("gpuobj_lost_objects_total") == 1  # deleted once, however many passes ran
    assert_api_empty(gpuobj_cluster, namespace)


def test_orphan_in_an_agent_is_counted_as_leaked_then_reclaimed_with_an_event(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src = pods.workload("src")
    # Bytes in the store that no GPUObject describes: what a crash between put and create leaves.
    src.run("client.agent.put('o-orphan', [torch.zeros(1 << 16)])")
    labels = {"namespace": namespace, "pod": "src"}
    wait_until(lambda: operator.metric("gpuobj_leaked_bytes", labels) == 4 << 16, "leaked bytes counted")
    wait_until(lambda: agent_http.inventory(pods.endpoint("src"), token_file)["objects"] == [], "orphan reclaimed")
    wait_until(lambda: operator.metric("gpuobj_leaked_bytes", labels) == 0, "leaked bytes back to 0")
    assert operator.metric("gpuobj_reclaimed_bytes_total", {"namespace": namespace}) == 4 << 16
    reclaimed = json.loads(
        gpuobj_cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=LeakReclaimed", "-o", "json"
        ).stdout
    )["items"]
    assert len(reclaimed) == 1 and "o-orphan" in reclaimed[0]["message"]
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
