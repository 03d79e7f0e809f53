"""Execute the ledger's decisions against the API server and the agents: workers and executors only.

Why here and not in the ledger: this is the I/O edge. Every action is idempotent and re-checked
against fresh state where a mistake would cost bytes, so a restart at any point loses nothing and
frees nothing twice. What happens next is decided elsewhere (decisions.py, statuses.py); the events
come in through intake.py, frees go through free_path.py, probes through prober.py, and what this
reconciler did and still expects to see is in expectations.py.
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
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, ApiError, Conflict, KubeClient, NotFound
from gpuobj_operator import decisions, statuses
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
from gpuobj_operator.expectations import Expectations
from gpuobj_operator.free_path import FreePath, RetryLater
from gpuobj_operator.intake import LABEL_AGENT_SELECTOR, Intake
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.model import Key, ObjectInfo, PodInfo
from gpuobj_operator.prober import Prober
from gpuobj_operator.quota import QuotaBook
from gpuobj_operator.settings import Settings
from gpuobj_operator.workqueue import WorkQueue

__all__ = ["LABEL_AGENT_SELECTOR", "Reconciler", "RetryLater", "new_ledger"]

log = logging.getLogger("gpuobj.operator")

WorkItem = tuple[str, Key]


def new_ledger(settings: Settings) -> Ledger:
    """An empty ledger with the settings' quotas and claim ttls: each term as leader starts from one."""
    return Ledger(quota=QuotaBook(settings.quota), claim_ttl=settings.claim_ttl)


