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
    assert live.observe_container(READER, "u", first, 1.0) is False  # a pod seen for the first time restarted nothing
    assert live.observe_container(READER, "u", first, 1.0) is False
    restarted = AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9)))
    assert live.observe_container(READER, "u", restarted, 2.0) is True
    assert live.observe_container(READER, "u", restarted, 2.0) is False
    # What a simulated kubelet may do: restartCount+1 and a new containerID, no times. News, but no run to judge by.
    bare = AgentContainer("workload", 2, ContainerRun("c3"))
    assert live.observe_container(READER, "u", bare, 3.0) is True
    assert live.ended_run(READER, "u", at(20)) is None


def test_only_records_well_inside_an_ended_run_belong_to_it() -> None:
    live = Liveness()
    live.observe_container(
        READER, "u", AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9))), 1.0
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
    ledger.liveness.observe_container(
        READER, "pod-uid-r", AgentContainer("workload", 0, ContainerRun("c1", at(0))), 1.0
    )
    assert DeleteClaim not in kinds(decide_claim(ledger, shared.key, NOW))
    ledger.liveness.observe_container(
        READER,
        "pod-uid-r",
        AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9))),
        2.0,
    )
    ledger.liveness.observe_alive(READER, "pod-uid-r", "r-2", probe_started=100.0)  # the next process answers
    # Ended with its run: the free is decided at once, and the claim is deleted after it (issue 30).
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]
    assert decide_claim(ledger, shared.key, NOW) == []
    ledger.remove_object(ledger.objects[(NS, "w")])
    actions = decide_claim(ledger, shared.key, NOW)
    assert kinds(actions) == [DeleteClaim] and "c1" in actions[0].reason


def test_a_share_made_after_the_restart_stays_with_the_new_process() -> None:
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(10))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)
    ledger.liveness.observe_container(
        READER,
        "pod-uid-r",
        AgentContainer("workload", 1, ContainerRun("c2", at(9)), ContainerRun("c1", at(0), at(9))),
        2.0,
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
        1.0,
    )
    verdict = ledger.source_verdict(put)
    assert not verdict.available and verdict.reason == "SourceAgentRestarted"


def _run(restarts: int, container_id: str | None, started: float | None = None) -> AgentContainer:
    """The agent's container as the kubelet reports it; no container id: not created yet (no run)."""
    run = ContainerRun(container_id, at(started) if started is not None else None) if container_id else None
    return AgentContainer("workload", restarts, run)


def test_a_share_whose_receiver_restarts_in_its_first_seconds_ends_with_the_restart_though_it_never_answered() -> None:
    """Issue 32: the receiver's run c1 was current when the operator learned of the share, its process died
    before any probe after that reached it, and the next process answered first. The pod watch's restart
    (a new containerID and restartCount, no times: what a simulated kubelet writes) ends the share; before,
    it was scoped to the next process and held the bytes until the pod went (it failed so)."""
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(4))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)  # the share is learned at 0.0
    live = ledger.liveness
    live.observe_container(READER, "pod-uid-r", _run(0, "containerd://c1"), now=-2.0)
    live.observe_alive(READER, "pod-uid-r", "r-1", probe_started=-1.0)  # before the share: scopes nothing
    assert live.observe_refused(READER, "pod-uid-r", probe_started=0.5) is False
    assert live.observe_refused(READER, "pod-uid-r", probe_started=0.6) is True  # r-1 gone
    assert ledger.holder_process_gone(shared) is None  # r-1 was never asked after the share
    assert live.observe_container(READER, "pod-uid-r", _run(1, "containerd://c2"), now=1.0) is True
    live.observe_alive(READER, "pod-uid-r", "r-2", probe_started=1.5)  # the next process answers first
    why = ledger.holder_process_gone(shared) or ""
    assert "c1" in why and "c2" in why  # its process went with run c1, though it never answered
    ledger.remove_claim(shared, now=2.0)
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]


def test_a_share_belongs_to_the_run_current_when_it_was_learned_and_stays_while_that_run_lives() -> None:
    live = Liveness()
    live.observe_container(READER, "u", _run(0, None), now=0.0)  # ContainerCreating: no id yet
    live.observe_container(READER, "u", _run(0, "c1"), now=1.0)  # the same run, named
    live.observe_container(READER, "u", _run(0, "c1", started=3), now=1.5)  # the same run, timed
    assert [r.container_id for r in live.containers[READER].seen] == ["c1"]
    for learned in (0.5, 2.0, float("-inf")):  # before the first report: the first run reported
        assert live.run_replaced(READER, "u", learned, at(5)) is None
    live.observe_container(READER, "u", _run(1, "c2", started=20), now=30.0)
    assert "c1" in (live.run_replaced(READER, "u", 2.0, at(5)) or "")
    assert live.run_replaced(READER, "u", 31.0, at(5)) is None  # learned after the restart: c2's
    assert live.run_replaced(READER, "u", 2.0, None) is not None
    assert live.run_replaced(READER, "other-uid", 2.0, at(5)) is None  # a new pod of that name is not that pod
    assert live.run_replaced(READER, "u", float("inf"), at(5)) is None  # a record the ledger does not know


