"""A per-namespace byte quota a platform team sets (issue 21, item 6), enforced across a namespace's pods.

Before: quotas were per pod (GPUOBJ_MAX_STORE_BYTES); two pods of one namespace could together hold any
number of bytes. Now the operator keeps each namespace's running sum (operator/gpuobj_operator/quota.py):
the put that takes a namespace over is refused (Failed, reason QuotaExceeded, an Event) and its bytes
freed; the objects admitted before are intact; another namespace's sum is its own.

Real parts: the API server, one operator watching every namespace (the chart's cluster-wide RBAC for its
own ServiceAccount) and workload processes with their agents, each pod as its own ServiceAccount.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.identities import CHART, Credentials, credentials, install_identities
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from tests.conftest import failed
from tests.e2e.operator.conftest import FAST_ARGS, Pods
from tests.e2e.operator.test_lifecycle import wait_object

pytestmark = pytest.mark.nixl

KIB = 1024
QUOTA = 96 * KIB  # every namespace's (--default-namespace-quota): one 64 KiB object fits, two do not
OUTCOME = """
try:
    outcome = float({call}[0].sum())
except Exception as exc:
    outcome = type(exc).__name__ + ': ' + str(exc)
"""


REFUSED = """
import gpuobj
try:
    {call}
    outcome = (False, 'read', '')
except Exception as exc:
    outcome = (isinstance(exc, gpuobj.GpuObjError), type(exc).__name__, str(exc))
"""


class ClusterWideOperator:
    """The chart's operator identity for a release that watches every namespace (a ClusterRole), so that
    one operator sees the namespaces of this test; its cluster-scoped RBAC is removed afterwards."""

    def __init__(self, cluster: ClusterHandle, namespace: str, folder: Path) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.release = f"gpuobj-q{uuid.uuid4().hex[:6]}"
        self.service_account = f"{self.release}-operator"
        self.manifest = cluster.helm(
            "template", self.release, str(CHART), "--namespace", namespace,
            "--set", "rbac.aggregateToDefaultRoles=false",
            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac-operator.yaml",
        ).stdout  # fmt: skip
        cluster.kubectl("apply", "-f", "-", input=self.manifest)
        self.creds: Credentials = credentials(cluster, namespace, self.service_account, folder)

    @property
    def subject(self) -> str:
        """What workload pods' agents accept as the operator ($GPUOBJ_OPERATOR_SERVICEACCOUNT)."""
        return f"{self.namespace}/{self.service_account}"

    def start(self, extra: list[str]) -> OperatorProcess:
        return OperatorProcess(
            self.creds.kubeconfig,
            self.creds.agent_token,
            identity="op-quota",
            lease_namespace=self.namespace,
            extra_args=[
                *FAST_ARGS,
                *("--lease-name", f"{self.release}-operator"),
                *("--agent-ca-secret", f"{self.release}-agent-ca"),  # the chart's name, as its Deployment passes it
                *extra,
            ],
        ).start()

    def close(self) -> None:
        self.creds.stop()
        self.cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=self.manifest)


