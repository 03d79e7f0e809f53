"""Write-behind: the client's GPUObject and claim writes leave the caller's path.

Why: a lifecycle cycle used to wait for four API writes in series (create object, create
claim, delete claim, delete object). Here `put`, `share` and `release` only queue their
writes and return; the queue sends them in the background. What must still hold:

- Order per object. An object and the claims this process makes for it form a *family*
  whose writes go out one after another, in the order they were queued: the object is
  created before a claim on it, and a hand-off's claim is created before the sender's
  release of the object is sent (docs/design.md, "Borrow and hand-off"). Families are sent concurrently
  (pipelined), so one slow object never holds up the others.
- Elision. A family's first write waits `window` seconds. If every reference in it is
  released before that (put, hand-off, fetch, release all inside the window), none of its
  writes is sent and the object is freed at once by the caller; while it lived it was in
  the agent's inventory and metrics like any object, so the audit saw its bytes.
- Never drop a write. Failures that may pass (connection refused, timeouts, 5xx, 429) are
  retried with backoff, in order, until the write lands or the process exits. A create the
  API refuses for good (400/422, or a 403 that lasts `forbidden_grace` seconds) fails its
  family: the caller frees the bytes (nothing can reference them) and the handle says so.
  A create answered 409 AlreadyExists by an object that is not ours (another pod holds the
  name) is such a refusal: NameTakenError, on the handle and from `flush`.
  An API server that has just restarted answers 403 until its RBAC cache is filled, so a
  create refused with 403 is retried for a short while, and a delete (a release) is retried
  whatever the refusal.
- A claim made on a receiver's behalf names the receiver pod's uid (its ownerReference). When
  the caller does not know it, it is read here, just before the claim's create, so `share`
  needs no API read on the caller's path (it succeeds during an outage, like a put). A
  receiver that does not exist fails that claim alone (PodNotFoundError, from `flush`).
- Every refusal for good is also raised, once, by the next `flush`.
- Recording policy (`record`, $GPUOBJ_RECORD): with "shared" (the default), a *private* object (unnamed, put by this
  process into its own in-process agent, shared with no one) is never written: its family is held, and
  its bytes die with the process. Its first claim (a `share`, a `borrow`) makes it shared: the held
  create is queued first, then the claim, and the family is sent once it has lived past the window.
  The agent's inventory marks a held object `private`, so the audit neither counts nor reclaims it.
- Bounded concurrency: at most `concurrency` families are sent at once, starting from 1 and doubling
  per round of writes that land (slow start), fewer while the API server throttles (a 429, even one the
  kube client retried after its Retry-After; a timeout; a 5xx) or answers a write later than 0.5 s (its
  queues filling): the limit halves, and grows back by one per round of writes that land; under one it
  paces the writes, one at a time with a gap (congestion.py). A fleet of pods cannot be bounded from one
  of them; each backing off is what keeps the API server's queue short.
- The fleet's budget: when the operator tells this pod's agent a write rate (its share of a cluster-wide
  budget, `--fleet-write-budget`), each family's first write waits for its slot at that rate and the
  rest follow it at once, each moving the schedule on by a slot (congestion.FleetPace). A family whose
  first write still waits for its slot when its last reference goes is taken back, as inside the
  window: the API server never sees it.
- Bounded memory and backpressure: at most `max_pending` writes wait. A create that finds
  the queue full waits for room, and after `backpressure_timeout` raises
  WriteBehindFullError naming the last API error. Releases are never refused (a release is
  bounded by the handles that exist).

The decisions are plain Python over Family/Record; only `_send` does I/O (the KubeClient).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gpuobj.client.congestion import FleetPace, InFlightLimit, jittered
from gpuobj.client.errors import GpuObjError, NameTakenError, PermissionDeniedError, PodNotFoundError
from gpuobj_contract import resources as crd
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, ApiError, ApiTimeout, Conflict, KubeClient, NotFound

log = logging.getLogger("gpuobj.client.writebehind")

DEFAULT_WINDOW = 0.1
DEFAULT_MAX_PENDING = 10_000
DEFAULT_CONCURRENCY = 16
BACKOFF_START = 0.05
BACKOFF_MAX = 2.0
PERMANENT = (400, 403, 422)  # the API refuses this write for good: retrying cannot help
# ... except a 403 for this long: a kube-apiserver that has just restarted refuses every request
# with 403 until its RBAC informers have synced (about a second; `clusterrole ... not found`).
FORBIDDEN_GRACE = 10.0


class WriteBehindFullError(GpuObjError):
    """Too many API writes are waiting: the API server is slow or unreachable."""


class WriteFailedError(GpuObjError):
    """The API server refused to record an object or claim; its bytes were freed."""


class WriteForbiddenError(WriteFailedError, PermissionDeniedError):
    """The API server refused this pod's identity (403) for longer than a restart explains."""


