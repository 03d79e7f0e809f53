"""Only the owner frees (issue 21): deleting a GPUObject or a claim, or removing its finalizer, frees bytes.

A namespace peer's ServiceAccount may `delete` GPUObjects and claims (the workload role), so RBAC alone
let it free another pod's live object. Admission now lets a GPUObject be deleted only by its source pod,
a claim only by its holder or sharer, and both by the holders of the RBAC verb `free` (the operator,
cluster-admin) and the garbage collector. Every probe runs as the real identity (a pod's bound token, or
an impersonated person), is refused with a message that says who may, and changes nothing.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from gpuobj_contract import names
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import OPERATOR_SA, WORKLOAD_SA
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, ApiError
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object
from tests.e2e.operator.test_security import as_pod, refused

pytestmark = pytest.mark.nixl

OBJECT_POLICY = "only-the-source-frees-an-object"
CLAIM_POLICY = "only-holders-drop-claims"


def kubectl_as(cluster: ClusterHandle, pods: Pods, pod: str, *args: str) -> subprocess.CompletedProcess:
    """kubectl with the pod's own credentials (its bound ServiceAccount token), never the admin's."""
    return cluster.kubectl("--kubeconfig", str(pods.credentials[pod].kubeconfig), *args, check=False)


def in_force(cluster: ClusterHandle, pods: Pods, pod: str, resource: str, name: str, policy: str) -> None:
    """Policies load asynchronously: wait until a server-side dry run of the peer's delete is refused."""
    wait_until(
        lambda: policy in kubectl_as(cluster, pods, pod, "delete", resource, name, "--dry-run=server").stderr,
        f"the {policy} policy in force",
        30,
    )


def test_a_namespace_peer_cannot_free_another_pods_object_or_drop_its_claim(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    victim = pods.workload("victim")
    victim.run("ref = client.put([torch.arange(1024, dtype=torch.float32)], name='secret')")
    obj = wait_object(
        gpuobj_cluster, namespace, "secret", lambda o: o and (o.get("status") or {}).get("state") == "Ready"
    )
    reader = pods.workload("reader")
    victim.run("shared = client.share(ref, 'reader'); client.flush(30)")
    claim = victim.eval("shared.claim_name")
    reader.run(f"got = client.adopt(load_pickle({victim.eval_pickle('shared')!r}))")
    pods.workload("peer")
    in_force(gpuobj_cluster, pods, "peer", "gpuobjects", "secret", OBJECT_POLICY)
    in_force(gpuobj_cluster, pods, "peer", "gpuobjectclaims", claim, CLAIM_POLICY)

    # The probes of the issue, as the peer pod: both refused, saying who may.
    exc = refused(pods, "peer", lambda k: k.delete(GPUOBJECTS, "secret", namespace))
    assert exc.status == 403 and "only the source pod victim" in exc.message, exc
    exc = refused(pods, "peer", lambda k: k.delete(CLAIMS, claim, namespace))
    assert exc.status == 403 and "only the holder pod reader" in exc.message, exc

    # A person with edit-like rights in the namespace (alice, impersonated: no userInfo.extra at all),
    # and a ServiceAccount without its pod: the policy's own refusal, not a CEL error ("no such key: extra").
    gpuobj_cluster.kubectl("create", "role", "gpuobj-editor", "-n", namespace, "--verb=get,patch,update,delete",
                           "--resource=gpuobjects.gpuobj.io,gpuobjectclaims.gpuobj.io")  # fmt: skip
    gpuobj_cluster.kubectl("create", "rolebinding", "gpuobj-editor", "-n", namespace, "--role=gpuobj-editor",
                           "--user=alice")  # fmt: skip

    def answered(*args: str, policy: str = OBJECT_POLICY) -> subprocess.CompletedProcess | None:
        p = gpuobj_cluster.kubectl(*args, "-n", namespace, "--dry-run=server", check=False)
        return p if p.returncode == 0 or policy in p.stderr else None  # else: alice's RoleBinding not seen yet

    for who in (f"system:serviceaccount:{namespace}:{WORKLOAD_SA}", "alice"):
        for resource, name, policy in (
            ("gpuobjects", "secret", OBJECT_POLICY),
            ("gpuobjectclaims", claim, CLAIM_POLICY),
        ):
            args = ("delete", resource, name, "--as", who)
            out = wait_until(lambda a=args, p=policy: answered(*a, policy=p), "admission's answer", 30)
            assert out.returncode != 0 and "no such key" not in out.stderr, out.stderr
    # Removing the free finalizer frees as well: refused the same way.
    i = obj["metadata"]["finalizers"].index(names.FINALIZER_FREE)
    unfinalize = json.dumps([{"op": "remove", "path": f"/metadata/finalizers/{i}"}])

    def unfinalized() -> subprocess.CompletedProcess | None:
        return answered("patch", "gpuobject", "secret", "--as", "alice", "--type=json", "-p", unfinalize)

    out = wait_until(unfinalized, "alice's patch answered by admission", 30)
    assert OBJECT_POLICY in out.stderr and "remove the gpuobj.io/free finalizer" in out.stderr, out.stderr

    # The kubectl auth can-i view of the same rule (docs/security.md).
    def can(who: str, verb: str, resource: str) -> str:
        return gpuobj_cluster.kubectl(
            "auth", "can-i", verb, resource, "-n", namespace, "--as", who, check=False
        ).stdout.strip()

    operator_sa = f"system:serviceaccount:{namespace}:{OPERATOR_SA}"
    workload_sa = f"system:serviceaccount:{namespace}:{WORKLOAD_SA}"
    assert [can(operator_sa, "free", r) for r in ("gpuobjects.gpuobj.io", "gpuobjectclaims.gpuobj.io")] == ["yes"] * 2
    assert [can(workload_sa, "free", r) for r in ("gpuobjects.gpuobj.io", "gpuobjectclaims.gpuobj.io")] == ["no"] * 2
    assert can(workload_sa, "delete", "gpuobjects.gpuobj.io") == "yes"  # its own, as admission decides

    # Nothing changed: the object is Ready and not deleting, its bytes are readable, the claim is there.
    after = wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is not None)
    assert "deletionTimestamp" not in after["metadata"] and after["status"]["state"] == "Ready", after
    assert names.FINALIZER_FREE in after["metadata"]["finalizers"]
    assert kube(gpuobj_cluster, lambda k: k.get(CLAIMS, claim, namespace))["metadata"]["name"] == claim
    assert reader.eval("float(client.fetch(got)[0].sum())") == float(sum(range(1024)))

    # The owners' own paths still work: the holder drops its claim, the source deletes its object.
    reader.run("got.release(); client.flush(30)")
    wait_until(lambda: _gone(gpuobj_cluster, CLAIMS, claim, namespace), "the holder's claim deleted", 30)
    victim.run("ref.release(); client.flush(30)")
    wait_object(gpuobj_cluster, namespace, "secret", lambda o: o is None)
    assert_api_empty(gpuobj_cluster, namespace)


