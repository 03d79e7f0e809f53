"""Execute the ledger's decisions against the API server and the agents.

Why here and not in the ledger: this is the I/O edge. Every action is idempotent and
re-checked against fresh state where a mistake would cost bytes (a free first makes sure
it has every claim up to the version the decision saw: from the in-order claims watch, or
a read at exactly that version; claimcheck.py), so a restart at any point loses nothing and
frees nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar

from gpuobj_contract import names
from gpuobj_contract.agent_api import MaterializeRequest
from gpuobj_contract.layouts import LayoutError, TensorLayout
from gpuobj_kube.client import (
    CLAIMS,
    GPUOBJECTS,
    PODS,
    STREAMS,
    ApiError,
    Conflict,
    Gone,
    Invalid,
    KubeClient,
    NotFound,
)
from gpuobj_operator import claimcheck, statuses
from gpuobj_operator.actions import (
    Action,
    AddFinalizer,
    DeleteClaim,
    DeleteObject,
    Emit,
    FinishStream,
    Free,
    LookupPod,
    Materialize,
    PatchClaimStatus,
    PatchObjectStatus,
    PatchStreamStatus,
    ReleaseWithoutFree,
    Requeue,
    SetClaimOwner,
)
from gpuobj_operator.agent_client import AgentClient, AgentError, AgentGone, AgentUnreachable
from gpuobj_operator.auditor import Auditor
from gpuobj_operator.decisions import decide
from gpuobj_operator.events import EventRecorder
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.model import Key, ObjectInfo, PodInfo, parse_claim, parse_object, parse_pod, parse_stream
from gpuobj_operator.progress_marker import ProgressMarker
from gpuobj_operator.workqueue import WorkQueue

log = logging.getLogger("gpuobj.operator")

WorkItem = tuple[str, Key]
LABEL_AGENT_SELECTOR = f"{names.LABEL_AGENT}=true"
PROBE_GAP = 0.05  # seconds: the least time between two probes of one agent asked for by new shares
ASKED_PROBE_GAP = 0.25  # seconds between probes of an agent asked for that does not answer yet
ASKED_PROBING_SECONDS = 30.0  # how long such an agent is probed that often (then the backstop interval)


class RetryLater(Exception):
    """The action could not complete now; requeue with backoff."""


class Reconciler:
    """Executes the ledger's actions against the API server and the agents; decides nothing itself."""

    _executors: ClassVar[dict[type[Action], Callable[[Reconciler, Any], Awaitable[None]]]]
    # The in-order claims watch's progress (main.py wires the claims Informer's); None: always read.
    claims_watermark: claimcheck.Watermark | None = None
    # Written to move that watch past a deletion no claim event follows (progress_marker.py); None: reads only.
    progress_marker: ProgressMarker | None = None
    claims_read_delay = 0.05  # seconds a free waits for that watch before it also reads, while reads are slow
    _claims_reads: claimcheck.ReadDelay | None = None

    def __init__(
        self,
        kube: KubeClient,
        agents: AgentClient,
        metrics: OperatorMetrics,
        events: EventRecorder,
        *,
        workers: int = 8,
        leak_settle_seconds: float = 5.0,
        leak_grace_seconds: float = 30.0,
        audit_interval: float = 10.0,
        resync_interval: float = 60.0,
        namespace: str | None = None,
        status_delay: float = 0.25,
        allow_agent_host_annotation: bool = False,
        liveness_interval: float = 20.0,
        liveness_max_backoff: float = 60.0,
        probe_timeout: float = 2.0,
        may_act: Callable[[], bool] | None = None,
    ) -> None:
        self.allow_agent_host_annotation = allow_agent_host_annotation
        self.kube = kube
        self.agents = agents
        self.metrics = metrics
        self.events = events
        self.ledger = Ledger()
        # Retries back off to 5 s at most: after an API outage every item is tried again within seconds.
        self.queue = WorkQueue(max_delay=5.0)
        self.workers = workers
        self.resync_interval = resync_interval
        self.namespace = namespace
        self._tasks: list[asyncio.Task] = []
        self.listed: dict[str, tuple[str, list[dict]]] = {}  # kind -> (resourceVersion, stubs) of the sync
        self._freed: set[str] = set()  # uids freed and awaiting their DELETED event
        # uid -> (the agent's answer, asked at, answered at): freed on the agent, its finalizer not removed
        # yet. A retry goes straight to the finalizer, and counts and reports the free that happened.
        self._agent_freed: dict[str, tuple[Any, float, float]] = {}
        self._stream_status_interval = 1.0
        self.status_delay = status_delay
        self._status_due: dict[tuple[str, Key], float] = {}
        self._stream_patched_at: dict[Key, float] = {}
        self._pod_lookups: set[Key] = set()
        self.liveness_interval = liveness_interval
        self.liveness_max_backoff = liveness_max_backoff
        self.probe_timeout = probe_timeout
        self._probe_due: dict[Key, float] = {}
        self._probe_asked: dict[Key, float] = {}  # pod -> when a probe was asked for at once (a new share)
        self._probe_started: dict[Key, float] = {}  # pod -> start of its last probe
        self._probe_wake: asyncio.Event | None = None
        self.may_act = may_act or (lambda: True)
        self.auditor = Auditor(
            self.ledger,
            kube,
            agents,
            metrics,
            self.execute,
            self._must_lead,
            interval=audit_interval,
            settle_seconds=leak_settle_seconds,
            grace_seconds=leak_grace_seconds,
        )

    # ------------------------------------------------------------ lifecycle

    async def sync(self) -> None:
        """List every kind once before any decision: a free decided on a partial view could be wrong."""
        now = time.monotonic()
        ns = self.namespace
        streams = await self.kube.list(STREAMS, ns)
        claims = await self.kube.list(CLAIMS, ns)
        pods = await self.kube.list(PODS, ns, label_selector=LABEL_AGENT_SELECTOR)
        objects = await self.kube.list(GPUOBJECTS, ns)
        for s in streams["items"]:
            self.ledger.upsert_stream(parse_stream(s))
        for c in claims["items"]:
            if not self.is_marker(c):
                self.ledger.upsert_claim(parse_claim(c), now)
        for p in pods["items"]:
            pod = self._parse_pod(p)
            self.ledger.liveness.observe_container(pod.key, pod.uid, pod.agent_container)
            self.ledger.upsert_pod(pod)
        for o in objects["items"]:
            self.ledger.upsert_object(parse_object(o), now)
        self.ledger.synced = True
        # Where the pod and claims watches take over: from these lists, so nothing after them is missed.
        self.listed = {
            "pods": (pods["metadata"]["resourceVersion"], [_stub(p) for p in pods["items"]]),
            "claims": (claims["metadata"]["resourceVersion"], [_stub(c) for c in claims["items"]]),
        }
        self.enqueue_all()
        log.info(
            "synced: %d objects, %d claims, %d streams, %d agent pods",
            len(self.ledger.objects),
            len(self.ledger.claims),
            len(self.ledger.streams),
            len(self.ledger.pods),
        )

    def start(self) -> None:
        for i in range(self.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"reconcile-worker-{i}"))
        self._tasks.append(asyncio.create_task(self.auditor.run(), name="audit"))
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
        if self.liveness_interval > 0:
            self._tasks.append(asyncio.create_task(self._liveness_loop(), name="liveness"))
        if self.progress_marker is not None:
            self._tasks.append(asyncio.create_task(self.progress_marker.run(), name="claims-progress-marker"))

    async def stop(self) -> None:
        self.queue.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def enqueue(self, items: Iterable[WorkItem], urgent: bool = False) -> None:
        for item in items:
            self.queue.add(item, urgent)

    def enqueue_all(self) -> None:
        self.enqueue(("stream", k) for k in list(self.ledger.streams))
        self.enqueue(("claim", k) for k in list(self.ledger.claims))
        self.enqueue(("object", k) for k in list(self.ledger.objects))

    # ------------------------------------------------------------ event intake (from kopf handlers)

    def on_object(self, event_type: str | None, raw: dict) -> None:
        info = parse_object(raw)
        now = time.monotonic()
        if event_type == "DELETED":
            self._freed.discard(info.uid)
            self._agent_freed.pop(info.uid, None)
            self._status_due.pop(("object", info.key), None)
            self.enqueue(self.ledger.remove_object(info))
        else:
            # A deletion (the owner's reference went) is the free lane: ahead of status work.
            self.enqueue(self.ledger.upsert_object(info, now), urgent=info.deleting)

    @staticmethod
    def is_marker(raw: dict) -> bool:
        """A progress marker (progress_marker.py): a claim of that name is never a reference, in any
        namespace (admission lets any ServiceAccount create one in its shape: it must grant nothing)."""
        return raw.get("metadata", {}).get("name") == names.CLAIMS_PROGRESS_MARKER

    def on_claim(self, event_type: str | None, raw: dict) -> None:
        if self.is_marker(raw):
            return  # its event moves the claims watermark (the informer does that); nothing to decide
        info = parse_claim(raw)
        now = time.monotonic()
        if event_type == "DELETED":
            self._status_due.pop(("claim", info.key), None)
        gone = event_type == "DELETED" or info.deleting
        self.enqueue(
            self.ledger.remove_claim(info, now) if event_type == "DELETED" else self.ledger.upsert_claim(info, now),
            urgent=gone,  # a reference went: most likely a free, ahead of status work
        )
        if not gone and self.ledger.needs_scope(info) and self.ledger.holder_incarnation(info) is None:
            self.probe_soon((info.namespace, info.holder_pod))  # type: ignore[arg-type]

    def on_stream(self, event_type: str | None, raw: dict) -> None:
        info = parse_stream(raw)
        self.enqueue(self.ledger.remove_stream(info) if event_type == "DELETED" else self.ledger.upsert_stream(info))

    def _parse_pod(self, raw: dict) -> PodInfo:
        return parse_pod(raw, allow_host_annotation=self.allow_agent_host_annotation)

    def on_pod(self, event_type: str | None, raw: dict) -> None:
        info = self._parse_pod(raw)
        if event_type == "DELETED":
            self.ledger.liveness.forget(info.key)
            self._probe_due.pop(info.key, None)
            self._probe_asked.pop(info.key, None)
            self._probe_started.pop(info.key, None)
        elif self.ledger.liveness.observe_container(info.key, info.uid, info.agent_container):
            # The kubelet reports a restart: the ended run's records go by its times (liveness.py); for
            # the rest, ask the agent now which process lives instead of at the next backstop probe.
            self.probe_soon(info.key)
        self.enqueue(self.ledger.remove_pod(info) if event_type == "DELETED" else self.ledger.upsert_pod(info))

    # ------------------------------------------------------------ workers

    async def _worker(self) -> None:
        while True:
            item = await self.queue.get()
            try:
                kind, key = item
                for action in decide(self.ledger, kind, key, dt.datetime.now(dt.UTC)):
                    await self.execute(action)
                self.queue.forget(item)
            except RetryLater as exc:
                delay = self.queue.retry(item)
                log.info("%s %s/%s: %s; retrying in %.2fs", item[0], *item[1], exc, delay)
            except Conflict:
                self.queue.retry(item)
            except (ApiError, OSError, TimeoutError) as exc:
                delay = self.queue.retry(item)
                log.warning("%s %s/%s failed: %s; retrying in %.2fs", item[0], *item[1], exc, delay)
            except Exception:
                delay = self.queue.retry(item)
                log.exception("%s %s/%s: unexpected error; retrying in %.2fs", item[0], *item[1], delay)
            finally:
                self.queue.done(item)

    def _must_lead(self) -> None:
        """Before anything that frees or deletes: a paused leader may have been replaced meanwhile."""
        if not self.may_act():
            raise RetryLater("the leader lease is not confirmed since a pause; not acting on what we knew")

    async def execute(self, action: Action) -> None:
        """Run one action: a table from action type to its executor, checked when the class is built."""
        await self._executors[type(action)](self, action)

    # ------------------------------------------------------------ actions

    async def _do_LookupPod(self, a: LookupPod) -> None:
        key = (a.namespace, a.name)
        try:
            pod = self._parse_pod(await self.kube.get(PODS, a.name, a.namespace))
            self.enqueue(self.ledger.upsert_pod(pod))
        except NotFound:
            self.enqueue(self.ledger.remove_pod(PodInfo(a.namespace, a.name, uid="", deleted=True)))
        self._pod_lookups.add(key)

    async def _do_AddFinalizer(self, a: AddFinalizer) -> None:
        obj = self.ledger.objects[a.key]
        raw = await self.kube.get(GPUOBJECTS, a.key[1], a.key[0])
        finalizers = raw["metadata"].get("finalizers") or []
        if names.FINALIZER_FREE in finalizers or raw["metadata"].get("deletionTimestamp"):
            self.on_object("MODIFIED", raw)
            return
        patched = await self.kube.patch(
            GPUOBJECTS,
            a.key[1],
            {
                "metadata": {
                    "finalizers": [*finalizers, names.FINALIZER_FREE],
                    "resourceVersion": raw["metadata"]["resourceVersion"],
                }
            },
            a.key[0],
        )
        del obj
        self.on_object("MODIFIED", patched)

    async def _do_Materialize(self, a: Materialize) -> None:
        obj = self.ledger.objects[a.key]
        pod = self.ledger.pods[(obj.namespace, obj.source_pod)]
        try:
            try:
                request = _materialize_request(obj)
            except LayoutError as exc:  # the CRD's schema admits none; refused here as the agent would
                raise AgentError(400, str(exc)) from exc
            answer = await self.agents.materialize(a.endpoint, a.object_id, request, pod_uid=a.pod_uid)
        except AgentError as exc:
            if exc.status == 404:
                pending = statuses.pending_status(
                    generation=obj.generation, reason="KeyNotPublished", message=exc.message, now=_now()
                )
                await self._patch_object_status(a.key, pending)
                raise RetryLater(f"key {obj.key_name!r} not published yet") from exc
            failed = statuses.failed_status(
                generation=obj.generation, reason="MaterializeFailed", message=exc.message, now=_now()
            )
            await self._patch_object_status(a.key, failed)
            self._emit("GPUObject", a.key, a.uid, "Warning", "MaterializeFailed", exc.message)
            return
        except AgentUnreachable as exc:
            raise RetryLater(f"agent at {a.endpoint} unreachable: {exc}") from exc
        status = statuses.materialized_status(
            object_id=a.object_id,
            pod_uid=pod.uid,
            endpoint=a.endpoint,
            incarnation=answer.incarnation,
        )
        await self._patch_object_status(a.key, status)
        self._emit(
            "GPUObject", a.key, a.uid, "Normal", "Materialized", f"agent on pod {pod.name} holds {obj.bytes} bytes"
        )

    async def _do_Free(self, a: Free) -> None:
        if a.uid in self._freed:
            return  # freed already; the DELETED event is on its way
        self._must_lead()
        if a.uid in self._agent_freed:  # freed on the agent by an earlier try; only the finalizer failed
            await self._finish_free(a, *self._agent_freed[a.uid])
            return
        decided = time.monotonic()
        # 1. Re-check the claims: a claim made just before the deletion may not be in the ledger yet
        # (two watches). See claimcheck.py: none needed once the in-order claims watch has passed the
        # version the decision saw; else a read at exactly that version, raced against that watch.
        current = self.ledger.objects.get(a.key)
        if current is None or current.uid != a.uid:
            current = None
        seen_rv = current.resource_version if current is not None else None
        how, blocking = await self._check_claims(a.key, a.uid, seen_rv)
        if blocking:
            self._decide_again_once_applied(a.key, blocking)
            return  # a claim the ledger has not seen yet holds it
        if current is not None and self.ledger.live_claims(current):
            return  # the ledger learned of a claim since it decided; it decides again
        self._must_lead()  # again: the check may have waited (a read of claims, tens of ms)
        checked = time.monotonic()
        # 2. Free on the source agent (idempotent there). Monotonic stamps (one clock per machine) say
        # where a free's time goes: bench/lifecycle.py reads them.
        gone_at = self.ledger.ref_gone_at.get(a.key, decided)
        log.info(
            "freeing %s/%s (object %s, %d bytes) on %s; claims by %s; seen t=%.6f, decided +%.2f ms, checked +%.2f ms",
            *a.key,
            a.object_id,
            a.bytes,
            a.endpoint,
            how.value,
            gone_at,
            (decided - gone_at) * 1000,
            (checked - gone_at) * 1000,
        )
        started = time.monotonic()
        try:
            result = await self.agents.free(a.endpoint, a.object_id, reason=a.reason, pod_uid=a.pod_uid)
        except AgentGone:
            result = None
        except AgentError as exc:
            self.metrics.free_failures.labels(f"agent-{exc.status}").inc()
            self._emit("GPUObject", a.key, a.uid, "Warning", "FreeFailed", f"agent at {a.endpoint}: {exc.message}")
            raise RetryLater(f"free failed: {exc}") from exc
        except AgentUnreachable as exc:
            self.metrics.free_failures.labels("unreachable").inc()
            raise RetryLater(f"agent at {a.endpoint} unreachable: {exc}") from exc
        acked = time.monotonic()
        self._agent_freed[a.uid] = (result, started, acked)
        await self._finish_free(a, result, started, acked)

    async def _finish_free(self, a: Free, result: Any, started: float, acked: float) -> None:
        """3. Let the API server finish the deletion; then count and announce the free, once."""
        outcome = "agent-gone" if result is None else ("freed" if result.freed else "noop")
        current = self.ledger.objects.get(a.key)
        known = current.finalizers if current is not None and current.uid == a.uid else None
        await self._remove_finalizer(GPUOBJECTS, a.key, a.uid, known)
        self._agent_freed.pop(a.uid, None)
        self._freed.add(a.uid)
        gone_at = self.ledger.ref_gone_at.pop(a.key, started)
        latency = acked - gone_at
        self.metrics.free_latency.observe(latency)
        self.metrics.frees.labels(outcome).inc()
        if outcome == "freed" and result is not None:
            message = (
                f"freed {result.bytes} bytes on {a.endpoint} {latency * 1000:.1f} ms after the last reference went"
            )
        elif outcome == "noop":
            message = f"agent at {a.endpoint} no longer held object {a.object_id} (already freed)"
        else:
            message = f"agent at {a.endpoint} is gone; its memory went with it"
        self._emit("GPUObject", a.key, a.uid, "Normal", "Freed", message)

    async def _check_claims(self, key: Key, uid: str, seen_rv: str | None) -> tuple[claimcheck.Plan, list]:
        """Claims that still hold the object as of ``seen_rv``, and how that was learned (claimcheck.py).

        Behind the decision, the in-order claims watch usually passes it within milliseconds while
        claims change; so wait ``claims_read_delay`` for it before reading (not once reads answer fast:
        claimcheck.ReadDelay), and take whichever of the watch and the read answers first. A read waits,
        on an API server with a claims watch cache, until that cache learns it is current: 40-100 ms.
        """
        how, blocking = await self._learn_claims(key, uid, seen_rv)
        self.metrics.claims_checks.labels(how.counted).inc()
        return how, blocking

    async def _learn_claims(self, key: Key, uid: str, seen_rv: str | None) -> tuple[claimcheck.Plan, list]:
        how = claimcheck.plan(seen_rv, self.claims_watermark)
        if how is claimcheck.Plan.LEDGER:
            return how, []
        if how is claimcheck.Plan.LATEST or self.claims_watermark is None or seen_rv is None:
            return how, claimcheck.blocking(await self._read_claims(key, None), uid, self.claims_watermark)
        if self._claims_reads is None:
            self._claims_reads = claimcheck.ReadDelay(self.claims_read_delay)
        passed = self.claims_watermark.reached(seen_rv)
        if self.progress_marker is not None:
            self.progress_marker.request(seen_rv)
        read: asyncio.Task | None = None
        try:
            if self._claims_reads.seconds > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(passed), self._claims_reads.seconds)
            if not passed.done():
                started = time.monotonic()
                read = asyncio.ensure_future(self._read_claims(key, seen_rv))
                await asyncio.wait({passed, read}, return_when=asyncio.FIRST_COMPLETED)
                if read.done() and not read.cancelled() and read.exception() is None:
                    self._claims_reads.observe(time.monotonic() - started)
            if passed.done() and not passed.cancelled():
                # The ledger holds every claim up to seen_rv.
                return (claimcheck.Plan.LEDGER if self.progress_marker is None else claimcheck.Plan.MARKER), []
            assert read is not None
            return how, claimcheck.blocking(read.result(), uid, self.claims_watermark)
        finally:
            passed.cancel()
            if read is not None:  # not needed any more: stop it, and never leave its error unretrieved
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await read

    def _decide_again_once_applied(self, key: Key, claims: list) -> None:
        """Re-decide the object once the claims watch has applied these claims' versions (the ledger
        then knows them, or their deletion); without a watch to wait on, after a second."""
        revisions = [int(c.resource_version) for c in claims if c.resource_version.isdigit()]
        if self.claims_watermark is None or len(revisions) < len(claims):
            self.queue.add_after(("object", key), 1.0)
            return
        applied = self.claims_watermark.reached(str(max(revisions)))
        applied.add_done_callback(lambda f: None if f.cancelled() else self.queue.add(("object", key), urgent=True))

    async def _read_claims(self, key: Key, at: str | None) -> list:
        """The object's claims at exactly ``at`` (or, without it or once compacted away, a consistent read)."""
        selector = f"spec.objectName={key[1]}"
        if at:
            try:
                listed = await self.kube.list(CLAIMS, key[0], field_selector=selector, exact=at)
                return [parse_claim(raw) for raw in listed["items"] if not self.is_marker(raw)]
            except Gone:
                pass  # compacted: the current state is newer, and as safe
        listed = await self.kube.list(CLAIMS, key[0], field_selector=selector)
        return [parse_claim(raw) for raw in listed["items"] if not self.is_marker(raw)]

    async def _do_ReleaseWithoutFree(self, a: ReleaseWithoutFree) -> None:
        if a.uid in self._freed:
            return  # released already; the DELETED event is on its way
        self._must_lead()
        removed = await self._remove_finalizer(GPUOBJECTS, a.key, a.uid)
        self._freed.add(a.uid)
        self.ledger.ref_gone_at.pop(a.key, None)
        if not removed:
            return  # it was gone already: nothing to count or announce
        self.metrics.frees.labels("source-lost").inc()
        self._emit("GPUObject", a.key, a.uid, "Normal", "Released", f"nothing to free: {a.reason}")

    async def _remove_finalizer(self, res, key: Key, uid: str, known: tuple[str, ...] | None = None) -> bool:
        """Remove gpuobj.io/free, testing uid and position so a concurrent change is never clobbered.

        ``known``: the finalizers the ledger last saw; when still right, no extra GET is needed.
        Returns whether this call removed it (False: the object or the finalizer was gone already).
        """
        finalizers = list(known) if known else None
        for _ in range(5):
            if finalizers is None:
                try:
                    raw = await self.kube.get(res, key[1], key[0])
                except NotFound:
                    return False
                if raw["metadata"]["uid"] != uid:
                    return False
                finalizers = raw["metadata"].get("finalizers") or []
            if names.FINALIZER_FREE not in finalizers:
                return False
            i = finalizers.index(names.FINALIZER_FREE)
            try:
                await self.kube.patch(
                    res,
                    key[1],
                    [
                        {"op": "test", "path": "/metadata/uid", "value": uid},
                        {"op": "test", "path": f"/metadata/finalizers/{i}", "value": names.FINALIZER_FREE},
                        {"op": "remove", "path": f"/metadata/finalizers/{i}"},
                    ],
                    key[0],
                    patch_type="json",
                )
                return True
            except NotFound:
                return False
            except (Invalid, Conflict):
                finalizers = None  # the list changed under us; read it again
        raise RetryLater(f"could not remove the finalizer of {key[0]}/{key[1]}")

    async def _do_DeleteObject(self, a: DeleteObject) -> None:
        self._must_lead()
        try:
            response = await self.kube.delete(GPUOBJECTS, a.key[1], a.key[0], uid=a.uid)
        except (NotFound, Conflict):
            return
        if response.get("kind") == "GPUObject" and response.get("metadata", {}).get("deletionTimestamp"):
            # The finalizer holds it: take the answer as news, so a reconcile that runs before the
            # watch event arrives does not delete (and count, and announce) the object twice.
            self.on_object("MODIFIED", response)
        self._emit("GPUObject", a.key, a.uid, "Normal", a.reason, f"deleted: {a.message}")

    def _status_not_due(self, kind: str, key: Key, urgent: bool) -> bool:
        """Hold a routine status write back for ``status_delay``: a short-lived object (a stream item,
        a cycle of put-fetch-release) is usually gone before then and costs the API server nothing.
        Urgent writes (Lost, Failed) go at once; a held write is re-decided when due, never lost."""
        if urgent or self.status_delay <= 0:
            self._status_due.pop((kind, key), None)
            return False
        now = time.monotonic()
        due = self._status_due.setdefault((kind, key), now + self.status_delay)
        if now < due:
            self.queue.add_after((kind, key), due - now)
            return True
        del self._status_due[(kind, key)]
        return False

    async def _do_PatchObjectStatus(self, a: PatchObjectStatus) -> None:
        urgent = a.status.get("state") in (names.STATE_LOST, names.STATE_FAILED)
        if self._status_not_due("object", a.key, urgent):
            return
        await self._patch_object_status(a.key, a.status)

    async def _patch_object_status(self, key: Key, status: dict) -> None:
        before = self.ledger.objects.get(key)
        try:
            patched = await self.kube.patch(GPUOBJECTS, key[1], {"status": status}, key[0], subresource="status")
        except NotFound:
            return
        if status.get("state") == names.STATE_LOST and (before is None or before.state != names.STATE_LOST):
            self.metrics.lost.inc()  # counted where it becomes Lost in the API: once, across restarts
        self.on_object("MODIFIED", patched)

    async def _do_PatchClaimStatus(self, a: PatchClaimStatus) -> None:
        if self._status_not_due("claim", a.key, a.status.get("state") == "Lost"):
            return
        try:
            patched = await self.kube.patch(CLAIMS, a.key[1], {"status": a.status}, a.key[0], subresource="status")
        except NotFound:
            return
        self.on_claim("MODIFIED", patched)

    async def _do_SetClaimOwner(self, a: SetClaimOwner) -> None:
        raw = await self.kube.get(CLAIMS, a.key[1], a.key[0])
        owners = [
            r
            for r in raw["metadata"].get("ownerReferences") or []
            if not (r.get("kind") == "Pod" and r.get("name") == a.pod_name)
        ]
        owners.append({"apiVersion": "v1", "kind": "Pod", "name": a.pod_name, "uid": a.pod_uid})
        patched = await self.kube.patch(
            CLAIMS,
            a.key[1],
            {"metadata": {"ownerReferences": owners, "resourceVersion": raw["metadata"]["resourceVersion"]}},
            a.key[0],
        )
        self.on_claim("MODIFIED", patched)

    async def _do_DeleteClaim(self, a: DeleteClaim) -> None:
        self._must_lead()
        try:
            await self.kube.delete(CLAIMS, a.key[1], a.key[0], uid=a.uid)
        except (NotFound, Conflict):
            return
        self.metrics.claims_dropped.labels(a.holder).inc()
        reason = "Expired" if a.holder == "ttl" else "HolderGone"
        self._emit("GPUObjectClaim", a.key, a.uid, "Normal", reason, a.reason)

    async def _do_Requeue(self, a: Requeue) -> None:
        self.queue.add_after((a.kind, a.key), a.seconds)

    async def _do_PatchStreamStatus(self, a: PatchStreamStatus) -> None:
        # A busy stream changes with every item: write its counters at most once per interval.
        wait = self._stream_status_interval - (time.monotonic() - self._stream_patched_at.get(a.key, 0.0))
        if wait > 0:
            self.queue.add_after(("stream", a.key), wait)
            return
        self._stream_patched_at[a.key] = time.monotonic()
        try:
            patched = await self.kube.patch(STREAMS, a.key[1], {"status": a.status}, a.key[0], subresource="status")
        except NotFound:
            return
        self.on_stream("MODIFIED", patched)

    async def _do_FinishStream(self, a: FinishStream) -> None:
        """Items that were written but never reported are on the producer's agent only: free them."""
        freed = 0
        if a.producer_endpoint:
            try:
                inventory = await self.agents.inventory(a.producer_endpoint, pod_uid=a.producer_uid)
                for item in inventory.objects:
                    if item.stream == a.key[1] and not self.ledger.describes(a.key[0], inventory.pod, item.id):
                        result = await self.agents.free(
                            a.producer_endpoint, item.id, reason="StreamDeleted", pod_uid=a.producer_uid
                        )
                        freed += result.bytes
            except AgentGone:
                pass
            except (AgentUnreachable, AgentError) as exc:
                raise RetryLater(f"producer agent: {exc}") from exc
        await self._remove_finalizer(STREAMS, a.key, a.uid)
        self._emit(
            "GPUObjectStream", a.key, a.uid, "Normal", "StreamFreed", f"stream deleted; {freed} unreported bytes freed"
        )

    async def _do_Emit(self, a: Emit) -> None:
        self._emit(a.kind, a.key, a.uid, a.type, a.reason, a.message)

    def _emit(self, kind: str, key: Key, uid: str, type_: str, reason: str, message: str) -> None:
        api_version = "v1" if kind == "Pod" else names.API_VERSION
        self.events.post(
            api_version=api_version,
            kind=kind,
            namespace=key[0],
            name=key[1],
            uid=uid,
            type_=type_,
            reason=reason,
            message=message,
        )

    # ------------------------------------------------------------ liveness of agent processes

    async def _liveness_loop(self) -> None:
        """Probe every agent pod's /v1/info: which process (incarnation) lives, or none (see liveness.py)."""
        limit = asyncio.Semaphore(32)
        self._probe_wake = wake = asyncio.Event()

        async def probe(pod: PodInfo) -> None:
            async with limit:
                try:
                    await self.probe_agent(pod)
                except Exception:  # a bug must show, and must not stop the other probes
                    log.exception("probe of the agent of %s/%s failed", *pod.key)
                    self._probe_asked.pop(pod.key, None)
                    self._probe_due[pod.key] = time.monotonic() + self.liveness_interval

        while True:
            wake.clear()
            now = time.monotonic()
            pods = self.ledger.agent_pods() if self.ledger.synced else []
            due = [p for p in pods if self._probe_due.get(p.key, 0.0) <= now]
            if due:
                await asyncio.gather(*(probe(p) for p in due), return_exceptions=True)
            # Wake for the next round, or sooner for a probe a new share asked for (PROBE_GAP after the last).
            timeout = self.liveness_interval / 2
            asked = [self._probe_due[p.key] for p in pods if p.key in self._probe_asked and p.key in self._probe_due]
            if asked:
                timeout = max(0.005, min(timeout, min(asked) - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=timeout)

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

    async def probe_agent(self, pod: PodInfo) -> None:
        started = self._probe_started[pod.key] = time.monotonic()
        liveness = self.ledger.liveness
        try:
            info = await self.agents.info(pod.endpoint, pod_uid=pod.uid, timeout=self.probe_timeout)  # type: ignore[arg-type]
        except AgentGone:
            changed = liveness.observe_refused(pod.key, pod.uid, started)
        except AgentError as exc:
            if exc.status == 409:  # the agent there serves another pod: ours is not listening
                changed = liveness.observe_refused(pod.key, pod.uid, started)
            else:  # refused our token, or failed: proves nothing about the process
                liveness.observe_unreachable(pod.key, pod.uid)
                log.debug("probe of %s/%s proved nothing: %s", *pod.key, exc)
                changed = False
        except AgentUnreachable as exc:
            liveness.observe_unreachable(pod.key, pod.uid)
            log.debug("probe of %s/%s proved nothing: %s", *pod.key, exc)
            changed = False
        else:
            if info.get("podUID") and info["podUID"] != pod.uid:
                # Another pod's agent answers at this address: ours is not there.
                changed = liveness.observe_refused(pod.key, pod.uid, started)
            else:
                changed = liveness.observe_alive(pod.key, pod.uid, str(info.get("incarnation", "")), started)
        if changed:
            state = liveness.agents.get(pod.key)
            log.info(
                "agent of pod %s/%s: %s",
                *pod.key,
                "gone" if state and state.gone else f"process {state.incarnation if state else '?'}",
            )
        self._probe_due[pod.key] = started + liveness.probe_delay(
            pod.key, self.liveness_interval, self.liveness_max_backoff
        )
        asked = self._probe_asked.get(pod.key, float("-inf"))
        if asked >= started:
            self._probe_due[pod.key] = started  # asked for while this probe ran: it may predate the share
        elif liveness.agents[pod.key].incarnation is None and started - asked < ASKED_PROBING_SECONDS:
            # Asked for (a share to scope, a restart) and nothing answers yet: a process that is still
            # starting must be reached as soon as it listens, not at the next backstop probe.
            self._probe_due[pod.key] = min(self._probe_due[pod.key], started + ASKED_PROBE_GAP)
        else:
            self._probe_asked.pop(pod.key, None)
        self.enqueue(self.ledger.suspect_records(pod.key))

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval)
            self.enqueue_all()