@dataclass(eq=False)
class Record:
    """One API object (GPUObject or claim) this process writes, and what is known of it."""

    kind: str  # "object" | "claim"
    namespace: str
    name: str
    uid: str = ""  # known once its create landed
    queued: int = 0  # writes about it not yet landed (the handle's `pending`)
    live: bool = True  # its reference is still held
    created: bool = False
    failed: BaseException | None = None
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    holder: str = ""  # a claim made on a receiver's behalf: the pod that may release it at the source

    @property
    def pending(self) -> bool:
        return self.queued > 0


@dataclass(eq=False)
class Write:
    verb: str  # "create" | "delete"
    record: Record
    body: dict[str, Any] | None = None
    # A claim for a receiver whose pod uid the caller did not know: (namespace, pod name), read before the create.
    owner_pod: tuple[str, str] | None = None


class _NotOurs(Exception):
    """A create's name is held by an API object that this process did not make."""


@dataclass(eq=False)
class Family:
    """An object and the claims this process made for it: written in order."""

    namespace: str
    object_name: str
    born: float
    object_id: str | None = None  # a local object (this process is its source): freed by us if elided
    writes: deque[Write] = field(default_factory=deque)
    records: dict[str, Record] = field(default_factory=dict)  # by (kind:name)
    started: bool = False  # its window ended: its writes go out (elision only while none has been sent)
    sent: bool = False  # a write of it went to the API: elision is no longer possible
    slot: asyncio.Event | None = None  # set while its first write waits for its slot in the fleet's budget
    held: Write | None = None  # a private object's create, queued only once the object is shared
    running: bool = False
    failed: BaseException | None = None

    @property
    def live(self) -> bool:
        return any(r.live for r in self.records.values())

    @property
    def object_record(self) -> Record | None:
        return self.records.get(f"object:{self.object_name}")


@dataclass(frozen=True)
class ReleaseOutcome:
    """What the caller must do after a release: free an elided local object, or nothing."""

    elided: bool
    free_object_id: str | None = None


FreeFn = Callable[[str], Awaitable[Any]]
PodUidFn = Callable[[str, str], Awaitable[str]]  # (namespace, pod) -> uid; PodNotFoundError if there is none

# What became of one write: sent (landed), or refused for good, failing its family or that write alone.
SENT, FAILED_FAMILY, FAILED_WRITE = "sent", "failed-family", "failed-write"