def _gone(cluster: ClusterHandle, res, name: str, namespace: str) -> bool:
    async def get(k):
        try:
            await k.get(res, name, namespace)
        except ApiError as exc:
            if exc.status == 404:
                return True
            raise
        return False

    return kube(cluster, get)


def test_the_operator_and_the_garbage_collector_still_free(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods
) -> None:
    """A holder pod that is deleted: the garbage collector deletes its claim (ownerReference), and the
    operator, holding `free`, deletes the GPUObject of a source that is gone."""
    src = pods.workload("src")
    src.run("ref = client.put([torch.ones(64)], name='kept')")
    wait_object(gpuobj_cluster, namespace, "kept", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    pods.workload("holder")
    src.run("shared = client.share(ref, 'holder'); client.flush(30); ref.release(); client.flush(30)")
    claim = src.eval("shared.claim_name")
    assert not _gone(gpuobj_cluster, CLAIMS, claim, namespace)
    pods.delete_pod("holder")  # the garbage collector deletes the claim; the last reference goes
    wait_until(lambda: _gone(gpuobj_cluster, CLAIMS, claim, namespace), "the claim collected", 60)
    wait_object(gpuobj_cluster, namespace, "kept", lambda o: o is None, timeout=60)
    pods.workload("lost-src").run("lost = client.put([torch.ones(64)], name='orphan')")
    wait_object(gpuobj_cluster, namespace, "orphan", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    pods.delete_pod("lost-src")  # the operator marks it Lost and deletes it (verb free)
    wait_object(gpuobj_cluster, namespace, "orphan", lambda o: o is None, timeout=60)
    assert_api_empty(gpuobj_cluster, namespace)
    assert as_pod(pods, "src", lambda k: k.list(GPUOBJECTS, namespace))["items"] == []
