"""The audit reads a large agent store whole: 1,600 recorded objects and one orphan among them.

Why: the operator once read an agent's answer with one buffered read, so a 444 KB inventory came back
cut and was parsed as an empty store: leaks and Lost objects went unseen for any pod holding more than a
few hundred objects. The real agent pages its inventory; every page is read, nothing recorded is
taken for missing (no Lost), and the one orphan is reclaimed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuobj_contract import metric_names
from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import GPUOBJECTS
from tests.e2e.operator.conftest import Pods, kube, start_operator

pytestmark = pytest.mark.nixl

RECORDED = 1600


@pytest.fixture
def operator(gpuobj_cluster: ClusterHandle, token_file, namespace: str) -> Iterator[OperatorProcess]:
    """A lease that a loaded two-core machine does not lose while 1,600 puts land (else each pass may
    stop short of its reclaim: not acting on what a paused leader knew)."""
    op = start_operator(gpuobj_cluster, token_file, namespace, extra=["--lease-seconds", "15"]).wait_ready()
    yield op
    assert op.stop() == 0, op.output()


def test_an_agent_holding_1600_objects_is_audited_whole_and_its_one_orphan_reclaimed(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src = pods.workload("src")
    src.run(f"refs = [client.put([torch.full((4,), float(i))]) for i in range({RECORDED})]; client.flush(180)", 240)
    inventory = agent_http.inventory(pods.endpoint("src"), token_file)
    assert len(inventory["objects"]) == RECORDED
    audits_before = operator.metric(metric_names.AUDIT_RUNS, {"result": "ok"})
    log_before = len(operator.output())  # (before the process listened, audits found nothing there: not a read)

    src.run("client.agent.put('o-orphan', [torch.zeros(1 << 10)])")  # what a crash between put and create leaves
    labels = {"namespace": namespace, "pod": "src"}
    wait_until(
        lambda: "o-orphan" not in {o["id"] for o in agent_http.inventory(pods.endpoint("src"), token_file)["objects"]},
        "the orphan reclaimed",
        timeout=60,
        interval=0.5,
    )
    assert operator.metric(metric_names.RECLAIMED_BYTES, {"namespace": namespace}) == 4 << 10
    wait_until(lambda: operator.metric(metric_names.LEAKED_BYTES, labels) == 0, "leaked bytes back to 0")
    # Every pass read the whole store: no read failed, and none took a recorded object for missing. (A pass
    # may stop short of a reclaim while the loaded machine delays a lease renewal: that is not a read.)
    assert operator.metric(metric_names.AUDIT_RUNS, {"result": "ok"}) > audits_before
    failed_reads = [line for line in operator.output()[log_before:].splitlines() if "failed: Agent" in line]
    assert failed_reads == []
    assert operator.metric(metric_names.LOST_OBJECTS) == 0
    assert len(agent_http.inventory(pods.endpoint("src"), token_file)["objects"]) == RECORDED

    src.run("for r in refs: r.release()\nclient.flush(180)", 240)
    wait_until(
        lambda: kube(gpuobj_cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"] == [],
        "every GPUObject freed and gone",
        timeout=240,
        interval=0.5,
    )
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
