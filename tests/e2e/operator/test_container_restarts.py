"""Liveness from the kubelet's container statuses, with probes only a slow backstop (docs/liveness.md).

The tests play the kubelet: they write the agent container's status (restartCount, containerID,
state.running.startedAt, lastState.terminated) as it would after a restart. The operator probes
each agent only every ten minutes here, so what it does within seconds comes from the pod watch.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Iterator

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.pods import create_agent_pod
from gpuobj_dev.testing.records import user_claims
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import CLAIMS, PODS
from tests.e2e.operator.conftest import Pods, kube, start_operator
from tests.e2e.operator.test_incarnations import _events
from tests.e2e.operator.test_lifecycle import assert_api_empty, state, wait_object

pytestmark = pytest.mark.nixl

BACKSTOP = ["--liveness-interval", "600"]


@pytest.fixture
def operator(gpuobj_cluster: ClusterHandle, token_file, namespace: str) -> Iterator[OperatorProcess]:
    op = start_operator(gpuobj_cluster, token_file, namespace, extra=BACKSTOP).wait_ready()
    yield op
    assert op.stop() == 0, op.output()


def _stamp(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _restarted(count: int, earlier: str, born: dt.datetime, ended: dt.datetime, new_id: str | None = None) -> dict:
    """The container status after a restart: run `count` (new_id, started at `ended`) replaced `earlier`,
    which ran from `born` to `ended` and exited 1."""
    return {
        "restartCount": count,
        "containerID": new_id or f"containerd://{uuid.uuid4().hex}",
        "state": {"running": {"startedAt": _stamp(ended)}},
        "lastState": {
            "terminated": {
                "containerID": earlier,
                "exitCode": 1,
                "startedAt": _stamp(born),
                "finishedAt": _stamp(ended),
            }
        },
    }


def _report(cluster: ClusterHandle, namespace: str, pod: str, container: dict) -> None:
    """What the kubelet writes: the agent container's status, the pod Running at its address."""

    async def patch(k):
        current = await k.get(PODS, pod, namespace)
        status = {**current["status"], "containerStatuses": [{"name": "workload", "ready": True, **container}]}
        await k.patch(PODS, pod, {"status": status}, namespace, subresource="status")

    kube(cluster, patch)


def test_a_share_to_a_receiver_that_restarts_before_it_ever_listens_is_dropped_and_freed(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """The receiver's first process dies in its first seconds, before it listens (no probe can reach it):
    the share made for it must not pass to the next process."""
    src = pods.workload("src")
    asyncio.run(_create_silent_pod(gpuobj_cluster, namespace, "reader"))
    first = f"containerd://{uuid.uuid4().hex}"
    born = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=3)
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        {"restartCount": 0, "containerID": first, "state": {"running": {"startedAt": _stamp(born)}}},
    )
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    src.run("client.share(ref, 'reader'); client.flush(); ref.release(); client.flush()")
    [claim] = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    assert claim["spec"]["holder"] == {"podName": "reader"}
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Releasing")
    made = dt.datetime.fromisoformat(claim["metadata"]["creationTimestamp"].replace("Z", "+00:00"))

    # The process dies and the kubelet starts the next; its report comes after the death, on its clock.
    ended = made + dt.timedelta(seconds=3)
    wait_until(lambda: dt.datetime.now(dt.UTC) >= ended, "the first run outlived the share", timeout=10, interval=0.1)
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        _restarted(1, first, born, ended),
    )
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None, timeout=30)
    [event] = _events(gpuobj_cluster, namespace, "HolderGone")
    assert event["involvedObject"]["name"] == claim["metadata"]["name"] and first[-12:] in event["message"]
    operator.wait_metric("gpuobj_frees_total", {"result": "freed"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_restart_the_kubelet_reports_drops_the_old_process_claim_without_waiting_for_the_backstop(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """What a simulated kubelet may write (restartCount+1, a new containerID, no times): the operator
    asks the agent at once which process lives, and the old process's claim goes within seconds."""
    src, reader = pods.workload("src"), pods.workload("reader")
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        {"restartCount": 0, "containerID": "containerd://one", "state": {"running": {}}},
    )
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    address = src.eval_pickle("ref.address")
    reader.run(f"h = client.borrow(load_pickle({address!r})); client.flush()")
    src.run("ref.release(); client.flush()")
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Releasing")

    pods.restart_process("reader")  # same pod and address, a new process
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        {"restartCount": 1, "containerID": "containerd://two", "state": {"running": {}}},
    )
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None, timeout=30)
    operator.wait_metric("gpuobj_claims_dropped_total", {"holder": "process"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


def test_a_share_to_a_receiver_whose_process_died_unprobed_ends_with_the_restart_the_kubelet_reports(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """Issue 32: the receiver's process dies in its first seconds, so no probe after the share reaches it,
    and the next process is the first to answer one. The restart the pod watch reports (a new containerID
    and restartCount, no times) ends the share: it belonged to the run current when it was made. Before,
    it passed to the next process and held the bytes until the pod went (this test timed out so)."""
    src, reader = pods.workload("src"), pods.workload("reader")
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        {"restartCount": 0, "containerID": "containerd://one", "state": {"running": {}}},
    )
    reader.kill()  # dies before the kubelet says so
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    src.run("client.share(ref, 'reader'); client.flush(); ref.release(); client.flush()")
    [claim] = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    assert claim["spec"]["holder"] == {"podName": "reader"}
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: state(o) == "Releasing")  # the operator knows it

    pods.restart_process("reader")  # same pod and address, a new process that answers the probes
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        {"restartCount": 1, "containerID": "containerd://two", "state": {"running": {}}},
    )
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None, timeout=30)
    [event] = _events(gpuobj_cluster, namespace, "HolderGone")
    assert event["involvedObject"]["name"] == claim["metadata"]["name"] and "one" in event["message"]
    operator.wait_metric("gpuobj_claims_dropped_total", {"holder": "process"}, 1)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)


