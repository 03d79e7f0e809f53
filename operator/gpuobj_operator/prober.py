"""The liveness prober: asks agents which process (incarnation) lives, as a slow backstop.

Why apart: the kubelet's container statuses report most deaths (liveness.py reads them from the pod
watch); probes catch the rest, every ``liveness_interval`` per agent, and at once when a share or a
restart asks for one (docs/liveness.md). What a probe proves is decided by the pure liveness.py; this
is the I/O and the schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from gpuobj_operator.agent_client import AgentClient, AgentError, AgentGone, AgentUnreachable
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.model import Key, PodInfo
from gpuobj_operator.settings import Settings
from gpuobj_operator.write_budget import write_share

log = logging.getLogger("gpuobj.operator")

PROBE_GAP = 0.05  # seconds: the least time between two probes of one agent asked for by new shares
ASKED_PROBE_GAP = 0.25  # seconds between probes of an agent asked for that does not answer yet
ASKED_PROBING_SECONDS = 30.0  # how long such an agent is probed that often (then the backstop interval)


class Prober:
    def __init__(
        self,
        ledger: Ledger,
        agents: AgentClient,
        enqueue: Callable[..., None],  # (items, urgent=False), as Reconciler.enqueue
        settings: Settings,
    ) -> None:
        self.ledger = ledger
        self.agents = agents
        self.enqueue = enqueue
        self.settings = settings
        self._probe_due: dict[Key, float] = {}
        self._probe_asked: dict[Key, float] = {}  # pod -> when a probe was asked for at once (a share, a restart)
        self._probe_started: dict[Key, float] = {}  # pod -> start of its last probe
        self._probe_wake: asyncio.Event | None = None
        # Each agent's share of the fleet's write budget, told on every probe: made again each round from
        # the agents there are then (write_budget.py); 0 (no budget) is told too, so a budget turned off
        # reaches every agent at its next probe.
        self.write_share = 0.0

    def forget(self, pod: Key) -> None:
        """The pod is gone: nothing to probe. A probe of it still in flight finds its start gone and
        drops its answer (probe), so nothing of the pod is made again here or in the liveness."""
        self._probe_due.pop(pod, None)
        self._probe_asked.pop(pod, None)
        self._probe_started.pop(pod, None)

    async def run(self) -> None:
        """Probe every agent pod's /v1/info: which process (incarnation) lives, or none (see liveness.py);
        each probe also tells the agent its pod's share of the fleet's write budget.

        Each probe is a task of its own, so a probe asked for now (a restart, a new share) starts now: it
        never waits for a round of backstop probes to finish, some of which may wait out their time-out on
        an agent that is restarting. At most 32 run at once; one pod has at most one in flight."""
        limit = asyncio.Semaphore(32)
        self._probe_wake = wake = asyncio.Event()
        in_flight: dict[Key, asyncio.Task[None]] = {}

        async def one(pod: PodInfo) -> None:
            try:
                async with limit:
                    await self.probe(pod)
            except Exception:  # a bug must show, and must not stop the other probes
                log.exception("probe of the agent of %s/%s failed", *pod.key)
                self._probe_asked.pop(pod.key, None)
                self._probe_due[pod.key] = time.monotonic() + self.settings.liveness_interval
            finally:
                in_flight.pop(pod.key, None)
                if pod.key in self._probe_asked:
                    wake.set()  # still asked for: the loop's next wake-up is this pod's next probe

        try:
            while True:
                wake.clear()
                now = time.monotonic()
                pods = self.ledger.agent_pods() if self.ledger.synced else []
                self.write_share = write_share(self.settings.fleet_write_budget, len(pods), self.settings.shard.count)
                for pod in pods:
                    if pod.key not in in_flight and self._probe_due.get(pod.key, 0.0) <= now:
                        in_flight[pod.key] = asyncio.create_task(one(pod), name=f"probe-{pod.key[0]}/{pod.key[1]}")
                # Wake for the next round, or sooner for a probe a new share asked for (PROBE_GAP after the last).
                timeout = self.settings.liveness_interval / 2
                asked = [
                    self._probe_due[p.key]
                    for p in pods
                    if p.key in self._probe_asked and p.key in self._probe_due and p.key not in in_flight
                ]
                if asked:
                    timeout = max(0.005, min(timeout, min(asked) - time.monotonic()))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it may swallow a shutdown's cancel
                        await wake.wait()
        finally:
            for task in in_flight.values():
                task.cancel()
            if in_flight:
                await asyncio.gather(*in_flight.values(), return_exceptions=True)

    def new_agent(self, pod: Key) -> None:
        """A pod whose agent the operator has not probed yet: with a fleet write budget, probe it now, and
        every ASKED_PROBE_GAP until its agent answers, so that it learns its share before its first writes
        rather than at the next backstop round (up to half a liveness interval later)."""
        if self.settings.fleet_write_budget > 0:
            self.probe_soon(pod)

    def probe_soon(self, pod: Key) -> None:
        """Probe this pod's agent now: a share just named it, and the process alive now is the one the
        share is scoped to (liveness.scoped_incarnation); the sooner it is asked, the narrower the gap in
        which that process could die unseen (then the share is scoped to its successor: kept longer)."""
        now = time.monotonic()
        self._probe_asked[pod] = now
        # At most one probe per pod per PROBE_GAP however many shares arrive: the first after the ask counts.
        soon = max(now, self._probe_started.get(pod, float("-inf")) + PROBE_GAP)
        self._probe_due[pod] = min(self._probe_due.get(pod, soon), soon)
        if self._probe_wake is not None:
            self._probe_wake.set()

    def _forgotten(self, pod: PodInfo, started: float) -> bool:
        """Whether the pod this probe asked about was forgotten (deleted) while it ran: its answer is then
        about nothing the operator holds, and must not make the pod's liveness or schedule again."""
        current = self.ledger.pods.get(pod.key)
        return (
            self._probe_started.get(pod.key) != started or current is None or current.uid != pod.uid or current.deleted
        )

    async def probe(self, pod: PodInfo) -> None:
        started = self._probe_started[pod.key] = time.monotonic()
        liveness = self.ledger.liveness
        failure: AgentError | AgentUnreachable | None = None
        try:
            info = await self.agents.info(
                pod.endpoint,  # type: ignore[arg-type]
                pod_uid=pod.uid,
                timeout=self.settings.probe_timeout,
                write_rate=self.write_share,
            )
        except (AgentError, AgentUnreachable) as exc:
            failure = exc
        if self._forgotten(pod, started):
            return
        if isinstance(failure, AgentGone) or (isinstance(failure, AgentError) and failure.status == 409):
            # Nothing listens, or the agent there serves another pod: ours is not listening.
            changed = liveness.observe_refused(pod.key, pod.uid, started)
        elif failure is not None:  # a timeout, our token refused, an error: proves nothing about the process
            liveness.observe_unreachable(pod.key, pod.uid)
            log.debug("probe of %s/%s proved nothing: %s", *pod.key, failure)
            changed = False
        elif info.pod_uid and info.pod_uid != pod.uid:
            # Another pod's agent answers at this address: ours is not there.
            changed = liveness.observe_refused(pod.key, pod.uid, started)
        else:
            changed = liveness.observe_alive(pod.key, pod.uid, info.incarnation, started)
        if changed:
            state = liveness.agents.get(pod.key)
            log.info(
                "agent of pod %s/%s: %s",
                *pod.key,
                "gone" if state and state.gone else f"process {state.incarnation if state else '?'}",
            )
        self._probe_due[pod.key] = started + liveness.probe_delay(
            pod.key, self.settings.liveness_interval, self.settings.liveness_max_backoff
        )
        asked = self._probe_asked.get(pod.key, float("-inf"))
        if asked >= started:
            self._probe_due[pod.key] = started  # asked for while this probe ran: it may predate the share
        elif (failure is not None or liveness.agents[pod.key].incarnation is None) and (
            started - asked < ASKED_PROBING_SECONDS
        ):
            # Asked for (a share to scope, a restart) and nothing answers yet: a process that is still
            # starting must be reached as soon as it listens, not at the next backstop probe. A refusal
            # counts too before it is confirmed (the old process is still the last one seen): the kubelet
            # reports a restart when the container starts, before its agent listens.
            self._probe_due[pod.key] = min(self._probe_due[pod.key], started + ASKED_PROBE_GAP)
        else:
            self._probe_asked.pop(pod.key, None)
        suspect = self.ledger.suspect_records(pod.key)
        # Objects among them may be freed now (a dead process's claims ended): the free lane.
        self.enqueue((item for item in suspect if item[0] == "object"), urgent=True)
        self.enqueue(item for item in suspect if item[0] != "object")
