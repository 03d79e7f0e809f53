"""Fetch: read another agent's object into new local tensors with one-sided NIXL READs.

Why the steps are what they are:
1. Take a read ticket from the source (`POST /v1/objects/{id}/reads`). It carries the
   NIXL metadata of just this object's regions, and while it lives the source will not
   free the object, so our readers are never stale. A freed or unknown object is a clean
   404 here, before any transfer; an unreachable source is a clean connection error.
2. Load the metadata into our reader NIXL agent (cached per source; agents the source
   reports retired, or that disconnected, are dropped: a ticket or a new grant lists the
   source's live agents, so a reader holds a few per source, not one per version the fence
   retired) and READ on a transfer thread, so
   the event loop (and the control server on it) never waits for data (docs/design.md, "out-of-order deadlock"). CPU
   destinations are carved from registered, pre-faulted landing buffers (buffers.py).
   Every wait has a deadline; cancellation aborts the transfer.
3. End the ticket: the READ carries a note NIXL delivers to the source once the data
   was read, which ends it there (no second request). If the read finished well inside
   its lease the bytes are good no matter when the source hears of it; otherwise we ask
   the source (DELETE) whether the ticket was still valid, and discard the bytes if it
   was not. A fetch never returns bytes the source may have released.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import torch

from gpuobj_agent.buffers import BINDABLE, Bound, LandingPool
from gpuobj_agent.errors import (
    AgentError,
    BadRequest,
    FetchError,
    ObjectGone,
    ReadRefused,
    SourceUnavailable,
    TransportError,
)
from gpuobj_agent.layouts import TensorLayout, allocate, normalize_device
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_transport import NixlAgent, Span, XferHandle
from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names

log = logging.getLogger(__name__)

_DISCONNECT = ("REMOTE_DISCONNECT",)
READ_END_PREFIX = api.READ_END_NOTIF_PREFIX.encode()  # + readId: the READ's note ends the ticket at the source

# Prepared reads (see `_GrantEntry`): for objects up to PREPARED_MAX_BYTES, at most PREPARED_SLOTS per
# grant (fetches whose tensors are all still held beyond that read the ordinary way), and at most
# PREPARED_BUDGET bytes of landing memory bound to them in all. Above the size the per-fetch work is
# noise next to the READ; idle ones go after PREPARED_IDLE seconds (the pool's trim).
PREPARED_MAX_BYTES = 16 << 20
PREPARED_SLOTS = 4
PREPARED_BUDGET = 128 << 20
PREPARED_IDLE = 30.0
# Source agents connected to ahead (a pooled version's announced spare, `_preconnect`) and not read from yet:
# at most this many are kept; the oldest is forgotten when another comes.
ANNOUNCED_KEPT = 4
# After connecting ahead, the reader's worker is progressed this long on the transfer thread, so UCX's wireup
# completes before the version's first READ rather than during it (nixl_transport.NixlAgent.progress_for).
WIREUP_PROGRESS = 0.02


# A sharded read (gpuobj.client.shards): per output tensor, (index of the stored tensor, output
# shape, runs of (byte offset within the stored tensor, byte length)) in the output's order.
Piece = tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]]


def _selected(
    spans: list[Span | None], layouts: list[TensorLayout], select: Sequence[Piece]
) -> tuple[list[Span | None], list[TensorLayout]]:
    """The stored spans (unchanged) and the output layouts of a selection, checked against the object."""
    out = []
    for stored, shape, runs in select:
        if not 0 <= stored < len(layouts):
            raise FetchError(f"selection names tensor {stored}; the object has {len(layouts)}")
        la = layouts[stored]
        wanted = TensorLayout(tuple(shape), la.dtype, la.device)
        if any(off < 0 or n < 0 or off + n > la.nbytes for off, n in runs) or sum(n for _, n in runs) != wanted.nbytes:
            raise FetchError(f"selection of tensor {stored} does not fit its {la.nbytes} bytes")
        out.append(wanted)
    return spans, out


def _selected_pairs(
    spans: list[Span | None], tensors: list[torch.Tensor], select: Sequence[Piece]
) -> list[tuple[Span, torch.Tensor]]:
    """One (remote span, local byte view) per run: all of them go as one transfer request."""
    pairs = []
    for (stored, _, runs), t in zip(select, tensors, strict=True):
        span = spans[stored]
        if span is None or not runs:
            continue
        flat = t.reshape(-1).view(torch.uint8)  # freshly allocated: contiguous, a view of its bytes
        at = 0
        for off, n in runs:
            pairs.append((Span(span.mem, span.dev, span.addr + off, n), flat[at : at + n]))
            at += n
    return pairs


@dataclass(eq=False)
class _Slot:
    """One prepared READ into one bound landing buffer."""

    bound: Bound
    xfer: XferHandle
    posting: bool = True  # a fetch is reading into it (taken by its creator first)
    doomed: bool = False  # its remote agent was forgotten while it was posting: drop after


@dataclass(eq=False)
class _GrantEntry:
    """A read grant parsed once (a handle reads with the same grant dict again and again), and its
    prepared reads.

    Why prepared reads: building two descriptor lists, creating, posting and releasing a NIXL
    transfer and carving a landing buffer per fetch took 15-30 us of Python, against a 3-5 us raw
    READ at 4 KiB. A prepared read is created once per (grant, landing buffer) and re-posted; the
    buffer is bound to it, and a fetch takes a slot only while no tensor of its last fetch is alive
    (buffers.Bound), so what a caller holds is never overwritten. A slot is dropped (the NIXL
    request released first, then the buffer unbound) when its read fails, its remote agent is
    forgotten (retired, source gone), the grant leaves the cache, it idles, or the fetcher closes.
    Only a grant read a second time gets one: a one-shot hand-off reads the ordinary way and binds
    nothing (its entry would otherwise hold a buffer until it idles out).
    """

    grant: dict[str, Any]
    layouts: list[TensorLayout]
    spans: list[Span | None]
    agent: str
    metadata: bytes
    nbytes: int
    md_hash: int | None
    preparable: bool
    read_before: bool = False  # prepared from the second read on
    slots: list[_Slot] = field(default_factory=list)
    next_agent: str | None = None  # the source's announced spare (store._announce), and its connection info
    next_metadata: str = ""


class Fetcher:
    """One reader NIXL agent, an HTTP session, and the cache of sources' NIXL agents.

    Three kinds of thread share its caches (sources' agents, parsed grants and their prepared reads, agents
    connected ahead): the agent's loop, the transfer threads (READs, forgets, connecting ahead), and
    workload threads reading with a grant (`fetch_granted_direct`, with no loop hop by design). So every
    access to them, reads included, takes `_direct_lock`; none relies on the GIL. NIXL calls are made
    outside it."""

    def __init__(
        self,
        reader: NixlAgent,
        *,
        name: str,
        transfers: Executor,
        metrics: AgentMetrics,
        default_timeout: float,
        pool: LandingPool,
    ) -> None:
        self.reader = reader
        self.pool = pool
        self.name = name
        self._transfers = transfers
        self.metrics = metrics
        self.default_timeout = default_timeout
        self._session: aiohttp.ClientSession | None = None
        self._sources: dict[str, tuple[str, set[str]]] = {}  # endpoint -> (incarnation, loaded agent names)
        self._grant_gens: dict[str, tuple[str, int]] = {}  # endpoint -> (incarnation, newest grant's generation)
        self._enders: set[asyncio.Task[None]] = set()
        self._direct_lock = threading.Lock()
        self._parsed = api.ParseMemo()  # a model's next version repeats its layouts and spans
        self._direct_loaded: dict[str, set[int]] = {}  # remote agent -> metadata blobs loaded by direct reads
        self._grant_cache: dict[int, _GrantEntry] = {}  # id(grant) -> entry, oldest first
        self._bound_bytes = 0  # landing memory bound to prepared reads
        self._closed = False
        # Announced source agents (`_preconnect`) not read from yet, oldest first, and those of them being
        # connected to or connected; `preconnected_reads` counts first reads that found their agent so.
        self._announced: OrderedDict[str, None] = OrderedDict()
        self._preconnected: set[str] = set()
        self.preconnected_reads = 0
        self.connected_ahead = 0  # announced agents connected to
        pool.on_trim.append(self._trim_prepared)
        # Set when this agent serves TLS (tls.AgentCertificate.client_context): every request to another
        # agent is then HTTPS, verified to name the source pod's uid, or is not sent.
        self.tls: Callable[[], ssl.SSLContext | None] = lambda: None
        self._in_bytes = metrics.transfer_bytes.labels(direction="in")
        self._in_seconds = metrics.transfer_seconds.labels(direction="in")

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, force_close=False))

    async def close(self, timeout: float = 5.0) -> None:
        with self._direct_lock:
            self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._transfers, self._drop_prepared, None)
        if self._enders:
            await asyncio.wait(list(self._enders), timeout=timeout)
        for task in list(self._enders):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        with self._direct_lock:
            names = [n for _, loaded in self._sources.values() for n in loaded]
            self._sources.clear()
            self._grant_gens.clear()
        if names:
            await asyncio.get_running_loop().run_in_executor(self._transfers, self._forget, names)

    def _forget(self, names: Sequence[str]) -> None:
        for name in names:
            self._drop_prepared(lambda e, n=name: e.agent == n)  # NIXL requests to it go before it does
            with self._direct_lock:
                self._direct_loaded.pop(name, None)
            self.reader.forget_remote(name)

    @property
    def cached_agents(self) -> int:
        with self._direct_lock:
            return sum(len(loaded) for _, loaded in self._sources.values())

    # -- fetch -------------------------------------------------------------------------
    async def fetch(
        self,
        endpoint: str,
        object_id: str,
        *,
        device: str = "cpu",
        token: str | None = None,
        timeout: float | None = None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """The object's tensors, newly allocated on `device`; raises FetchError (or a subclass) on failure.

        `pod_uid`: the source pod's, named on each request (the agent refuses one meant for another pod)
        and, over TLS, the name its certificate must carry. `select`: read only these pieces (`Piece`)."""
        started = time.monotonic()
        deadline = started + (timeout if timeout is not None else self.default_timeout)
        try:
            target = normalize_device(device)
        except BadRequest as exc:
            raise FetchError(str(exc)) from None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if pod_uid:
            headers[names.HEADER_POD_UID] = pod_uid
        answer = await self._request(
            api.BEGIN_READ,
            endpoint,
            deadline,
            headers,
            api.ReadRequest(self.name).to_json(),
            object_id=object_id,
            id=object_id,
        )
        ticket = self._parse(endpoint, answer, "read ticket")
        read_id = ticket.read_id
        notified = False
        ok = False
        try:
            tensors, notified = await self._read(endpoint, ticket, target, deadline, select)
            ok = True
        finally:
            elapsed = time.monotonic() - started
            lease = ticket.lease_seconds
            if read_id:
                if not ok or elapsed < lease / 2:
                    # Well inside the lease, the bytes are good whenever the source hears of the end;
                    # NIXL already told it if `notified`, else say so over HTTP in the background.
                    if not notified:
                        self._end_later(endpoint, read_id, headers)
                else:
                    end = await self._request(
                        api.END_READ, endpoint, max(deadline, time.monotonic() + 10), headers, None, read_id=read_id
                    )
                    if not api.ReadEndAnswer.from_json(end).valid:
                        self.metrics.error("fetch_lease_expired")
                        raise FetchError(
                            f"read of {object_id} from {endpoint} outlived its {lease:g}s lease; "
                            "the bytes were discarded"
                        )
        nbytes = sum(t.nbytes for t in tensors)
        self.metrics.transfer_bytes.labels(direction="in").inc(nbytes)
        self.metrics.transfer_seconds.labels(direction="in").observe(time.monotonic() - started)
        return tensors

    async def fetch_granted(
        self,
        endpoint: str,
        object_id: str,
        grant: dict[str, Any],
        *,
        device: str = "cpu",
        token: str | None = None,
        timeout: float | None = None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """Read with a grant the source handed over (store.grant): no request to the source at all.

        The caller holds a live claim, so the bytes stay. If the grant's NIXL agent was retired
        (the object moved generation, or the source restarted) the READ fails cleanly and we
        fall back to a read ticket over HTTP, which also says whether the object still exists.
        """
        started = time.monotonic()
        deadline = started + (timeout if timeout is not None else self.default_timeout)
        try:
            target = normalize_device(device)
        except BadRequest as exc:
            raise FetchError(str(exc)) from None
        try:
            ticket = self._parse(endpoint, grant, "read grant")
            tensors, _ = await self._read(endpoint, ticket, target, deadline, select)
        except (SourceUnavailable, FetchError) as exc:
            log.debug("grant for %s on %s no longer serves (%s); asking for a ticket", object_id, endpoint, exc)
            left = deadline - time.monotonic()
            return await self.fetch(
                endpoint,
                object_id,
                device=device,
                token=token,
                timeout=max(left, 0.001),
                pod_uid=pod_uid,
                select=select,
            )
        self.metrics.transfer_bytes.labels(direction="in").inc(sum(t.nbytes for t in tensors))
        self.metrics.transfer_seconds.labels(direction="in").observe(time.monotonic() - started)
        return tensors

    def fetch_granted_direct(
        self, endpoint: str, object_id: str, grant: dict[str, Any], *, device: str = "cpu", timeout: float | None = None
    ) -> list[torch.Tensor]:
        """`fetch_granted` in the calling thread: no event loop, no thread hop, no request.

        For synchronous callers holding a live claim. Raises FetchError (or TransportError) if the
        grant no longer serves; the caller then takes the asynchronous path, which falls back to a
        ticket. NIXL's agent is used from several threads already (the transfer threads).
        A CPU read of a small object re-posts a prepared READ (`_GrantEntry`).
        """
        started = time.monotonic()
        deadline = started + (timeout if timeout is not None else self.default_timeout)
        entry = self._entry(endpoint, grant)
        with self._direct_lock:  # a grant read once (a one-shot hand-off) never binds a buffer
            prepared = entry.preparable and entry.read_before
            entry.read_before = True
        if device == "cpu" and prepared:
            tensors = self._read_prepared(entry, deadline)
            if tensors is not None:
                self._in_bytes.inc(entry.nbytes)
                self._in_seconds.observe(time.monotonic() - started)
                return tensors
        try:
            target = normalize_device(device)
        except BadRequest as exc:
            raise FetchError(str(exc)) from None
        self._load_direct(entry)
        tensors, _ = self._read_sync(entry.agent, b"", entry.spans, entry.layouts, target, deadline, None, [], b"")
        self._in_bytes.inc(entry.nbytes)
        self._in_seconds.observe(time.monotonic() - started)
        self._preconnect_later(entry.next_agent, entry.next_metadata)
        return tensors

    def _load_direct(self, entry: _GrantEntry) -> None:
        """Load the grant's metadata into the reader, once per blob and remote agent."""
        if entry.md_hash is None:
            return
        with self._direct_lock:
            seen = self._direct_loaded.setdefault(entry.agent, set())
            fresh = entry.md_hash not in seen
        if fresh:
            self.reader.load_remote(entry.metadata)
            with self._direct_lock:
                if len(seen) > 4096:
                    seen.clear()
                seen.add(entry.md_hash)

    def _read_prepared(self, entry: _GrantEntry, deadline: float) -> list[torch.Tensor] | None:
        """Re-post a free prepared READ of this grant (making one if allowed); None: read the ordinary way."""
        slot = None
        with self._direct_lock:
            for s in entry.slots:
                if not s.posting and not s.bound.busy():
                    s.posting = True
                    slot = s
                    break
            else:
                if (
                    self._closed
                    or len(entry.slots) >= PREPARED_SLOTS
                    or self._bound_bytes + entry.nbytes > PREPARED_BUDGET
                    or self._grant_cache.get(id(entry.grant)) is not entry
                ):
                    return None
                self._bound_bytes += entry.nbytes  # reserved before the lock is let go
        if slot is None:
            try:
                slot = self._make_slot(entry)
            except BaseException:
                with self._direct_lock:
                    self._bound_bytes -= entry.nbytes
                raise
            if slot is None:
                return None
        try:
            self.reader.repost(slot.xfer, deadline)
        except BaseException:
            self._drop_slot(entry, slot, poster=True)
            raise
        tensors = slot.bound.hand_out()  # before the slot is free again: from now on they keep it busy
        with self._direct_lock:  # `_drop_slot` decides under the same lock whether the poster drops it
            slot.posting = False
            doomed = slot.doomed
        if doomed:
            self._drop_slot(entry, slot)  # its tensors are fine: the buffer waits for them
        return tensors

    def _make_slot(self, entry: _GrantEntry) -> _Slot | None:
        """Bind a landing buffer and prepare a READ into it (the caller reserved the bytes)."""
        self._load_direct(entry)
        bound = self.pool.bind(entry.layouts)
        local = [Span.of(t) for s, t in zip(entry.spans, bound.tensors, strict=True) if s is not None]
        remote = [s for s in entry.spans if s is not None]
        try:
            xfer = self.reader.prepare_read(entry.agent, remote, [m for m in local if m is not None])
        except BaseException:
            self.pool.unbind(bound)
            raise
        if xfer is None:  # mixed memory types: never preparable
            self.pool.unbind(bound)
            with self._direct_lock:
                entry.preparable = False
                self._bound_bytes -= entry.nbytes
            return None
        slot = _Slot(bound, xfer)
        with self._direct_lock:
            entry.slots.append(slot)
            # Closed or evicted meanwhile: nobody else would drop it; this fetch reads once, then lets it go.
            slot.doomed = self._closed or self._grant_cache.get(id(entry.grant)) is not entry
        return slot

    def _drop_slot(self, entry: _GrantEntry, slot: _Slot, *, poster: bool = False) -> None:
        """Release a slot's NIXL request, then unbind its buffer (back to the pool once its tensors die).

        A slot another fetch is posting is only marked: that fetch drops it when its READ is done."""
        with self._direct_lock:
            if slot not in entry.slots:
                return
            if slot.posting and not poster:
                slot.doomed = True
                return
            entry.slots.remove(slot)
            self._bound_bytes -= entry.nbytes
        self.reader.release_prepared(slot.xfer, [slot.bound.whole])
        self.pool.unbind(slot.bound)

    def _drop_prepared(self, which: Any = None) -> None:
        """Drop the prepared reads of every cached grant `which(entry)` selects (all if None).

        A slot a fetch is posting right now is marked and dropped by that fetch when it is done."""
        with self._direct_lock:
            victims = [
                (entry, slot)
                for entry in self._grant_cache.values()
                if which is None or which(entry)
                for slot in entry.slots
            ]
        for entry, slot in victims:
            self._drop_slot(entry, slot)

    def _trim_prepared(self, now: float) -> None:
        """Called by the pool's trim: prepared reads idle for PREPARED_IDLE let their buffers go."""
        victims = []
        with self._direct_lock:
            for entry in self._grant_cache.values():
                for slot in entry.slots:
                    if not slot.posting and not slot.bound.busy() and now - slot.bound.used > PREPARED_IDLE:
                        victims.append((entry, slot))
        for entry, slot in victims:
            self._drop_slot(entry, slot)

    @property
    def prepared_reads(self) -> int:
        with self._direct_lock:
            return sum(len(e.slots) for e in self._grant_cache.values())

    def _entry(self, endpoint: str, grant: dict[str, Any]) -> _GrantEntry:
        """A grant parsed once per grant object (a handle reads with the same one again and again)."""
        key = id(grant)
        with self._direct_lock:
            hit = self._grant_cache.get(key)
        if hit is not None and hit.grant is grant:
            return hit
        parsed = self._parse(endpoint, grant, "read grant")
        layouts, spans, agent = list(parsed.tensors), self._spans(parsed), parsed.nixl_agent
        metadata = self._metadata(endpoint, parsed)
        nbytes = sum(la.nbytes for la in layouts)
        # Once per grant, so once per version: forget the source's agents it no longer lists as live (the fence
        # destroyed them); without this a reader reading in its own thread kept one per version loaded forever.
        self._forget(self._note_grant(endpoint, parsed, agent if any(spans) else None))
        entry = _GrantEntry(
            grant,
            layouts,
            spans,
            agent,
            metadata,
            nbytes,
            hash(metadata) if any(spans) else None,
            preparable=BINDABLE and any(spans) and nbytes <= PREPARED_MAX_BYTES,
            next_agent=parsed.next_agent,
            next_metadata=parsed.next_agent_metadata,
        )
        evicted = []
        with self._direct_lock:
            raced = self._grant_cache.get(key)
            if raced is not None:  # another thread parsed the same grant meanwhile (it holds it: same object)
                return raced
            if len(self._grant_cache) >= 256:
                evicted.append(self._grant_cache.pop(next(iter(self._grant_cache))))
            self._grant_cache[key] = entry  # holds the grant: its id cannot be reused meanwhile
            victims = [(e, s) for e in evicted for s in e.slots]
        for e, slot in victims:
            self._drop_slot(e, slot)
        return entry

    def _parse(self, endpoint: str, data: Any, what: str) -> api.ReadTicket:
        """A read ticket or grant (agent_api.ReadTicket: the same shape), checked (lists seen before reused)."""
        try:
            return api.ReadTicket.from_json(data, self._parsed)
        except ValueError as exc:
            raise FetchError(f"source {endpoint} sent a malformed {what}: {exc}") from None

    @staticmethod
    def _spans(ticket: api.ReadTicket) -> list[Span | None]:
        return [None if s is None else Span(s.mem, s.dev, s.addr, s.nbytes) for s in ticket.spans]

    @staticmethod
    def _metadata(endpoint: str, ticket: api.ReadTicket) -> bytes:
        """The NIXL metadata to load (none when no tensor has bytes)."""
        if not any(ticket.spans):
            return b""
        try:
            return base64.b64decode(ticket.agent_metadata, validate=True)
        except ValueError as exc:
            raise FetchError(f"source {endpoint} sent undecodable NIXL metadata: {exc}") from None

    async def _read(
        self, endpoint: str, ticket: api.ReadTicket, device: str, deadline: float, select: Sequence[Piece] | None = None
    ) -> tuple[list[torch.Tensor], bool]:
        """Allocate, load the metadata and READ (on a transfer thread); returns (tensors, end notified)."""
        layouts, spans, agent = list(ticket.tensors), self._spans(ticket), ticket.nixl_agent
        metadata = self._metadata(endpoint, ticket)
        read_id = ticket.read_id  # none for a grant: no ticket to end
        forget = self._note_source(endpoint, ticket.incarnation, set(ticket.live_agents), agent if any(spans) else None)
        abort = threading.Event()
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(
            self._transfers,
            self._read_sync,
            agent,
            metadata,
            spans,
            layouts,
            device,
            deadline,
            abort,
            forget,
            READ_END_PREFIX + read_id.encode() if read_id else b"",
            select,
        )
        try:
            done = await asyncio.shield(job)
            self._preconnect_later(ticket.next_agent, ticket.next_agent_metadata)
            return done
        except asyncio.CancelledError:
            abort.set()  # the thread gives up at its next poll; its tensors stay referenced until then
            with contextlib.suppress(Exception):
                async with asyncio.timeout(30):
                    await asyncio.shield(job)
            raise
        except TransportError as exc:
            self.metrics.error("fetch_transfer")
            text = str(exc)
            if any(word in text for word in _DISCONNECT):
                self._drop_agent(endpoint, agent)
                raise SourceUnavailable(
                    f"NIXL agent {agent} of {endpoint} went away during read {read_id}: {text}"
                ) from None
            raise FetchError(f"reading from {endpoint} failed: {text}") from None

    def _read_sync(
        self,
        agent: str,
        metadata: bytes,
        spans: list[Span | None],
        layouts: list[TensorLayout],
        device: str,
        deadline: float,
        abort: threading.Event | None,
        forget: list[str],
        notify: bytes,
        select: Sequence[Piece] | None = None,
    ) -> tuple[list[torch.Tensor], bool]:
        """On a transfer thread: destination, retired agents dropped, metadata loaded, READ."""
        self._forget(forget)
        if select is not None:
            spans, layouts = _selected(spans, layouts, select)
        try:
            if device == "cpu":
                tensors, _ = self.pool.carve(layouts)  # registered, pre-faulted landing memory
                registered = True
            else:
                tensors = [allocate(layout, device=device) for layout in layouts]
                registered = False
        except (RuntimeError, MemoryError) as exc:
            raise FetchError(f"allocating the destination on {device} failed: {exc}") from exc
        if select is not None:
            pairs = _selected_pairs(spans, tensors, select)
        else:
            pairs = [(s, t) for s, t in zip(spans, tensors, strict=True) if s is not None]
        if not pairs:
            return tensors, False
        if metadata:
            self.reader.load_remote(metadata)
        self._used(agent)
        notified = self.reader.read(
            agent,
            [s for s, _ in pairs],
            [t for _, t in pairs],
            deadline=deadline,
            abort=abort,
            registered=registered,
            notify=notify,
        )
        return tensors, notified

    # -- connecting ahead -----------------------------------------------------------------
    def _preconnect_later(self, name: str | None, metadata: str) -> None:
        """Connect to an announced source agent on a transfer thread, after this read, off the next one's path.

        Why: the source registers a pooled version in a NIXL agent new for that version (the fence), and a
        first READ from a new agent pays for loading it and the UCX wireup (12-30 ms here under load).
        The announcement names no region, so this connection reads nothing until that version's grant or
        ticket hands over its key."""
        if not name or not metadata:
            return
        with self._direct_lock:
            if self._closed or name in self._preconnected or name in self._direct_loaded:
                return
            if any(name in loaded for _, loaded in self._sources.values()):
                return
            self._preconnected.add(name)
            self._announced[name] = None
            stale = []
            while len(self._announced) > ANNOUNCED_KEPT:
                stale.append(self._announced.popitem(last=False)[0])
        try:
            self._transfers.submit(self._preconnect, name, metadata, stale)
        except RuntimeError:  # the transfer threads are shut down: closing
            pass

    def _preconnect(self, name: str, metadata: str, stale: list[str]) -> None:
        """On a transfer thread: forget announced agents never read from, load and connect to this one."""
        for old in stale:
            with self._direct_lock:
                self._preconnected.discard(old)
            self.reader.forget_remote(old)
        try:
            loaded = self.reader.load_remote(base64.b64decode(metadata, validate=True))
            if loaded != name:
                raise TransportError(f"the announced metadata is agent {loaded}'s, not {name}'s")
            self.reader.connect(name)
            # Finish the wireup now: the reader has no progress thread, so otherwise its next READ does.
            self.reader.progress_for(WIREUP_PROGRESS)
            with self._direct_lock:
                self.connected_ahead += 1
        except (TransportError, ValueError) as exc:  # the first read connects, as without an announcement
            log.debug("connecting ahead to %s failed: %s", name, exc)
            with self._direct_lock:
                self._announced.pop(name, None)
                self._preconnected.discard(name)

    def _used(self, agent: str) -> None:
        """A read goes to `agent`: if it was connected to ahead, count it; an ordinary loaded agent from now on."""
        with self._direct_lock:
            if agent in self._preconnected:
                self.preconnected_reads += 1
                self._preconnected.discard(agent)
                self._announced.pop(agent, None)

    def _note_source(self, endpoint: str, incarnation: str, live: set[str], agent: str | None) -> list[str]:
        """Update the cache; return agents to forget (retired, or of an earlier incarnation).

        O(agents loaded from this source), which this keeps to the few the source has live: the fence
        retires one per read version. Called from the loop and, for grants, from readers' own threads."""
        with self._direct_lock:
            old_inc, loaded = self._sources.get(endpoint, (incarnation, set()))
            if old_inc != incarnation:
                forget, loaded = list(loaded), set()
            else:
                forget = [n for n in loaded if n not in live]
                loaded = {n for n in loaded if n in live}
            if agent is not None:
                loaded.add(agent)
            self._sources[endpoint] = (incarnation, loaded)
            return forget

    def _note_grant(self, endpoint: str, grant: api.ReadTicket, agent: str | None) -> list[str]:
        """`_note_source` for a grant parsed for the first time; returns the agents to forget.

        Only the newest grant of a source incarnation speaks for its live agents: an older one parsed late (a
        hand-off held a while) predates agents the reader may have loaded since, so it only adds its own."""
        gen = grant.generation
        with self._direct_lock:
            inc, newest = self._grant_gens.get(endpoint, ("", -1))
            current = gen is not None and (inc != grant.incarnation or gen >= newest)
            if current:
                assert gen is not None
                self._grant_gens[endpoint] = (grant.incarnation, gen)
            elif endpoint in self._sources and self._sources[endpoint][0] == grant.incarnation:
                if agent is not None:
                    self._sources[endpoint][1].add(agent)
                return []
        live = set(grant.live_agents) | ({agent} if agent else set())
        return self._note_source(endpoint, grant.incarnation, live, agent)

    def _drop_agent(self, endpoint: str, agent: str) -> None:
        with self._direct_lock:
            entry = self._sources.get(endpoint)
            if entry is not None:
                entry[1].discard(agent)
        self._transfers.submit(self._forget, [agent])

    def forget_source(self, endpoint: str) -> None:
        """The source went away: drop every agent of it we cached."""
        with self._direct_lock:
            entry = self._sources.pop(endpoint, None)
            self._grant_gens.pop(endpoint, None)
        if entry and entry[1]:
            self._transfers.submit(self._forget, list(entry[1]))

    # -- HTTP --------------------------------------------------------------------------
    async def _request(
        self,
        route: api.Route,
        endpoint: str,
        deadline: float,
        headers: dict[str, str],
        body: dict[str, Any] | None,
        *,
        object_id: str | None = None,
        **params: str,
    ) -> dict[str, Any]:
        """One agent API call (`route` with `params`); its JSON object, or the matching FetchError."""
        method, path = route.method, route.path(**params)
        if self._session is None:
            raise FetchError("the fetcher is not started")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FetchError(f"fetch from {endpoint} timed out")
        tls = self.tls()
        verify: dict[str, Any] = {}
        if tls is not None:
            pod_uid = headers.get(names.HEADER_POD_UID)
            if not pod_uid:  # never send a token to a listener we cannot hold to a pod
                raise FetchError(f"cannot verify the agent at {endpoint}: the source pod's uid is not known")
            verify = {"ssl": tls, "server_hostname": agent_tls.pod_dns_name(pod_uid)}
        url = f"{'https' if tls is not None else 'http'}://{endpoint}{path}"
        try:
            async with self._session.request(
                method, url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=remaining), **verify
            ) as resp:
                try:
                    data = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    data = None
                if resp.status == 200 and isinstance(data, dict):
                    return data
                message = data.get("error") if isinstance(data, dict) else None
                if resp.status == 404 and object_id is not None:
                    raise ObjectGone(object_id, endpoint)
                if resp.status == 401:
                    raise FetchError(f"{endpoint} refused the token (401)")
                if resp.status == 403:
                    raise ReadRefused(f"{endpoint} refused the read: {message or 'forbidden'}")
                raise FetchError(f"{method} {path} on {endpoint} failed: {resp.status} {message or ''}".strip())
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
            raise SourceUnavailable(f"the agent at {endpoint} is not the source pod's (TLS): {exc}") from None
        except (aiohttp.ClientConnectionError, OSError) as exc:
            self.forget_source(endpoint)
            raise SourceUnavailable(f"source agent {endpoint} is unreachable: {exc}") from None
        except TimeoutError:
            raise FetchError(f"{method} {path} on {endpoint} timed out") from None

    def _end_later(self, endpoint: str, read_id: str, headers: dict[str, str]) -> None:
        async def end() -> None:
            try:
                await self._request(api.END_READ, endpoint, time.monotonic() + 10, headers, None, read_id=read_id)
            except AgentError as exc:  # the lease ends it anyway
                log.debug("ending read %s on %s: %s", read_id, endpoint, exc)

        task = asyncio.get_running_loop().create_task(end())
        self._enders.add(task)
        task.add_done_callback(self._enders.discard)
