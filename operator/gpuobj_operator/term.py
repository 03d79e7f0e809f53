"""One term as leader: what runs while this replica leads, started and stopped as one unit.

Why a unit: nothing may be decided before this replica leads and every kind has been listed once
(Reconciler.sync), and nothing a term knew may outlive it. A term gets a fresh ledger from the
composition root, fills it from a fresh LIST, hands the informers on from that list, and on its end
(the lease lost, a stop, a watch failed for good) stops its workers, watches and selections within
bounds, or says what did not stop (TermStuck) so the process ends rather than lead again beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, KubeClient
from gpuobj_kube.informer import Informer
from gpuobj_operator.agent_client import AgentClient
from gpuobj_operator.claimcheck import Watermark
from gpuobj_operator.events import EventRecorder
from gpuobj_operator.health import HealthServer
from gpuobj_operator.leader import LeaderElector
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.progress_marker import ProgressMarker, marker_writer
from gpuobj_operator.reconciler import LABEL_AGENT_SELECTOR, Reconciler
from gpuobj_operator.selection import Selection
from gpuobj_operator.settings import Settings

log = logging.getLogger("gpuobj.operator")

# How a term ended: "lease-lost" and "sync-failed" lead again in this process, the others end it.
Outcome = Literal["stopped", "failed", "lease-lost", "sync-failed"]

# After an API or etcd outage, watch again within ~2 s of the API's return. Bounded: a minute of errors in
# a row ends the process with the real error, and its Deployment restarts it.
WATCH_BACKOFF = (0.25, 2.0)
WATCH_GIVE_UP_SECONDS = 60.0
WIND_DOWN_SECONDS = 10.0  # each part of a term (workers, watches) must stop within this after its cancel


@dataclass(frozen=True)
class TermParts:
    """What every term is given, built once by the composition root; none of it remembers a term."""

    kube: KubeClient
    agents: AgentClient
    events: EventRecorder
    metrics: OperatorMetrics
    health: HealthServer  # the term says when it leads (ready) and when it stops
    elector: LeaderElector
    settings: Settings
    progress_marker_namespace: str | None


class TermStuck(Exception):
    """Part of a term as leader did not stop when asked: the process must end (its Deployment restarts it)."""

    def __init__(self, parts: list[str]) -> None:
        super().__init__(f"did not stop: {', '.join(parts)}")
        self.parts = parts


async def lead(parts: TermParts, ledger: Ledger, stopping: asyncio.Task[bool]) -> Outcome:
    """One term as leader on ``ledger`` (fresh, empty): a fresh LIST, then the informers take over from it,
    until the lease is lost ("lease-lost"), ``stopping`` ends ("stopped") or a watch fails for good
    ("failed"). Everything this term started is stopped before it returns, so nothing it knew outlives it."""
    metrics, health, elector = parts.metrics, parts.health, parts.elector
    reconciler = Reconciler(
        parts.kube, parts.agents, metrics, parts.events, parts.settings, may_act=elector.holds_lease, ledger=ledger
    )
    informers, selected = _watches(parts, reconciler)
    # Renew from the start: a sync that outlives the lease must not leave it to lapse.
    hold = asyncio.create_task(elector.hold())
    outcome: Outcome = "stopped"
    try:
        sync = asyncio.create_task(reconciler.sync())
        await asyncio.wait({sync, hold, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not sync.done():
            sync.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sync
            outcome = "lease-lost" if hold.done() else "stopped"
            return outcome
        if sync.exception() is not None:
            log.warning("initial sync failed: %r", sync.exception())
            outcome = "sync-failed"
            return outcome
        # Every informer takes over from the sync's own list: whatever changed since arrives as an event.
        for informer in informers:
            version, identities = reconciler.intake.listed[informer.resource.plural]
            informer.seed(identities, version)
            informer.start()
        for selection in selected:
            selection.seed(*reconciler.intake.listed[selection.resource.plural])
            selection.start()
        informers += [i for s in selected for i in s.informers]
        reconciler.start()
        health.state = "leading"
        print("gpuobj operator: synced and reconciling", flush=True)
        watches = {t for t in (i.task for i in informers) if t is not None}
        done, _ = await asyncio.wait({hold, stopping, *watches}, return_when=asyncio.FIRST_COMPLETED)
        if failed := [t for t in done & watches if not t.cancelled() and t.exception()]:
            # A watch failed for longer than it retries: say why (the real error), and end the process.
            error = failed[0].exception()
            log.error("%s (caused by %r)", error, error and error.__cause__)
            outcome = "failed"
        elif hold in done and not hold.cancelled():
            reason = f": {hold.exception()!r}" if hold.exception() else ""
            print(f"gpuobj operator: lost leadership{reason}; stopping acting", file=sys.stderr, flush=True)
            outcome = "lease-lost"
        return outcome
    finally:
        # Stop acting first (and say so: the leader gauge drops with it), then wind down what only reads.
        metrics.leader.set(0)
        health.state = "standby" if outcome not in ("stopped", "failed") else "stopping"
        hold.cancel()
        stuck = [] if await wind_down(hold, WIND_DOWN_SECONDS) else ["lease renewal"]
        steps = [("workers", reconciler.stop)] + [(f"{i.resource.plural} watch", i.stop) for i in informers]
        steps += [(f"{s.resource.plural} selection", s.stop) for s in selected]
        for name, step in steps:
            if not await run_within(step(), WIND_DOWN_SECONDS):
                stuck.append(name)
        if stuck:
            # What did not stop may still act on what this term knew: never lead again in this process.
            raise TermStuck(stuck)


def _watches(parts: TermParts, reconciler: Reconciler) -> tuple[list[Informer], list[Selection]]:
    """The term's informers (claims, agent pods) and selections (streams, GPUObjects), not yet started;
    the claims watch feeds the free path's watermark, and its progress marker when the operator has one."""
    kube, metrics, shard = parts.kube, parts.metrics, parts.settings.shard
    # Claims feed a watermark: a free skips the claims read once every claim event up to the object's
    # deletion is in the ledger (claimcheck.py).
    watermark = Watermark()
    watch: dict[str, Any] = {
        "namespace": parts.settings.namespace,
        "backoff": WATCH_BACKOFF,
        "give_up_after": WATCH_GIVE_UP_SECONDS,
    }

    def counter(plural: str) -> Callable[[str], Callable[[], None]]:
        return lambda selection: metrics.watch_events.labels(plural, selection).inc

    # GPUObjects and streams: a shard of several is sent only its buckets' (selection.py); claims and agent
    # pods are watched whole and filtered here (claims: one watch keeps the claims watermark sound).
    selected = [
        Selection(kube, res, handler, shard, counted=counter(res.plural), **watch)
        for res, handler in ((STREAMS, reconciler.on_stream), (GPUOBJECTS, reconciler.on_object))
    ]
    informers = [
        Informer(kube, CLAIMS, reconciler.on_claim, on_progress=watermark.observe, **watch),
        Informer(kube, PODS, reconciler.on_pod, label_selector=LABEL_AGENT_SELECTOR, **watch),
    ]
    reconciler.free_path.claims_watermark = watermark
    if parts.progress_marker_namespace is not None:
        reconciler.free_path.progress_marker = ProgressMarker(
            watermark,
            marker_writer(kube, parts.progress_marker_namespace),
            on_write=lambda ok: metrics.claims_marker_writes.labels("written" if ok else "failed").inc(),
        )
    return informers, selected


async def run_within(step: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Run a stop step (``reconciler.stop()``, ``informer.stop()``) to its end, for at most ``seconds``;
    False if it is still running then (it is cancelled). Run, never cancelled first: a step cancelled
    before it starts stops nothing, and the term it belongs to would go on acting beside the next one."""
    task = asyncio.ensure_future(step)
    await asyncio.wait({task}, timeout=seconds)
    if not task.done():
        task.cancel()
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("stopping: %r", task.exception())
    return True


async def wind_down(task: asyncio.Future[Any], seconds: float) -> bool:
    """Cancel ``task`` and wait up to ``seconds`` for it to stop; False if it is still running then.
    Never waits longer: a task that ignores its cancellation must not hang the replica (it would
    stand by, do nothing and ignore SIGTERM)."""
    task.cancel()
    await asyncio.wait({task}, timeout=seconds)
    if not task.done():
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("stopping: %r", task.exception())
    return True
