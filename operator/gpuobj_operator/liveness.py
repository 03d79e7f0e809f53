"""Which agent process (incarnation) of each pod is alive: from the kubelet's container statuses
(the pod watch) first, and the operator's probes as a slow backstop. Pure. (docs/liveness.md)

From the kubelet: a container run that ended (lastState.terminated, or state.terminated, with its
startedAt and finishedAt) took every process of it along. A record (a put's GPUObject, a claim) was
made while its process lived; one made well inside an ended run [startedAt + margin, finishedAt -
margin] (creationTimestamp against the kubelet's times: whole seconds and two clocks, hence the
margin) belongs to a process of that run, so it is dead: no probe needed, and no guess either. A
record near a run's edge, or with no times to compare, is left to the probes, which a restart the
pod watch reports asks for at once.

Why: a container that crashes while its pod stays leaves the Pod object untouched, so the
pod watch says nothing; only the agent itself can say that the process that made a record
is gone. Every agent has a random ``incarnation`` (GET /v1/info) and a pod runs one agent,
so an incarnation is dead once the pod's agent answers with another one, or once nothing
listens at its address (connection refused, confirmed twice).

Nothing is freed on stale knowledge: an incarnation the operator never saw alive (a record
made before this operator started) is judged only by a probe sent after the operator
learned of the record, since that record's process then certainly came first. A probe that
times out (a stopped or overloaded process) proves nothing and only backs off.

A claim made by ``share()`` without the receiver's incarnation names only the receiver pod. It is
scoped to the receiver process that was alive when it was made, found two ways, and dies with either:

- its container run (``run_replaced``): the run the pod watch reported current when the operator
  learned of the claim (or, for a claim learned before the pod's first report, the first run
  reported), or a later run the claim was certainly made in (its creationTimestamp CLOCK_MARGIN after
  that run's startedAt). Once the kubelet reports a later run (a new containerID or a higher
  restartCount), or that run ended, the claim's process is gone, whether or not it ever answered a
  probe: a receiver that restarts in its first seconds does not pass its shares to the next process.
  Except a claim made within CLOCK_MARGIN of that run's end (its finishedAt, else the next run's
  startedAt): the next run's process may have asked for it in its first seconds, before the operator
  saw the kubelet's report, and the times cannot tell which run it was. The run does not decide it:
  the incarnation below does, so a share the new process just received is never ended under it;
- its incarnation (``scoped_incarnation``): the first incarnation that a probe started after the
  operator learned of the claim found answering. That process was alive after the claim existed, so
  a live receiver that simply has not adopted its reference yet keeps it; without container
  statuses, if the process that really was meant is an older one (it died before the probe), the
  claim is scoped to its successor and waits for that one or the pod to go.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from gpuobj_operator.model import AgentContainer, ContainerRun, Key


@dataclass
class AgentState:
    pod_uid: str
    incarnation: str | None = None  # the incarnation last seen alive
    gone: bool = False  # confirmed: nothing listens at the agent's address
    judged_at: float = float("-inf")  # start of the last probe that answered or confirmed gone
    refusals: int = 0  # consecutive refusals
    failures: int = 0  # consecutive probes that proved nothing (timeouts, errors)
    dead: set[str] = field(default_factory=set)  # incarnations seen alive, then replaced or gone
    # Incarnations in the order they answered: [incarnation, start of the last probe it answered].
    answered: list[tuple[str, float]] = field(default_factory=list)


HISTORY = 16  # incarnations remembered per pod for scoping; older ones only make a scope newer (safe)
# Seconds a record's creationTimestamp must lie inside an ended container run to belong to it: both
# times are whole seconds (1) and from two clocks, the API server's and the node's (1 more).
CLOCK_MARGIN = 2.0
CONFIRM_DELAY = 0.1  # seconds between a refused probe and the one that confirms it


@dataclass(frozen=True)
class SeenRun:
    """One run of a pod's agent container, in the order the pod watch reported them."""

    container_id: str | None  # None until the kubelet names it
    restart_count: int
    started: dt.datetime | None  # state.running.startedAt (the node's clock), when reported
    first_seen: float  # when the operator first saw it current (monotonic seconds)