class WriteBehind:
    """The queue. All methods run on the client's loop."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        free_local: FreeFn,
        window: float = DEFAULT_WINDOW,
        max_pending: int = DEFAULT_MAX_PENDING,
        concurrency: int = DEFAULT_CONCURRENCY,
        backpressure_timeout: float = 30.0,
        forbidden_grace: float = FORBIDDEN_GRACE,
        clock: Callable[[], float] = time.monotonic,
        on_record_pending: Callable[[str, bool], None] | None = None,
        pod_uid: PodUidFn | None = None,
        on_private: Callable[[str, bool], None] | None = None,
        write_rate: Callable[[], float | None] | None = None,
    ) -> None:
        """``on_record_pending(object_id, pending)``: told when an object's create is queued (True) and
        when it landed, was taken back or failed (False): the local agent's inventory says so.
        ``pod_uid``: reads a receiver pod's uid for a claim queued without one (`create_claim(owner_pod=)`).
        ``on_private(object_id, private)``: told when a private object's create is held (True) and when it
        is queued, taken back or freed (False); without it (policy "all") no object is private.
        ``write_rate()``: this pod's share of the fleet's write budget (writes a second) as the operator last
        told our agent, or None (no budget): each write waits for its slot (congestion.FleetPace)."""
        self.kube = kube
        self.pod_uid = pod_uid
        self.free_local = free_local
        self.on_record_pending = on_record_pending or (lambda object_id, pending: None)
        self.on_private = on_private
        self.window = window
        self.max_pending = max_pending
        self.backpressure_timeout = backpressure_timeout
        self.forbidden_grace = forbidden_grace
        self.clock = clock
        self.families: dict[tuple[str, str], Family] = {}
        self._index: dict[tuple[str, str, str], Family] = {}  # (kind, namespace, name) -> family
        self.pending_writes = 0
        self.last_error: str | None = None
        self.failing_since: float | None = None
        self.counts = {
            "sent": 0,
            "elided_families": 0,
            "elided_while_paced": 0,
            "retries": 0,
            "failed": 0,
            "private": 0,
        }
        self.unreported: list[BaseException] = []  # refusals for good that no flush has raised yet
        # Slow start from 1 (congestion.py): a fleet that starts at once does not open at its ceiling.
        self.in_flight = InFlightLimit(concurrency, initial=1)
        # This pod's share of the fleet's write budget, as the operator last told its agent (None: no budget).
        self.pace = FleetPace(write_rate or (lambda: None))
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._closed = False

    # -- queueing (pure bookkeeping, then a kick) ---------------------------------------
    async def _wait_room(self) -> None:
        if self.pending_writes < self.max_pending:
            return
        deadline = self.clock() + self.backpressure_timeout
        while self.pending_writes >= self.max_pending:
            left = deadline - self.clock()
            if left <= 0:
                since = "" if self.failing_since is None else f" for {self.clock() - self.failing_since:.1f}s"
                raise WriteBehindFullError(
                    f"{self.pending_writes} API writes are waiting (limit {self.max_pending}); the API server"
                    f" has not kept up{since} (last error: {self.last_error or 'none, it is slow'}). "
                    "Nothing was dropped: release objects or retry once the API server answers."
                )
            await self._wait_change(left)

    def _family(self, namespace: str, object_name: str) -> Family:
        key = (namespace, object_name)
        fam = self.families.get(key)
        if fam is None:
            fam = Family(namespace, object_name, self.clock())
            self.families[key] = fam
            self._schedule(fam, self.window)
        return fam

    def _queue(self, fam: Family, write: Write) -> None:
        fam.writes.append(write)
        write.record.queued += 1
        write.record.landed.clear()
        self.pending_writes += 1
        if fam.started:
            self._kick(fam)

    async def create_object(
        self, namespace: str, name: str, body: dict[str, Any], object_id: str, *, private: bool = False
    ) -> Record:
        """Queue a GPUObject create; returns its record at once (after backpressure, if full).

        ``private``: the object is unnamed and shared with no one; with a private-capable agent its create
        is held (no write, no room taken) until a claim makes it shared."""
        private = private and self.on_private is not None
        if not private:
            await self._wait_room()
        if (namespace, name) in self.families:
            raise NameTakenError(
                f"GPUObject {namespace}/{name}: this process already holds an object of that name; "
                "choose another name (or omit it for a generated one)"
            )
        fam = self._family(namespace, name)
        fam.object_id = object_id
        rec = Record("object", namespace, name)
        self._add(fam, rec)
        if private:
            assert self.on_private is not None
            fam.held = Write("create", rec, body)
            self.counts["private"] += 1
            self.on_private(object_id, True)
            return rec
        self._queue(fam, Write("create", rec, body))
        self.on_record_pending(object_id, True)
        return rec

    def _unhold(self, fam: Family) -> None:
        """A private object's first claim: its create goes first, and the family is sent once it has
        lived past the window (at once if it already has)."""
        held, fam.held = fam.held, None
        if held is None:
            return
        self._queue(fam, held)
        if fam.object_id is not None:
            self.on_record_pending(fam.object_id, True)
            if self.on_private is not None:
                self.on_private(fam.object_id, False)
        self._schedule(fam, max(0.0, fam.born + self.window - self.clock()))

    async def create_claim(
        self, namespace: str, object_name: str, claim_name: str, body: dict[str, Any], *, owner_pod: str | None = None
    ) -> Record:
        """Queue a claim create, ordered after its object's create when this process queued that.

        ``owner_pod``: the body's Pod ownerReference has no uid yet; it is read just before the create."""
        if owner_pod is not None and self.pod_uid is None:
            raise ValueError("create_claim(owner_pod=) needs a WriteBehind made with pod_uid=")
        await self._wait_room()
        fam = self._family(namespace, object_name)
        if fam.failed is not None:
            raise WriteFailedError(f"GPUObject {namespace}/{object_name} could not be recorded: {fam.failed}")
        self._unhold(fam)
        rec = Record("claim", namespace, claim_name)
        self._add(fam, rec)
        self._queue(fam, Write("create", rec, body, (namespace, owner_pod) if owner_pod is not None else None))
        return rec

    def find(self, kind: str, namespace: str, name: str) -> tuple[Family, Record] | None:
        fam = self._index.get((kind, namespace, name))
        if fam is None or self.families.get((fam.namespace, fam.object_name)) is not fam:
            return None
        rec = fam.records.get(f"{kind}:{name}")
        return None if rec is None else (fam, rec)

    def released(self, namespace: str, object_name: str) -> bool:
        """Every reference to this object that this process made (its own, its hand-offs) is released."""
        fam = self.families.get((namespace, object_name))
        return fam is None or not fam.live

    def _add(self, fam: Family, rec: Record) -> None:
        fam.records[f"{rec.kind}:{rec.name}"] = rec
        self._index[(rec.kind, rec.namespace, rec.name)] = fam

    def _forget(self, fam: Family) -> None:
        if fam.object_id is not None:
            self.on_record_pending(fam.object_id, False)  # landed, taken back or failed: nothing waits
            if fam.held is not None and self.on_private is not None:
                self.on_private(fam.object_id, False)
        if self.families.get((fam.namespace, fam.object_name)) is fam:
            del self.families[(fam.namespace, fam.object_name)]
        for rec in fam.records.values():
            if self._index.get((rec.kind, rec.namespace, rec.name)) is fam:
                del self._index[(rec.kind, rec.namespace, rec.name)]

    def release(
        self, kind: str, namespace: str, name: str, uid: str = "", object_name: str | None = None
    ) -> ReleaseOutcome:
        """Drop a reference: cancel its unsent create (elision) or queue its delete. Never refused."""
        found = self.find(kind, namespace, name)
        if found is None:
            # Not ours (or from before a restart of this client): a plain, ordered, retried delete.
            fam = Family(namespace, f"{kind}:{name}:{id(self)}", self.clock(), started=True)
            self.families[(namespace, fam.object_name)] = fam
            rec = Record(kind, namespace, name, uid=uid, created=True, live=False)
            fam.records[f"{kind}:{name}"] = rec  # not indexed: a later release of the same name is its own
            self._queue(fam, Write("delete", rec))
            return ReleaseOutcome(False)
        fam, rec = found
        if not rec.live:
            return ReleaseOutcome(False)  # idempotent
        rec.live = False
        if rec.failed is not None and fam.failed is None:
            return ReleaseOutcome(False)  # a claim refused for good: nothing in the API to delete
        if (not fam.started or fam.slot is not None) and fam.failed is None and not fam.live:
            # The whole family lived inside the window, or until its first write's slot in the fleet's
            # budget: none of its writes went out. Take them back.
            if fam.slot is not None:
                fam.slot.set()  # its writer stops waiting, gives its slot back and sends nothing
                self.counts["elided_while_paced"] += 1
            self._drop(fam)
            self.counts["elided_families"] += 1
            return ReleaseOutcome(True, fam.object_id)
        if fam.failed is not None:  # never recorded, and its bytes were freed already
            if not fam.live and not fam.running:
                self._forget(fam)
            return ReleaseOutcome(False)
        self._queue(fam, Write("delete", rec))
        return ReleaseOutcome(False)

    def _drop(self, fam: Family) -> None:
        for w in fam.writes:
            self._landed(w)
        fam.writes.clear()
        self._forget(fam)
        self._notify()

    def _landed(self, w: Write) -> None:
        w.record.queued -= 1
        if w.record.queued <= 0:
            w.record.queued = 0
            w.record.landed.set()
        self.pending_writes -= 1
        self._notify()

    # -- sending ------------------------------------------------------------------------
    def _schedule(self, fam: Family, delay: float) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            self._timers.discard(handle)
            self._start(fam)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def _start(self, fam: Family) -> None:
        if self.families.get((fam.namespace, fam.object_name)) is not fam or fam.held is not None:
            return  # elided or done, or private: held until a claim makes it shared
        fam.started = True
        self._kick(fam)

    def _kick(self, fam: Family) -> None:
        if fam.running or not fam.writes or self._closed:
            return
        fam.running = True
        task = asyncio.get_running_loop().create_task(self._run(fam), name=f"gpuobj-write-{fam.object_name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, fam: Family) -> None:
        try:
            await self.in_flight.acquire()
            try:
                first = True  # of this run: it waits for a slot, the writes queued behind it follow
                while fam.writes:
                    w = fam.writes[0]
                    if not await self._wait_slot(fam, first):
                        break  # taken back while it waited: nothing of it was sent
                    first = False
                    outcome = await self._send_retrying(fam, w)
                    if fam.writes and fam.writes[0] is w:
                        fam.writes.popleft()
                        self._landed(w)
                    if outcome == FAILED_FAMILY:
                        await self._fail(fam)
                        break
                    if outcome == FAILED_WRITE:
                        self.counts["failed"] += 1
            finally:
                self.in_flight.release()
        finally:
            fam.running = False
            if not fam.writes and not fam.live:
                self._forget(fam)
            self._notify()

    async def _fail(self, fam: Family) -> None:
        """A create was refused for good: nothing can reference the object, so free it and drop the rest."""
        self.counts["failed"] += 1
        for w in list(fam.writes):
            if w.verb == "create" or w.record.created is False:
                w.record.failed = fam.failed
        for w in fam.writes:
            self._landed(w)
        fam.writes.clear()
        rec = fam.object_record
        if fam.object_id is not None:
            self.on_record_pending(fam.object_id, False)  # it never will be recorded
        if fam.object_id is not None and rec is not None and not rec.created:
            with contextlib.suppress(Exception):
                await self.free_local(fam.object_id)

    def _refuse(self, fam: Family | None, w: Write, error: BaseException) -> None:
        """Record a refusal for good on the write's record (and family), for the handle and the next flush."""
        w.record.failed = error
        if fam is not None:
            fam.failed = error
        self.unreported.append(error)

    async def _wait_slot(self, fam: Family, first: bool) -> bool:
        """Wait for this family's slot in the pod's share of the fleet's budget (congestion.FleetPace): the
        first write of a run waits, the writes queued behind it go at once and move the schedule on (a
        family lands as one change, so the operator settles it with one status). False when the family was
        taken back while it waited: its first write never went out, so none does."""
        if not first:
            self.pace.charge()
            return True
        delay = self.pace.reserve()
        if delay <= 0:
            return True
        if fam.sent:  # a later run of a family already written (its release, a new claim): no taking back
            await asyncio.sleep(delay)
            return True
        fam.slot = taken_back = asyncio.Event()
        due = time.monotonic() + delay
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await taken_back.wait()
        finally:
            fam.slot = None
        if taken_back.is_set():
            self.pace.give_back(max(0.0, due - time.monotonic()))
            return False
        return True

    async def _send_retrying(self, fam: Family, w: Write) -> str:
        delay = BACKOFF_START
        forbidden_since: float | None = None
        fam.sent = True
        while True:
            throttled_before = self.kube.throttled
            started = time.monotonic()
            try:
                await self._send(fam, w)
                # A 429 the kube client waited out (Retry-After) still says the API server is overloaded, and
                # a slow answer says its queues fill (congestion.py): both cut the writes in flight.
                self.in_flight.observe(self.kube.throttled > throttled_before, time.monotonic() - started)
                self.counts["sent"] += 1
                self.failing_since = None
                return SENT
            except _NotOurs as exc:
                log.error("gpuobj: %s", exc)
                self._refuse(
                    fam if w.record.kind == "object" else None,
                    w,
                    NameTakenError(f"{exc}; choose another name (or omit it for a generated one); bytes freed"),
                )
                return FAILED_FAMILY if w.record.kind == "object" else FAILED_WRITE
            except PodNotFoundError as exc:  # the receiver of a share does not exist: that claim alone fails
                self._refuse(None, w, exc)
                return FAILED_WRITE
            except ApiError as exc:
                if exc.status == 403 and forbidden_since is None:
                    forbidden_since = self.clock()
                if self._refused_for_good(w, exc, forbidden_since):
                    log.error(
                        "gpuobj: the API server refused %s %s %s/%s: %s",
                        w.verb,
                        w.record.kind,
                        w.record.namespace,
                        w.record.name,
                        exc,
                    )
                    error = WriteForbiddenError if exc.status == 403 else WriteFailedError
                    self._refuse(
                        fam,
                        w,
                        error(
                            f"{w.verb} of {w.record.kind} {w.record.namespace}/{w.record.name} refused: {exc}"
                            + (
                                f" (still after {self.forbidden_grace:g}s: bind the pod's ServiceAccount to the "
                                "gpuobj workload Role, charts/gpuobj or deploy/)"
                                if exc.status == 403
                                else ""
                            )
                        ),
                    )
                    return FAILED_FAMILY
                if _overloaded(exc) or self.kube.throttled > throttled_before:
                    self.in_flight.observe(True)
                self._note_failure(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection refused, reset, timeout: the API server may come back
                if isinstance(exc, TimeoutError):
                    self.in_flight.observe(True)
                self._note_failure(exc)
            self.counts["retries"] += 1
            await asyncio.sleep(jittered(delay))
            delay = min(delay * 2, BACKOFF_MAX)

    def _refused_for_good(self, w: Write, exc: ApiError, forbidden_since: float | None) -> bool:
        """Whether retrying ``w`` cannot help. A release is never given up. A 403 may come from an API
        server that has just restarted (its RBAC cache not filled yet, seen in the chaos suite): a
        create is retried for ``forbidden_grace`` seconds from its first 403 before it counts."""
        if w.verb == "delete":
            return False
        if exc.status == 403:
            return forbidden_since is not None and self.clock() - forbidden_since >= self.forbidden_grace
        return exc.status in PERMANENT or (exc.status == 404 and w.verb == "create")

    def _note_failure(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        if self.failing_since is None:
            self.failing_since = self.clock()
            log.warning("gpuobj: API writes are failing, retrying with backoff: %s", self.last_error)

    async def _send(self, fam: Family, w: Write) -> None:
        rec = w.record
        res = GPUOBJECTS if rec.kind == "object" else CLAIMS
        if w.verb == "create":
            assert w.body is not None
            body = w.body
            obj_rec = fam.object_record
            if rec.kind == "claim" and obj_rec is not None and obj_rec.uid:
                # Pin the incarnation we created.
                claim = crd.GPUObjectClaimSpec.from_json(body["spec"])
                body["spec"] = dataclasses.replace(claim, object_uid=obj_rec.uid).to_json()
            if w.owner_pod is not None:
                assert self.pod_uid is not None
                uid = await self.pod_uid(*w.owner_pod)  # the receiver's current incarnation
                for owner in body["metadata"].get("ownerReferences", []):
                    if owner.get("kind") == "Pod" and owner.get("name") == w.owner_pod[1]:
                        owner["uid"] = uid
                w.owner_pod = None
            try:
                created = await self.kube.create(res, body, rec.namespace)
            except Conflict as exc:
                if not exc.already_exists:
                    raise
                # An earlier try landed but its answer was lost: take it if it is ours.
                try:
                    created = await self.kube.get(res, rec.name, rec.namespace)
                except NotFound:
                    raise exc from None  # deleted meanwhile: try the create again
                if not _ours(rec.kind, created, body):
                    kind = "GPUObject" if rec.kind == "object" else "GPUObjectClaim"
                    raise _NotOurs(
                        f"{kind} {rec.namespace}/{rec.name} already exists and is not this process's"
                        f" ({_whose(rec.kind, created)})"
                    ) from exc
            rec.uid = created["metadata"]["uid"]
            rec.created = True
            if rec.kind == "object" and fam.object_id is not None:
                self.on_record_pending(fam.object_id, False)  # described by a GPUObject from now on
        else:
            try:
                await self.kube.delete(res, rec.name, rec.namespace, uid=rec.uid or None)
            except (NotFound, Conflict):
                pass  # already gone, or a successor of the same name that is not ours

    # -- waiting --------------------------------------------------------------------------
    def _notify(self) -> None:
        # Wakes every current waiter (their futures are resolved by set), then re-arms.
        self._changed.set()
        self._changed.clear()

    async def _wait_change(self, left: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await self._changed.wait()

    async def flush(self, timeout: float, *, raise_refused: bool = True) -> None:
        """Send everything queued now (windows cut short) and wait until it landed.

        Then raise the first write refused for good since the last flush (NameTakenError,
        PodNotFoundError, WriteFailedError), with the others as notes, unless ``raise_refused`` is off."""
        for fam in list(self.families.values()):
            if not fam.started:
                self._start(fam)
        deadline = self.clock() + timeout
        while self.pending_writes > 0:
            left = deadline - self.clock()
            if left <= 0:
                raise TimeoutError(
                    f"{self.pending_writes} API writes still pending after {timeout:g}s"
                    f" (last error: {self.last_error or 'none'})"
                )
            await self._wait_change(min(left, 0.5))
        refused, self.unreported = self.unreported, []
        if refused and raise_refused:
            first = refused[0]
            for other in refused[1:]:
                first.add_note(f"also refused: {type(other).__name__}: {other}")
            raise first

    async def close(self) -> None:
        """Stop sending (what is still queued is lost with the process, as documented)."""
        self._closed = True
        for h in list(self._timers):
            h.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        return {
            "pending": self.pending_writes,
            "families": len(self.families),
            "lastError": self.last_error,
            "inFlightLimit": self.in_flight.limit,
            "throttledCuts": self.in_flight.cuts,
            "slowWrites": self.in_flight.slow_writes,
            "fleetRate": self.pace.rate(),
            "pacedWrites": self.pace.waits,
            "pacedSeconds": round(self.pace.waited_s, 3),
            **self.counts,
        }


def _overloaded(exc: ApiError) -> bool:
    """An answer that says the API server cannot keep up: throttled, timed out, or failing."""
    return exc.status == 429 or exc.status >= 500 or isinstance(exc, ApiTimeout)


def _ours(kind: str, created: dict[str, Any], body: dict[str, Any]) -> bool:
    """Whether what holds our name is what an earlier try of ours created (its answer lost): a GPUObject of
    the same agent object (spec.objectId), a claim on the same GPUObject (spec.objectName; its objectUID is
    left out, as the one we pinned may differ from a retry's)."""
    if created.get("spec") == body.get("spec"):
        return True
    try:
        if kind == "object":
            theirs, mine = (crd.GPUObjectSpec.from_json(b.get("spec")) for b in (created, body))
            return theirs.object_id == mine.object_id
        held, wanted = (crd.GPUObjectClaimSpec.from_json(b.get("spec")) for b in (created, body))
        return held.object_name == wanted.object_name
    except (ValueError, TypeError, AttributeError):  # not a spec of this kind's shape: not ours
        return False


def _whose(kind: str, created: dict[str, Any]) -> str:
    """Who holds the name, as far as its spec says: a GPUObject's source pod, a claim's holder pod."""
    try:
        if kind == "object":
            return f"source pod {crd.GPUObjectSpec.from_json(created.get('spec')).source.pod_name}"
        holder = crd.GPUObjectClaimSpec.from_json(created.get("spec")).holder
        return f"holder pod {holder.pod_name if holder is not None else '?'}"
    except (ValueError, TypeError, AttributeError):
        return "a spec this client cannot read"