@pytest.fixture
def other_namespace(gpuobj_cluster: ClusterHandle, namespace: str) -> Iterator[str]:
    name = f"{namespace}-b"
    gpuobj_cluster.create_namespace(name)
    install_identities(gpuobj_cluster, name)
    yield name
    gpuobj_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def quota_operator(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> Iterator[tuple[ClusterWideOperator, OperatorProcess]]:
    identity = ClusterWideOperator(gpuobj_cluster, namespace, tmp_path / "cluster-wide-operator")
    op = identity.start(["--default-namespace-quota", str(QUOTA)]).wait_ready()
    yield identity, op
    if failed(request):
        print(f"\n--- operator output ---\n{op.output()}")
    rc = op.stop()
    identity.close()
    assert rc == 0, f"operator exited {rc}:\n{op.output()}"


def test_two_pods_of_a_namespace_over_its_quota_the_second_put_is_refused_and_freed(
    gpuobj_cluster: ClusterHandle,
    namespace: str,
    other_namespace: str,
    quota_operator: tuple[ClusterWideOperator, OperatorProcess],
    pods: Pods,
    tmp_path: Path,
) -> None:
    identity, op = quota_operator
    env = {"GPUOBJ_OPERATOR_SERVICEACCOUNT": identity.subject}
    token = identity.creds.agent_token
    first, second = pods.workload("first", env=env), pods.workload("second", env=env)
    # 64 KiB each (float32): the namespace's quota holds one.
    first.run("ref = client.put([torch.arange(16384, dtype=torch.float32)], name='weights'); client.flush(30)")
    wait_object(gpuobj_cluster, namespace, "weights", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    op.wait_metric("gpuobj_namespace_used_bytes", {"namespace": namespace}, 64 * KIB)
    assert op.metric("gpuobj_namespace_quota_bytes", {"namespace": namespace}) == QUOTA

    second.run("mine = client.put([torch.ones(16384, dtype=torch.float32)], name='extra'); client.flush(30)")

    # Refused where everyone looks: a Warning Event on the object (kubectl get events), the object Failed
    # while its free runs, then gone, and its bytes freed in the second pod's agent.
    def refusal_events() -> list[dict]:
        out = gpuobj_cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=QuotaExceeded", "-o", "json"
        ).stdout
        items = json.loads(out)["items"]
        return [e for e in items if e["involvedObject"]["name"] == "extra" and e["type"] == "Warning"]

    wait_until(lambda: refusal_events(), "a QuotaExceeded Event for the second put", 30)
    (event,) = refusal_events()
    assert f"quota of {QUOTA} bytes" in event["message"], event
    assert f"{64 * KIB} held" in event["message"], event
    wait_object(gpuobj_cluster, namespace, "extra", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("second"), token)
    op.wait_metric("gpuobj_quota_refusals_total", {"namespace": namespace}, 1)
    assert op.metric("gpuobj_namespace_used_bytes", {"namespace": namespace}) == 64 * KIB
    # The refused put's handle fails (its object is gone), through the one error hierarchy.
    second.run(REFUSED.format(call="client.fetch(mine)"))
    hierarchy, kind, message = second.eval("outcome")
    assert hierarchy and kind in ("QuotaExceededError", "ObjectNotFoundError"), (kind, message)

    # The first object is intact: Ready, and the second pod reads its bytes.
    assert (wait_object(gpuobj_cluster, namespace, "weights", lambda o: o is not None) or {})["status"][
        "state"
    ] == "Ready"
    second.run(f"got = client.borrow(load_pickle({first.eval_pickle('ref.address')!r})); client.flush(30)")
    second.run(OUTCOME.format(call="client.fetch(got)"))
    assert second.eval("outcome") == float(sum(range(16384)))
    second.run("got.release(); client.flush(30)")

    # Another namespace has its own sum: the same 64 KiB put there is admitted.
    others = Pods(gpuobj_cluster, other_namespace, token, tmp_path / "other-pods")
    try:
        elsewhere = others.workload("elsewhere", env=env)
        elsewhere.run("x = client.put([torch.ones(16384, dtype=torch.float32)], name='extra'); client.flush(30)")
        wait_object(
            gpuobj_cluster, other_namespace, "extra", lambda o: o and (o.get("status") or {}).get("state") == "Ready"
        )
        op.wait_metric("gpuobj_namespace_used_bytes", {"namespace": other_namespace}, 64 * KIB)
        assert op.metric("gpuobj_quota_refusals_total", {"namespace": other_namespace}) == 0
        elsewhere.run("x.release(); client.flush(30)")
        wait_object(gpuobj_cluster, other_namespace, "extra", lambda o: o is None)
    finally:
        others.close()

    # Released, the namespace's sum drops and a new put fits again.
    first.run("ref.release(); client.flush(30)")
    wait_object(gpuobj_cluster, namespace, "weights", lambda o: o is None)
    op.wait_metric("gpuobj_namespace_used_bytes", {"namespace": namespace}, 0)
    second.run("again = client.put([torch.ones(16384, dtype=torch.float32)], name='again'); client.flush(30)")
    wait_object(gpuobj_cluster, namespace, "again", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    second.run("again.release(); client.flush(30)")
    wait_object(gpuobj_cluster, namespace, "again", lambda o: o is None)

    # The per-pod quota, next to it, refuses before anything is stored, through the same error.
    tiny = pods.workload("tiny", env={**env, "GPUOBJ_MAX_STORE_BYTES": str(4 * KIB)})
    tiny.run(REFUSED.format(call="client.put([torch.ones(16384, dtype=torch.float32)], name='big'); client.flush(30)"))
    hierarchy, kind, message = tiny.eval("outcome")
    assert hierarchy and kind == "QuotaExceededError" and "quota" in message, (kind, message)
    agent_http.assert_holds_nothing(pods.endpoint("tiny"), token)
    assert wait_object(gpuobj_cluster, namespace, "big", lambda o: True, timeout=1) is None