def test_a_share_made_well_after_a_restart_the_operator_had_not_seen_yet_stays_with_the_new_run() -> None:
    """The pod watch lags: the share was learned while c1 was the last run reported, but it was created
    CLOCK_MARGIN after c2 started, so it belongs to c2 (no wrong drop). One made in c2's first two seconds
    cannot be told from c1's by the times: the run does not decide it (the probes do, below); one made
    CLOCK_MARGIN before c2 started was c1's."""
    live = Liveness()
    live.observe_container(READER, "u", _run(0, "c1", started=0), now=0.0)
    live.observe_container(READER, "u", _run(1, "c2", started=10), now=20.0)
    assert live.run_replaced(READER, "u", 15.0, at(12)) is None
    assert live.run_replaced(READER, "u", 15.0, at(11)) is None
    assert live.run_replaced(READER, "u", 15.0, at(9)) is None
    assert "c1" in (live.run_replaced(READER, "u", 15.0, at(8)) or "")


def _restarted(c1_ended: float, c2_started: float) -> AgentContainer:
    """The kubelet's report of the restart, with the times of both runs."""
    return AgentContainer("workload", 1, ContainerRun("c2", at(c2_started)), ContainerRun("c1", at(0), at(c1_ended)))


def test_a_share_made_in_the_new_runs_first_seconds_before_its_report_stays_with_the_new_process() -> None:
    """Issue 32: c1 ended at 10 s and c2 started; c2's process asked for a share at once (created 10 s),
    which the operator learned before the kubelet's report of c2. Before, the share went with c1, so the
    report ended it under the live process that had just received it (it failed so). Now the times say
    it may be c2's, and the first probe after the share found c2's process: it stays while that lives."""
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(10))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)  # the share is learned at 0.0
    live = ledger.liveness
    live.observe_container(READER, "pod-uid-r", _run(0, "c1", started=0), now=-5.0)
    live.observe_alive(READER, "pod-uid-r", "r-2", probe_started=0.5)  # the probe the share asked for
    assert live.observe_container(READER, "pod-uid-r", _restarted(10, 10), now=1.0) is True
    assert ledger.holder_process_gone(shared) is None
    assert Free not in kinds(decide_object(ledger, (NS, "w"), NOW))
    assert not any(isinstance(a, DeleteClaim) for a in decide_claim(ledger, shared.key, NOW))
    live.observe_refused(READER, "pod-uid-r", probe_started=30.0)  # that process goes later: so does the share
    live.observe_refused(READER, "pod-uid-r", probe_started=30.1)
    assert "r-2" in (ledger.holder_process_gone(shared) or "")


def test_a_share_made_just_before_the_restart_goes_with_the_process_the_first_probe_found() -> None:
    """The same times, but the first probe after the share reached c1's process (r-1): it was that one's,
    and the restart's next process (r-2) answering ends it."""
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(9))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)
    live = ledger.liveness
    live.observe_container(READER, "pod-uid-r", _run(0, "c1", started=0), now=-5.0)
    live.observe_alive(READER, "pod-uid-r", "r-1", probe_started=0.5)
    live.observe_container(READER, "pod-uid-r", _restarted(10, 10), now=1.0)
    assert ledger.holder_process_gone(shared) is None  # not known yet: the next process has not answered
    live.observe_alive(READER, "pod-uid-r", "r-2", probe_started=1.5)
    assert "r-1" in (ledger.holder_process_gone(shared) or "")
    assert kinds(decide_object(ledger, (NS, "w"), NOW)) == [Free]


def test_a_share_made_clock_margin_before_the_run_ended_goes_with_it_though_no_probe_reached_it() -> None:
    """The restart signal alone ends a share its times put certainly in the ended run, even when that run's
    process never answered a probe and the next one answered first."""
    reader = pod("reader", uid="pod-uid-r", endpoint="10.0.0.6:8471")
    shared = claim("to-reader", "w", holder_pod="reader", shared_by="src", created=at(1))
    ledger = synced_ledger(pod(), reader, obj("w", deleting=True), shared)
    live = ledger.liveness
    live.observe_container(READER, "pod-uid-r", _run(0, "c1", started=0), now=-5.0)
    live.observe_container(READER, "pod-uid-r", _restarted(3, 3), now=1.0)  # c1 lived 3 s: 1 s is no edge of it
    live.observe_alive(READER, "pod-uid-r", "r-2", probe_started=1.5)
    assert "c1" in (ledger.holder_process_gone(shared) or "")


def test_a_share_whose_run_the_kubelet_reports_ended_goes_before_the_restart() -> None:
    """Made CLOCK_MARGIN before the run ended: it goes with the run; closer to the end, it may have been
    made after it (for the next run), which the probes decide."""
    live = Liveness()
    live.observe_container(READER, "u", _run(0, "c1", started=0), now=0.0)
    ended = AgentContainer("workload", 0, ContainerRun("c1", at(0), at(4)))  # state.terminated (back-off)
    assert live.observe_container(READER, "u", ended, now=5.0) is True
    assert "ended" in (live.run_replaced(READER, "u", 1.0, at(1)) or "")
    assert live.run_replaced(READER, "u", 1.0, at(3)) is None
