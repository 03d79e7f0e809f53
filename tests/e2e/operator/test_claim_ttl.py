"""A hung reader without a ttl (issue 32): visible in the claim-age gauges, and bounded by its namespace's
default claim ttl.

Before: a claim without spec.ttlSeconds held its object (Releasing once its owner let go) for as long as
the holder process lived, and no metric showed it. Now the operator exports the bytes claims hold by age
and the oldest claim's age per namespace, and ``--namespace-claim-ttl NS=DURATION`` (chart value
``claimTTL.namespaces``) drops such a claim at that age as if it carried the ttl: the bytes are freed.

Real parts: the API server, the operator as its ServiceAccount, workload processes with their agents.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS
from tests.conftest import failed
from tests.e2e.operator.conftest import Pods, kube, start_operator
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl

NBYTES = 256 * 4  # 256 float32
DEFAULT_TTL = 20  # seconds: long enough to read the gauges while the claim holds, short for a test


@pytest.fixture
def ttl_operator(
    request: pytest.FixtureRequest, gpuobj_cluster: ClusterHandle, token_file: Path, namespace: str
) -> Iterator[OperatorProcess]:
    """The operator, with a default claim ttl for the test's namespace."""
    extra = ["--namespace-claim-ttl", f"{namespace}={DEFAULT_TTL}s"]
    op = start_operator(gpuobj_cluster, token_file, namespace, extra=extra).wait_ready()
    yield op
    if failed(request):
        print(f"\n--- operator output ---\n{op.output()}")
    rc = op.stop()
    assert rc == 0, f"operator exited {rc}:\n{op.output()}"


def test_a_claim_without_ttl_shows_in_the_age_gauges_and_expires_at_the_namespace_default(
    gpuobj_cluster: ClusterHandle, namespace: str, ttl_operator: OperatorProcess, pods: Pods
) -> None:
    op = ttl_operator
    src = pods.workload("src")
    src.run("ref = client.put([torch.arange(256, dtype=torch.float32)], name='pinned')")
    wait_object(gpuobj_cluster, namespace, "pinned", lambda o: o and (o.get("status") or {}).get("state") == "Ready")
    reader = pods.workload("reader")  # the hung reader: it borrows without a ttl and never lets go
    reader.run(f"got = client.borrow(load_pickle({src.eval_pickle('ref.address')!r})); client.flush(30)")
    src.run("ref.release(); client.flush(30)")
    wait_object(
        gpuobj_cluster, namespace, "pinned", lambda o: o and (o.get("status") or {}).get("state") == "Releasing"
    )

    # Visible: the claim's bytes and its age, in its namespace.
    op.wait_metric("gpuobj_claim_held_bytes", {"namespace": namespace, "age": "under_10m"}, NBYTES)
    assert op.metric("gpuobj_claim_oldest_age_seconds", {"namespace": namespace}) > 0

    # Bounded: the operator drops the claim at the namespace's default ttl, and the object is freed.
    def claims() -> list[str]:
        return [
            c["metadata"]["name"]
            for c in user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
        ]

    wait_until(lambda: claims() == [], "the operator to drop the claim at the namespace's default ttl", 60)
    wait_object(gpuobj_cluster, namespace, "pinned", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), pods.token_file)
    op.wait_metric("gpuobj_claim_held_bytes", {"namespace": namespace}, 0)
    op.wait_metric("gpuobj_claims_dropped_total", {"holder": "ttl"}, 1)
    assert_api_empty(gpuobj_cluster, namespace)