class Reconciler:
    """Executes the ledger's actions against the API server and the agents; decides nothing itself."""

    _executors: ClassVar[dict[type[Action], Callable[[Reconciler, Any], Awaitable[None]]]]

    def __init__(
        self,
        kube: KubeClient,
        agents: AgentClient,
        metrics: OperatorMetrics,
        events: EventRecorder,
        settings: Settings | None = None,
        *,
        may_act: Callable[[], bool] | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.settings = settings = settings or Settings()
        self.kube, self.agents, self.metrics, self.events = kube, agents, metrics, events
        self.ledger = ledger if ledger is not None else new_ledger(settings)
        # Retries back off to 5 s at most: after an API outage every item is tried again within seconds.
        self.queue: WorkQueue[WorkItem] = WorkQueue(max_delay=5.0)
        self.expected = Expectations()
        # (kind, key) -> (the desired status last asked for, when it last changed, when first asked): a held
        # status write waits until what it would say has settled (_status_not_due).
        self._settling: dict[tuple[str, Key], tuple[str, float, float]] = {}
        self.may_act = may_act or (lambda: True)
        self._tasks: list[asyncio.Task[None]] = []
        self.prober = Prober(self.ledger, agents, self.enqueue, settings)
        self.intake = Intake(self.ledger, kube, self.expected, self.prober, settings, self.enqueue, self.enqueue_all)
        self.sync, self.on_object, self.on_claim = self.intake.sync, self.intake.on_object, self.intake.on_claim
        self.on_stream, self.on_pod = self.intake.on_stream, self.intake.on_pod
        self.free_path = FreePath(
            self.ledger, kube, agents, metrics, self.queue, self.expected, settings, self._emit, self._must_lead
        )
        self.auditor = Auditor(
            self.ledger,
            kube,
            agents,
            metrics,
            self.execute,
            self._must_lead,
            interval=settings.audit_interval,
            settle_seconds=settings.leak_settle_seconds,
            grace_seconds=settings.leak_grace_seconds,
        )

    def start(self) -> None:
        for i in range(self.settings.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"reconcile-worker-{i}"))
        self._tasks.append(asyncio.create_task(self.auditor.run(), name="audit"))
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
        if self.settings.liveness_interval > 0:
            self._tasks.append(asyncio.create_task(self.prober.run(), name="liveness"))
        if self.free_path.progress_marker is not None:
            marker = self.free_path.progress_marker.run()
            self._tasks.append(asyncio.create_task(marker, name="claims-progress-marker"))

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
        try:
            pod = self.intake.parse_pod(await self.kube.get(PODS, a.name, a.namespace))
            self.enqueue(self.ledger.upsert_pod(pod))
        except NotFound:
            self.enqueue(self.ledger.remove_pod(PodInfo(a.namespace, a.name, uid="", deleted=True)))

    async def _do_AddFinalizer(self, a: AddFinalizer) -> None:
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
            after = statuses.after_materialize_error(obj, exc.status, exc.message, _now())
            await self._patch_object_status(a.key, after.status)
            if after.retry:
                raise RetryLater(after.retry) from exc
            self._emit("GPUObject", a.key, a.uid, "Warning", after.reason, exc.message)
            return
        except AgentUnreachable as exc:
            raise RetryLater(f"agent at {a.endpoint} unreachable: {exc}") from exc
        status = statuses.materialized_object_status(
            obj,
            self.ledger.source_verdict(obj),
            self.ledger.live_claims(obj),
            object_id=a.object_id,
            pod_uid=pod.uid,
            endpoint=a.endpoint,
            incarnation=answer.incarnation,
            now=dt.datetime.now(dt.UTC),
        )
        await self._patch_object_status(a.key, status)
        self._emit(
            "GPUObject", a.key, a.uid, "Normal", "Materialized", f"agent on pod {pod.name} holds {obj.bytes} bytes"
        )

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

    def _status_not_due(self, kind: str, key: Key, urgent: bool, status: dict[str, Any]) -> bool:
        """Hold a routine status write back for ``status_delay`` (expectations.py): a short-lived object
        is usually gone before then and costs the API server nothing; it is decided again when due.

        And until what it would say has settled: when due, a status that changed less than ``status_delay``
        ago waits until it is that old (at most SETTLE_CAP delays after the first ask). Why: a hand-off
        lands as three writes (the object's create, the claim's, the object's delete) tenths of a second
        apart under load; one status after the last says what two in between would."""
        now, delay, item = time.monotonic(), self.settings.status_delay, (kind, key)
        if urgent:  # Lost, Failed: at once, whatever was settling (a release without a free follows Lost)
            self._settling.pop(item, None)
            self.expected.status_wait(kind, key, True, delay, now)  # forgets a routine write held back
            return False
        if delay > 0:
            self._note_asked(item, status, now)
        settling = self._settling.get(item)
        if settling is not None and now - settling[2] >= self.SETTLE_CAP * delay:
            self.expected.status_due.pop(item, None)  # asked for long enough: written now, settled or not
            wait = 0.0
        else:
            wait = self.expected.status_wait(kind, key, urgent, delay, now)
            if wait <= 0 and settling is not None and (wait := max(0.0, settling[1] + delay - now)) > 0:
                self.expected.status_due[item] = now + wait  # due again then (the expectations' table)
        if wait > 0:
            self.queue.add_after(item, wait)
            return True
        self._settling.pop(item, None)
        return False

    SETTLE_CAP = 4  # a status that keeps changing is written at most this many status delays after first asked

    def _note_asked(self, item: tuple[str, Key], status: dict[str, Any], now: float) -> None:
        """Remember what a held status would say and when that last changed (transition times aside)."""
        while self._settling:  # asked for long ago and never written (its record went first): forget
            oldest = next(iter(self._settling))
            if now - self._settling[oldest][2] <= 60:
                break
            del self._settling[oldest]
        said = repr(sorted((k, repr(v)) for k, v in status.items() if k != "conditions")) + repr(
            [(c.get("type"), c.get("status"), c.get("reason")) for c in status.get("conditions") or []]
        )
        previous, changed, first = self._settling.get(item, (said, now, now))
        self._settling[item] = (said, now if previous != said else changed, first)

    async def _do_PatchObjectStatus(self, a: PatchObjectStatus) -> None:
        urgent = a.status.get("state") in (names.STATE_LOST, names.STATE_FAILED)
        if self._status_not_due("object", a.key, urgent, a.status):
            return
        await self._patch_object_status(a.key, a.status)

    async def _patch_object_status(self, key: Key, status: dict[str, Any]) -> None:
        before = self.ledger.objects.get(key)
        try:
            patched = await self.kube.patch(GPUOBJECTS, key[1], {"status": status}, key[0], subresource="status")
        except NotFound:
            return
        if status.get("state") == names.STATE_LOST and (before is None or before.state != names.STATE_LOST):
            self.metrics.lost.inc()  # counted where it becomes Lost in the API: once, across restarts
        self.on_object("MODIFIED", patched)

    async def _do_PatchClaimStatus(self, a: PatchClaimStatus) -> None:
        if self._status_not_due("claim", a.key, a.status.get("state") == "Lost", a.status):
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
        reason = {"ttl": "Expired", "quota": "QuotaExceeded"}.get(a.holder, "HolderGone")
        self._emit("GPUObjectClaim", a.key, a.uid, "Normal", reason, a.reason)

    async def _do_Requeue(self, a: Requeue) -> None:
        self.queue.add_after((a.kind, a.key), a.seconds)

    async def _do_PatchStreamStatus(self, a: PatchStreamStatus) -> None:
        # A busy stream changes with every item: write its counters at most once per interval.
        if (wait := self.expected.stream_wait(a.key, self.settings.stream_status_interval, time.monotonic())) > 0:
            self.queue.add_after(("stream", a.key), wait)
            return
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
                for item in decisions.unreported_stream_items(self.ledger, a.key, inventory):
                    result = await self.agents.free(
                        a.producer_endpoint, item.id, reason="StreamDeleted", pod_uid=a.producer_uid
                    )
                    freed += result.bytes
            except AgentGone:
                pass
            except (AgentUnreachable, AgentError) as exc:
                raise RetryLater(f"producer agent: {exc}") from exc
        await self.free_path.remove_finalizer(STREAMS, a.key, a.uid)
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

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_interval)
            self.enqueue_all()


# Action type -> its executor. Every Action the decisions or the audit return has one (a unit test checks it).
Reconciler._executors = {
    LookupPod: Reconciler._do_LookupPod,
    AddFinalizer: Reconciler._do_AddFinalizer,
    Materialize: Reconciler._do_Materialize,
    Free: lambda r, a: r.free_path.free(a),
    ReleaseWithoutFree: lambda r, a: r.free_path.release_without_free(a),
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
