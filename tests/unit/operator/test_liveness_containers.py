"""Liveness from the kubelet's container statuses (liveness.py, docs/liveness.md), without a server.

A record made well inside a container run that has ended belongs to a process of that run: dead,
whether or not a probe ever reached it (a receiver that restarts in its first seconds, before it
listens). A record near a run's edge, or in the run that lives now, is never judged on it.
"""

from __future__ import annotations

import datetime as dt

from gpuobj_operator.actions import DeleteClaim, Free
from gpuobj_operator.decisions import decide_claim, decide_object
from gpuobj_operator.liveness import Liveness
from gpuobj_operator.model import AgentContainer, ContainerRun, parse_agent_container, parse_pod
from tests.unit.operator.test_ledger import NOW, NS, claim, kinds, obj, pod, synced_ledger

READER = (NS, "reader")
T0 = dt.datetime(2026, 12, 2, 4, 0, 0, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def kubelet_pod(restarts: int, current: str, started: str, last: dict | None = None) -> dict:
    """A pod as the kubelet reports it: the agent's container, its run now and the one before."""
    status = {
        "name": "workload",
        "restartCount": restarts,
        "containerID": current,
        "state": {"running": {"startedAt": started}},
    }
    if last:
        status["lastState"] = {"terminated": last}
    return {
        "metadata": {"namespace": NS, "name": "reader", "uid": "pod-uid-r"},
        "spec": {
            "containers": [
                {"name": "sidecar"},
                {"name": "workload", "ports": [{"name": "gpuobj-agent", "containerPort": 8471}]},
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.6",
            "containerStatuses": [{"name": "sidecar", "restartCount": 7, "containerID": "containerd://side"}, status],
        },
    }


def test_the_agents_container_status_is_read_from_the_container_that_serves_the_agent_port() -> None:
    raw = kubelet_pod(
        1,
        "containerd://c2",
        "2026-12-02T04:00:09Z",
        last={
            "containerID": "containerd://c1",
            "startedAt": "2026-12-02T04:00:00Z",
            "finishedAt": "2026-12-02T04:00:09Z",
        },
    )
    container = parse_agent_container(raw)
    assert container == AgentContainer(
        name="workload",
        restart_count=1,
        current=ContainerRun("containerd://c2", at(9)),
        last=ContainerRun("containerd://c1", at(0), at(9)),
    )
    assert parse_pod(raw).agent_container == container


def test_a_restart_is_news_once_and_a_first_sight_is_not() -> None:
    live = Liveness()
    first = AgentContainer("workload", 0, ContainerRun("c1", at(0)))
    assert live.observe_container(READER, "u", first) is False  # a pod seen for the first time restarted nothing
    assert live.observe_container(READER, "u", first) is False
    restarted = AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9)))
    assert live.observe_container(READER, "u", restarted) is True
    assert live.observe_container(READER, "u", restarted) is False
    # What a simulated kubelet may do: restartCount+1 and a new containerID, no times. News, but no run to judge by.
    bare = AgentContainer("workload", 2, ContainerRun("c3"))
    assert live.observe_container(READER, "u", bare) is True
    assert live.ended_run(READER, "u", at(20)) is None


def test_only_records_well_inside_an_ended_run_belong_to_it() -> None:
    live = Liveness()
    live.observe_container(
        READER, "u", AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9)))
    )
    assert live.ended_run(READER, "u", at(4)) == ContainerRun("c1", at(0), at(9))
    for edge in (at(1), at(8), at(9), at(12)):  # within the clock margin of an edge, or after the run
        assert live.ended_run(READER, "u", edge) is None, edge
    assert live.ended_run(READER, "another-pod-uid", at(4)) is None  # a new pod of that name is not that pod
    assert live.ended_run(READER, "u", None) is None


def test_a_share_to_a_receiver_that_restarts_before_it_ever_listens_is_dropped_and_frees() -> None:
    """The receiver's first process died in its first nine seconds, before any probe reached it: the
    share made for it (at 4 s) must not pass to the next process."""
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(4))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)
    assert DeleteClaim not in kinds(decide_claim(ledger, shared.key, NOW))  # nothing is known against it yet
    ledger.liveness.observe_container(READER, "pod-uid-r", AgentContainer("workload", 0, ContainerRun("c1", at(0))))
    assert DeleteClaim not in kinds(decide_claim(ledger, shared.key, NOW))
    ledger.liveness.observe_container(
        READER, "pod-uid-r", AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9)))
    )
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=100.0)  # the next process answers
    actions = decide_claim(ledger, shared.key, NOW)
    assert kinds(actions) == [DeleteClaim] and "c1" in actions[0].reason
    ledger.remove_claim(shared, now=1.0)
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]


def test_a_share_made_after_the_restart_stays_with_the_new_process() -> None:
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(10))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)
    ledger.liveness.observe_container(
        READER, "pod-uid-r", AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9)))
    )
    assert not any(isinstance(a, DeleteClaim) for a in decide_claim(ledger, shared.key, NOW))
    assert Free not in kinds(decide_object(ledger, (NS, "w"), NOW))


def test_an_object_put_by_a_process_of_an_ended_run_is_lost_without_a_probe() -> None:
    src_pod = pod()
    put = obj("w", spec_incarnation="s-1", created=at(4))
    ledger = synced_ledger(src_pod, put)
    assert ledger.source_verdict(put).available
    ledger.liveness.observe_container(
        (NS, "src"),
        "pod-uid-1",
        AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9))),
    )
    verdict = ledger.source_verdict(put)
    assert not verdict.available and verdict.reason == "SourceAgentRestarted"
