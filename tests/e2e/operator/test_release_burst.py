"""A burst of releases: one pod records a thousand objects and releases them together.

Why: kopf, which the operator once watched GPUObjects with, ran its handlers in a thread pool, so the
ledger changed under the workers' decisions ("Set changed size during iteration" hundreds of times
under such a burst). Its informers now call their handlers on the event loop.
Every object must be freed, and the operator must log no error at all.
"""

from __future__ import annotations

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, GPUOBJECTS
from tests.e2e.operator.conftest import Pods, kube

pytestmark = pytest.mark.nixl

OBJECTS = 1000


def test_a_thousand_releases_at_once_are_all_freed_without_an_operator_error(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src = pods.workload("src")
    # Named: recorded under every recording policy (an unnamed private one would make no record to free).
    put = "client.put([torch.full((4,), float(i))], name=f'burst-{i}')"
    src.run(f"refs = [{put} for i in range({OBJECTS})]; client.flush(120)", 180)
    recorded = kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"]
    assert len(recorded) == OBJECTS
    assert len(agent_http.inventory(pods.endpoint("src"), token_file)["objects"]) == OBJECTS

    src.run("for r in refs: r.release()\nclient.flush(120)", 180)
    wait_until(
        lambda: kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"] == [],
        "every GPUObject freed and gone",
        timeout=180,
        interval=0.5,
    )
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert operator.metric("gpuobj_frees_total", {"result": "freed"}) == OBJECTS
    assert user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"]) == []
    log = operator.output()
    for sign in ("Traceback", "RuntimeError", "ERROR", "unexpected error"):
        assert sign not in log, f"{sign} in the operator's log:\n{log[-4000:]}"