@dataclass
class ContainerRuns:
    """The runs of one pod's agent container: the ones the kubelet reported ended, by container id, and
    every run reported current, oldest first (the last HISTORY), to scope shares to (run_replaced)."""

    pod_uid: str
    current: str | None = None  # the container id of the run the kubelet reports now
    restart_count: int = 0
    ended: dict[str, ContainerRun] = field(default_factory=dict)
    seen: list[SeenRun] = field(default_factory=list)

    def note_current(self, container: AgentContainer, now: float) -> None:
        """A new run is a higher restartCount or another containerID; a run that gets its id or its
        start time later (ContainerCreating, then running) stays the same run."""
        run, count = container.current, container.restart_count
        cid, started = (run.container_id, run.started) if run else (None, None)
        last = self.seen[-1] if self.seen else None
        if last is None or count > last.restart_count or (cid and last.container_id and cid != last.container_id):
            self.seen.append(SeenRun(cid, count, started, now))
            del self.seen[:-HISTORY]
        elif (cid and not last.container_id) or (started and not last.started):
            named = SeenRun(last.container_id or cid, last.restart_count, last.started or started, last.first_seen)
            self.seen[-1] = named


@dataclass
class Liveness:
    confirm_refusals: int = 2
    agents: dict[Key, AgentState] = field(default_factory=dict)
    containers: dict[Key, ContainerRuns] = field(default_factory=dict)
    clock_margin: float = CLOCK_MARGIN

    def observe_container(self, pod: Key, pod_uid: str, container: AgentContainer | None, now: float) -> bool:
        """The pod watch's news of the agent's container (``now``: monotonic seconds). Returns whether a run
        ended or a new one began that was not known (a restart): the caller probes at once and re-decides
        the pod's records."""
        if container is None:
            return False
        runs = self.containers.get(pod)
        if runs is None or runs.pod_uid != pod_uid:
            runs = self.containers[pod] = ContainerRuns(pod_uid)
        runs.note_current(container, now)
        changed = False
        for run in (container.last, container.current):
            if run is not None and run.finished is not None and run.container_id not in runs.ended:
                runs.ended[run.container_id] = run
                changed = True
        while len(runs.ended) > HISTORY:
            del runs.ended[next(iter(runs.ended))]
        current = container.current.container_id if container.current else None
        if current != runs.current or container.restart_count != runs.restart_count:
            changed = changed or runs.current is not None or container.restart_count > runs.restart_count
            runs.current, runs.restart_count = current, container.restart_count
        return changed

    def ended_run(self, pod: Key, pod_uid: str | None, created: dt.datetime | None) -> ContainerRun | None:
        """The ended run of the pod's agent container that a record made at ``created`` lies well inside
        (CLOCK_MARGIN from either edge); None when there is none or it cannot be told."""
        runs = self.containers.get(pod)
        if created is None or runs is None or (pod_uid and runs.pod_uid != pod_uid):
            return None
        margin = dt.timedelta(seconds=self.clock_margin)
        for run in runs.ended.values():
            if run.started and run.finished and run.started + margin <= created <= run.finished - margin:
                return run
        return None

    def run_replaced(self, pod: Key, pod_uid: str | None, learned_at: float, created: dt.datetime | None) -> str | None:
        """Why the container run a record naming only this pod belongs to is over (a message), or None.

        Its run: the last one reported current by ``learned_at`` (when the operator first saw the record),
        else the first one reported; or a later one that started CLOCK_MARGIN before ``created``. It is
        over once the kubelet reports a run after it, or reports it ended, unless ``created`` lies within
        CLOCK_MARGIN of that run's end (its finishedAt, else the next run's startedAt): then the record may
        be the next run's and None is returned (scoped_incarnation decides). Decided from the pod watch's
        history, so it does not change when it is asked again later.
        """
        runs = self.containers.get(pod)
        if runs is None or not runs.seen or (pod_uid and runs.pod_uid != pod_uid):
            return None
        margin = dt.timedelta(seconds=self.clock_margin)
        bound = 0
        for i, run in enumerate(runs.seen):
            if run.first_seen <= learned_at or (created and run.started and run.started + margin <= created):
                bound = i
        run = runs.seen[bound]
        after = runs.seen[bound + 1] if bound + 1 < len(runs.seen) else None
        ended = runs.ended.get(run.container_id) if run.container_id else None
        if after is None and ended is None:
            return None
        # When the run ended, by the node's clock: its finishedAt, else no later than the next run's start.
        end = ended.finished if ended is not None and ended.finished else after.started if after else None
        if created is not None and end is not None and created > end - margin:
            # Made within CLOCK_MARGIN of the run's end, perhaps after it, by the next run's process (it
            # asked for the share in its first seconds, before the operator saw the kubelet's report):
            # the times cannot tell, so the run does not decide; the first probe after the share does.
            return None
        if after is not None:
            return (
                f"the agent process of pod {pod[1]} ran in container {_short(run)}, which the kubelet "
                f"reports restarted as {_short(after)} (restart {after.restart_count})"
            )
        assert ended is not None
        return (
            f"the agent process of pod {pod[1]} ran in container {_short(run)}, which the kubelet "
            f"reports ended{f' at {ended.finished:%H:%M:%S}' if ended.finished else ''}"
        )

    def _state(self, pod: Key, pod_uid: str) -> AgentState:
        state = self.agents.get(pod)
        if state is None or state.pod_uid != pod_uid:
            state = self.agents[pod] = AgentState(pod_uid)
        return state

    def observe_alive(self, pod: Key, pod_uid: str, incarnation: str, probe_started: float) -> bool:
        """The agent answered. Returns whether what the operator knows changed."""
        state = self._state(pod, pod_uid)
        changed = state.gone or state.incarnation != incarnation
        if state.incarnation and state.incarnation != incarnation:
            state.dead.add(state.incarnation)
        state.incarnation, state.gone = incarnation, False
        state.refusals = state.failures = 0
        state.judged_at = max(state.judged_at, probe_started)
        if state.answered and state.answered[-1][0] == incarnation:
            state.answered[-1] = (incarnation, max(state.answered[-1][1], probe_started))
        else:
            state.answered.append((incarnation, probe_started))
            del state.answered[:-HISTORY]
        return changed

    def observe_refused(self, pod: Key, pod_uid: str, probe_started: float) -> bool:
        """Nothing listens at the agent's address. Gone once confirmed; returns whether that changed."""
        state = self._state(pod, pod_uid)
        state.refusals += 1
        state.failures = 0
        if state.refusals < self.confirm_refusals:
            return False
        changed = not state.gone
        if state.incarnation:
            state.dead.add(state.incarnation)
        state.incarnation, state.gone = None, True
        state.judged_at = max(state.judged_at, probe_started)
        return changed

    def observe_unreachable(self, pod: Key, pod_uid: str) -> None:
        """A timeout or an error: the process may be stopped or busy; proves nothing."""
        state = self._state(pod, pod_uid)
        state.failures += 1
        state.refusals = 0

    def forget(self, pod: Key) -> None:
        self.agents.pop(pod, None)
        self.containers.pop(pod, None)

    def agent_gone(self, pod: Key, pod_uid: str) -> bool:
        state = self.agents.get(pod)
        return state is not None and state.pod_uid == pod_uid and state.gone

    def incarnation_dead(self, pod: Key, pod_uid: str | None, incarnation: str, learned_at: float) -> str | None:
        """Why ``incarnation`` of this pod is known dead (a message), or None while it may live.

        ``learned_at``: when the operator first saw the record naming it (monotonic seconds).
        """
        state = self.agents.get(pod)
        if state is None or (pod_uid and state.pod_uid != pod_uid):
            return None
        if incarnation == state.incarnation and not state.gone:
            return None
        known = incarnation in state.dead
        if not known and state.judged_at <= learned_at:
            return None  # not asked since we heard of the record: it may be the newer process
        if state.gone:
            return f"agent process {incarnation} of pod {pod[1]} is gone (nothing listens at its address)"
        return f"agent process {incarnation} of pod {pod[1]} was replaced by {state.incarnation} (container restart)"

    def scoped_incarnation(self, pod: Key, pod_uid: str | None, learned_at: float) -> str | None:
        """The incarnation a record that names only this pod belongs to: the first one that answered a
        probe started after ``learned_at`` (when the operator first saw the record). None until then.

        Why that one: it was alive after the record existed, so it is the record's process or a later
        one, never an earlier one; a later one only keeps the record longer (the old, pod-scoped rule).
        Decided from the probes' history, so it does not change when it is asked again later.
        """
        state = self.agents.get(pod)
        if state is None or (pod_uid and state.pod_uid != pod_uid):
            return None
        for incarnation, last_answered in state.answered:
            if last_answered > learned_at:
                return incarnation
        return None

    def probe_delay(self, pod: Key, interval: float, max_backoff: float) -> float:
        """Seconds until the next probe: quick while confirming a refusal, else the backstop ``interval``,
        longer (up to ``max_backoff`` when that is longer) while probes fail or nothing listens."""
        state = self.agents.get(pod)
        if state is None:
            return interval
        if 0 < state.refusals < self.confirm_refusals:
            return min(interval, CONFIRM_DELAY)
        slowest = max(interval, max_backoff)
        if state.failures:
            return min(slowest, interval * 2.0**state.failures)
        if state.gone:
            return min(slowest, interval * 2)
        return interval


def _short(run: SeenRun) -> str:
    return run.container_id[-12:] if run.container_id else f"#{run.restart_count}"