async def _create_silent_pod(cluster: ClusterHandle, namespace: str, name: str) -> None:
    """An agent pod at an address where nothing listens yet (its process is still starting)."""
    async with cluster.client() as k:
        await create_agent_pod(k, namespace, name, port=1)


def test_a_share_made_in_the_new_runs_first_seconds_stays_with_the_new_process(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """Issue 32: the receiver restarted and its new process asked for a share at once; the kubelet's report
    of the restart came after the share, with the new run started in the share's second. Before, the share
    went with the earlier run and the report ended it under the process that had just received it (its
    HolderGone named the earlier container). Now the times leave it to the probe the share asked for, which
    found the new process: that process reads the bytes, and the share ends only when it is replaced."""
    src, reader = pods.workload("src"), pods.workload("reader")
    first = f"containerd://{uuid.uuid4().hex}"
    born = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        {"restartCount": 0, "containerID": first, "state": {"running": {"startedAt": _stamp(born)}}},
    )
    src.run("ref = client.put([torch.ones(1 << 12)], name='kv'); client.flush()")
    reader = pods.restart_process("reader")  # the kubelet has not reported it yet
    second = reader.eval("client.agent.incarnation")
    shared = src.eval_pickle("client.share(ref, 'reader')")
    src.run("client.flush(); ref.release(); client.flush()")
    [claim] = user_claims(kube(gpuobj_cluster, lambda k: k.list(CLAIMS, namespace))["items"])
    made = dt.datetime.fromisoformat(claim["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    operator.wait_for_line(f"agent of pod {namespace}/reader: process {second}", timeout=30)  # the share's probe

    second_run = f"containerd://{uuid.uuid4().hex}"
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        _restarted(1, first, born, made, second_run),
    )
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval("float(got.sum())") == float(1 << 12)

    third = pods.restart_process("reader")  # that process goes: the share goes with it
    replaced = dt.datetime.now(dt.UTC)
    _report(
        gpuobj_cluster,
        namespace,
        "reader",
        _restarted(2, second_run, made, replaced),
    )
    wait_object(gpuobj_cluster, namespace, "kv", lambda o: o is None, timeout=30)
    [event] = _events(gpuobj_cluster, namespace, "HolderGone")
    assert event["involvedObject"]["name"] == claim["metadata"]["name"]
    assert second in event["message"] and first[-12:] not in event["message"], event["message"]
    # What proved the second process gone: the third answering, or, when a probe the restart asked for
    # came while nothing listened yet (asked probes go on through refusals), its address refusing.
    proof = (third.eval("client.agent.incarnation"), "nothing listens at its address")
    assert any(p in event["message"] for p in proof), event["message"]
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)
