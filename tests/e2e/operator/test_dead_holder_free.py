"""A holder pod that is deleted: its references end with the pod event, and the source frees at once.

Issue 30: the free at the source must not wait on API writes it does not need. A claim names its
holder pod as its ownerReference, so Kubernetes' garbage collector deletes it with the pod; the
operator counts the claim ended the moment the pod watch reports the pod deleted, frees the object
its last references were those claims, and writes nothing about the claims itself (no delete of its
own racing the collector's, no HolderGone Event). The test counts every API write to gpuobj's
kinds and Events from the pod's deletion until all is clean, from the API server's own counters.

The operator probes agents only every ten minutes here, so the pod event alone drives the free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.api_requests import delta, request_counts, writes
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS
from tests.e2e.operator.conftest import Pods, kube, start_operator
from tests.e2e.operator.test_lifecycle import assert_api_empty, state, wait_object

pytestmark = pytest.mark.nixl

OBJECTS = 3  # each shared with the holder by its own claim
ROUNDS = 3  # holders deleted one after another: the time to the free is the median of these
COUNTED = {"gpuobjects", "gpuobjectclaims", "events"}


@pytest.fixture
def operator(gpuobj_cluster: ClusterHandle, token_file, namespace: str) -> Iterator[OperatorProcess]:
    op = start_operator(gpuobj_cluster, token_file, namespace, extra=["--liveness-interval", "600"]).wait_ready()
    yield op
    assert op.stop() == 0, op.output()


def _claims(cluster: ClusterHandle, namespace: str) -> list[dict]:
    return user_claims(kube(cluster, lambda k: k.list(CLAIMS, namespace))["items"])


def _delete_pod(cluster: ClusterHandle, namespace: str, name: str) -> float:
    """Delete the pod at once; returns when the request went out (monotonic), not when it was answered."""

    async def delete(k) -> float:
        started = time.monotonic()
        await k.delete(PODS, name, namespace, grace_period_seconds=0)
        return started

    return float(kube(cluster, delete))


def _objects(cluster: ClusterHandle, namespace: str) -> list[dict]:
    return kube(cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"]


def test_a_deleted_holder_pods_claims_end_with_the_pod_event_and_the_source_frees_without_operator_writes(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src = pods.workload("src")
    store = pods.endpoint("src")
    seconds: list[float] = []
    sent_all = []
    for round_ in range(ROUNDS):
        holder_name = f"holder-{round_}"
        holder = pods.workload(holder_name)
        names_ = [f"ckpt-{round_}-{i}" for i in range(OBJECTS)]
        src.run(f"refs = [client.put([torch.ones(1024)], name=n) for n in {names_!r}]")
        shared = src.eval_pickle(f"[client.share(r, {holder_name!r}) for r in refs]")
        holder.run(f"hs = [client.adopt(s) for s in load_pickle({shared!r})]")
        src.run("[r.release() for r in refs]; del refs; client.flush()")
        holder.run("client.flush()")
        for n in names_:
            wait_object(gpuobj_cluster, namespace, n, lambda o: state(o) == "Releasing")
        # Every claim carries its holder pod as ownerReference: the collector's to delete with the pod.
        claims = _claims(gpuobj_cluster, namespace)
        assert len(claims) == OBJECTS
        assert all(
            [(r["kind"], r["name"]) for r in c["metadata"]["ownerReferences"]] == [("Pod", holder_name)] for c in claims
        ), claims
        assert agent_http.metric(store, "gpuobj_agent_store_bytes") == OBJECTS * 4096

        # Earlier tests' namespaces being emptied are writes too: count only once they are gone.
        wait_until(lambda: not gpuobj_cluster.terminating_namespaces(), "earlier namespaces to go", timeout=120)
        before = request_counts(gpuobj_cluster, COUNTED)
        dropped_before = operator.metric("gpuobj_claims_dropped_total", {"holder": "pod"})
        pods.workloads[holder_name].kill()  # the container stops; the test plays the kubelet, which then
        started = _delete_pod(gpuobj_cluster, namespace, holder_name)  # removes the pod (grace period 0)
        wait_until(lambda: agent_http.metric(store, "gpuobj_agent_store_bytes") == 0, "the free at the source")
        seconds.append(time.monotonic() - started)

        wait_until(lambda: _objects(gpuobj_cluster, namespace) == [], "the GPUObjects to go", timeout=30)
        wait_until(lambda: _claims(gpuobj_cluster, namespace) == [], "the collector to delete the claims", timeout=60)
        sent = delta(request_counts(gpuobj_cluster, COUNTED), before)
        sent_all.append(sent)
        # The writes a dead holder costs: the collector's delete of each claim, the operator's finalizer
        # removal of each object it freed. Nothing else: no operator delete of a claim, no Event.
        assert sent.get(("DELETE", "gpuobjectclaims"), 0) == OBJECTS, sent
        assert sent.get(("PATCH", "gpuobjects"), 0) == OBJECTS, sent
        assert writes(sent) == 2 * OBJECTS, sent
        assert operator.metric("gpuobj_claims_dropped_total", {"holder": "pod"}) == dropped_before
        operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, OBJECTS * (round_ + 1))

    print(
        f"\ndead holder pod -> freed at the source: median {statistics.median(seconds) * 1000:.0f} ms"
        f" over {ROUNDS} ({', '.join(f'{s * 1000:.0f}' for s in seconds)} ms);"
        f" API writes per dead holder ({OBJECTS} claims): {[writes(s) for s in sent_all]}, {dict(sent_all[-1])}"
    )
    agent_http.assert_holds_nothing(store, token_file)
    assert_api_empty(gpuobj_cluster, namespace)
