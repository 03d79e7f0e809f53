"""The free path: re-check an object's claims, free its bytes on the source agent, drop its finalizer.

Why a module of its own: this is where a mistake costs bytes. A free first makes sure it has every
claim up to the version the decision saw (the in-order claims watch, or a read at exactly that
version: claimcheck.py, docs/operator-free-path.md), frees on the agent (idempotent there), and only
then lets the API server finish the deletion; each step is safe to retry after a crash or a lost lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuobj_contract import names
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, Conflict, Gone, Invalid, KubeClient, NotFound, Resource
from gpuobj_operator import claimcheck
from gpuobj_operator.actions import Free, ReleaseWithoutFree
from gpuobj_operator.agent_client import AgentClient, AgentError, AgentGone, AgentUnreachable
from gpuobj_operator.expectations import Expectations
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.metrics import OperatorMetrics
from gpuobj_operator.model import ClaimInfo, Key, parse_claim
from gpuobj_operator.progress_marker import ProgressMarker
from gpuobj_operator.settings import Settings
from gpuobj_operator.workqueue import WorkQueue

log = logging.getLogger("gpuobj.operator")


class RetryLater(Exception):
    """The action could not complete now; requeue with backoff."""


def is_marker(raw: Mapping[str, Any]) -> bool:
    """A progress marker (progress_marker.py): a claim of that name is never a reference, in any
    namespace (admission lets any ServiceAccount create one in its shape: it must grant nothing)."""
    return bool(raw.get("metadata", {}).get("name") == names.CLAIMS_PROGRESS_MARKER)


Emit = Callable[[str, Key, str, str, str, str], None]


class FreePath:
    # The in-order claims watch's progress (term.py wires the claims Informer's); None: always read.
    claims_watermark: claimcheck.Watermark | None = None
    # Written to move that watch past a deletion no claim event follows (progress_marker.py); None: reads only.
    progress_marker: ProgressMarker | None = None
    _claims_reads: claimcheck.ReadDelay | None = None

    def __init__(
        self,
        ledger: Ledger,
        kube: KubeClient,
        agents: AgentClient,
        metrics: OperatorMetrics,
        queue: WorkQueue[tuple[str, Key]],
        expected: Expectations,
        settings: Settings,
        emit: Emit,
        must_lead: Callable[[], None],
    ) -> None:
        self.ledger = ledger
        self.kube = kube
        self.agents = agents
        self.metrics = metrics
        self.queue = queue
        self.expected = expected
        self.settings = settings
        self.emit = emit
        self.must_lead = must_lead  # raises RetryLater when a paused leader may have been replaced meanwhile

    async def free(self, a: Free) -> None:
        if a.uid in self.expected.freed:
            return  # freed already; the DELETED event is on its way
        self.must_lead()
        if a.uid in self.expected.agent_freed:  # freed on the agent by an earlier try; only the finalizer failed
            await self._finish_free(a, *self.expected.agent_freed[a.uid])
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
        self.must_lead()  # again: the check may have waited (a read of claims, tens of ms)
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
            self.emit("GPUObject", a.key, a.uid, "Warning", "FreeFailed", f"agent at {a.endpoint}: {exc.message}")
            raise RetryLater(f"free failed: {exc}") from exc
        except AgentUnreachable as exc:
            self.metrics.free_failures.labels("unreachable").inc()
            raise RetryLater(f"agent at {a.endpoint} unreachable: {exc}") from exc
        acked = time.monotonic()
        self.expected.agent_freed[a.uid] = (result, started, acked)
        await self._finish_free(a, result, started, acked)

    async def _finish_free(self, a: Free, result: Any, started: float, acked: float) -> None:
        """3. Let the API server finish the deletion; then count and announce the free, once."""
        outcome = "agent-gone" if result is None else ("freed" if result.freed else "noop")
        current = self.ledger.objects.get(a.key)
        known = current.finalizers if current is not None and current.uid == a.uid else None
        await self.remove_finalizer(GPUOBJECTS, a.key, a.uid, known)
        self.expected.agent_freed.pop(a.uid, None)
        self.expected.freed.add(a.uid)
        gone_at = self.ledger.ref_gone_at.pop(a.key, started)
        latency = acked - gone_at
        self.metrics.free_latency.observe(latency)
        self.metrics.frees.labels(outcome).inc()
        if outcome == "freed" and result is not None:
            # The routine end of every lifecycle: logged and counted (gpuobj_frees_total, the latency
            # histogram), not an Event. An Event is an API write, one more per lifecycle, for news that
            # nobody has to act on; Events stay for what a person must notice (below, Lost, failures).
            log.info(
                "freed %s/%s: %d bytes on %s %.1f ms after the last reference went",
                *a.key,
                result.bytes,
                a.endpoint,
                latency * 1000,
            )
            return
        if outcome == "noop":
            message = f"agent at {a.endpoint} no longer held object {a.object_id} (already freed)"
        else:
            message = f"agent at {a.endpoint} is gone; its memory went with it"
        self.emit("GPUObject", a.key, a.uid, "Normal", "Freed", message)

    async def _check_claims(self, key: Key, uid: str, seen_rv: str | None) -> tuple[claimcheck.Plan, list[ClaimInfo]]:
        """Claims that still hold the object as of ``seen_rv``, and how that was learned (claimcheck.py).

        Behind the decision, the in-order claims watch usually passes it within milliseconds while
        claims change; so wait ``claims_read_delay`` for it before reading (not once reads answer fast:
        claimcheck.ReadDelay), and take whichever of the watch and the read answers first. A read waits,
        on an API server with a claims watch cache, until that cache learns it is current: 40-100 ms.
        """
        how, blocking = await self._learn_claims(key, uid, seen_rv)
        self.metrics.claims_checks.labels(how.counted).inc()
        return how, blocking

    async def _learn_claims(self, key: Key, uid: str, seen_rv: str | None) -> tuple[claimcheck.Plan, list[ClaimInfo]]:
        how = claimcheck.plan(seen_rv, self.claims_watermark)
        if how is claimcheck.Plan.LEDGER:
            return how, []
        if how is claimcheck.Plan.LATEST or self.claims_watermark is None or seen_rv is None:
            return how, claimcheck.blocking(await self._read_claims(key, None), uid, self.claims_watermark)
        if self._claims_reads is None:
            self._claims_reads = claimcheck.ReadDelay(self.settings.claims_read_delay)
        passed = self.claims_watermark.reached(seen_rv)
        if self.progress_marker is not None:
            self.progress_marker.request(seen_rv)
        read: asyncio.Future[list[ClaimInfo]] | None = None
        try:
            if self._claims_reads.seconds > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(passed), self._claims_reads.seconds)
            if not passed.done():
                started = time.monotonic()
                read = asyncio.ensure_future(self._read_claims(key, seen_rv))
                either: set[asyncio.Future[Any]] = {passed, read}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
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

    def _decide_again_once_applied(self, key: Key, claims: list[ClaimInfo]) -> None:
        """Re-decide the object once the claims watch has applied these claims' versions (the ledger
        then knows them, or their deletion); without a watch to wait on, after a second."""
        revisions = [int(c.resource_version) for c in claims if c.resource_version.isdigit()]
        if self.claims_watermark is None or len(revisions) < len(claims):
            self.queue.add_after(("object", key), 1.0)
            return
        applied = self.claims_watermark.reached(str(max(revisions)))
        applied.add_done_callback(lambda f: None if f.cancelled() else self.queue.add(("object", key), urgent=True))

    async def _read_claims(self, key: Key, at: str | None) -> list[ClaimInfo]:
        """The object's claims at exactly ``at`` (or, without it or once compacted away, a consistent read)."""
        selector = f"spec.objectName={key[1]}"
        if at:
            try:
                listed = await self.kube.list(CLAIMS, key[0], field_selector=selector, exact=at)
                return [parse_claim(raw) for raw in listed["items"] if not is_marker(raw)]
            except Gone:
                pass  # compacted: the current state is newer, and as safe
        listed = await self.kube.list(CLAIMS, key[0], field_selector=selector)
        return [parse_claim(raw) for raw in listed["items"] if not is_marker(raw)]

    async def release_without_free(self, a: ReleaseWithoutFree) -> None:
        if a.uid in self.expected.freed:
            return  # released already; the DELETED event is on its way
        self.must_lead()
        removed = await self.remove_finalizer(GPUOBJECTS, a.key, a.uid)
        self.expected.freed.add(a.uid)
        self.ledger.ref_gone_at.pop(a.key, None)
        if not removed:
            return  # it was gone already: nothing to count or announce
        self.metrics.frees.labels("source-lost").inc()
        self.emit("GPUObject", a.key, a.uid, "Normal", "Released", f"nothing to free: {a.reason}")

    async def remove_finalizer(self, res: Resource, key: Key, uid: str, known: tuple[str, ...] | None = None) -> bool:
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