# Action type -> its executor. Every Action the decisions or the audit return has one (a unit test checks it).
Reconciler._executors = {
    LookupPod: Reconciler._do_LookupPod,
    AddFinalizer: Reconciler._do_AddFinalizer,
    Materialize: Reconciler._do_Materialize,
    Free: Reconciler._do_Free,
    ReleaseWithoutFree: Reconciler._do_ReleaseWithoutFree,
    DeleteObject: Reconciler._do_DeleteObject,
    PatchObjectStatus: Reconciler._do_PatchObjectStatus,
    PatchClaimStatus: Reconciler._do_PatchClaimStatus,
    SetClaimOwner: Reconciler._do_SetClaimOwner,
    DeleteClaim: Reconciler._do_DeleteClaim,
    Requeue: Reconciler._do_Requeue,
    PatchStreamStatus: Reconciler._do_PatchStreamStatus,
    FinishStream: Reconciler._do_FinishStream,
    Emit: Reconciler._do_Emit,
}


def _stub(raw: dict) -> dict:
    """What an informer must remember of a listed object to report its deletion: its identity."""
    meta = raw["metadata"]
    stub = {"metadata": {k: meta[k] for k in ("namespace", "name", "uid") if k in meta}}
    if "spec" in raw and "objectName" in (raw["spec"] or {}):
        stub["spec"] = {"objectName": raw["spec"]["objectName"]}
    return stub


def _now() -> str:
    return statuses.now_str(dt.datetime.now(dt.UTC))


def _materialize_request(obj: ObjectInfo) -> MaterializeRequest:
    """What the source agent must hold for a declared object: its layouts (a tensor's name is the API's alone)."""
    named = frozenset({"name"})
    return MaterializeRequest(
        tensors=tuple(TensorLayout.from_json(t, f"spec.tensors[{i}]", ignore=named) for i, t in enumerate(obj.tensors)),
        key=obj.key_name,
        stream=obj.stream[0] if obj.stream else None,
        stream_index=obj.stream[1] if obj.stream else None,
        shared_with=obj.shared_with,
    )
