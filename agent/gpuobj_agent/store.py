"""The object store: objects (tensors under an id), their NIXL registrations, reads and frees.

Why it is shaped this way:
- Every piece of state lives on the agent's event loop and is changed by one coroutine at
  a time; NIXL calls run on a dedicated control thread (`await self.nixl.control(...)`), so
  the loop never blocks on NIXL and the server keeps answering (docs/design.md, "out-of-order deadlock").
- Bookkeeping is delegated to plain-Python modules: the registrations ledger (what each
  NIXL agent holds), read tickets (who may be reading), generations (which NIXL agent is
  active) and the quarantine (freed memory waiting for its fence). This class wires them
  to NIXL and to the objects.
- A free is idempotent and leaves nothing behind: it waits (bounded) for the object's
  tickets, deregisters from the NIXL agent that registered it, forgets the object, and
  either drops the tensors or, if a reader was ever handed their keys, quarantines them
  until fencing.py has destroyed every NIXL agent that exposed them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpuobj_agent.config import MAX_STORE_BYTES_ENV, AgentConfig
from gpuobj_agent.errors import (
    BadRequest,
    Conflict,
    FreeTimeout,
    InsufficientMemory,
    KeyNotPublished,
    NotReady,
    ObjectNotFound,
    QuotaExceeded,
    TransportError,
)
from gpuobj_agent.generations import PRIVATE, Generation
from gpuobj_agent.layouts import TensorLayout, allocate, layout_of
from gpuobj_agent.metrics import AgentMetrics, Levels
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.nixl_transport import NixlAgent, Span, exact_regions
from gpuobj_agent.registrations import RegionKey, RegionReused
from gpuobj_agent.tickets import ReadTickets
from gpuobj_contract import agent_api as api
from gpuobj_contract import patterns

log = logging.getLogger(__name__)

# A reader attaches this + readId to its READ; NIXL hands it to us once the data was read.
READ_END_PREFIX = api.READ_END_NOTIF_PREFIX.encode()
NOTIFY_POLL_SECONDS = 0.001
# Freed objects that granted other namespaces (spec.sharedWith) are remembered, this many at most, so
# that a granted reader of another namespace hears "not found" (404), not "may not read" (403).
FREED_GRANTS_KEPT = 4096
# A pooled region is registered again ahead of its next put (`_register_ahead`): bounds on that background work
# (making the spare agent when none is ready, and a put waiting for a registration already under way).
AHEAD_TIMEOUT = 30.0


def check_id(object_id: Any, what: str = "object id") -> str:
    if not patterns.OBJECT_ID.matches(object_id):
        raise BadRequest(f"{what} {object_id!r} is not valid: {api.OBJECT_ID_RULE}")
    return object_id


def check_stream(stream: Any) -> str:
    if not patterns.STREAM_NAME.matches(stream):
        raise BadRequest(f"stream {stream!r} is not valid: {api.STREAM_NAME_RULE}")
    return stream


@dataclass
class StoredObject:
    object_id: str
    tensors: list[torch.Tensor]
    layouts: list[TensorLayout]
    spans: list[Span | None]
    keys: list[RegionKey]
    nbytes: int
    created_wall: float
    created_mono: float
    gid: int
    stream: str | None = None
    stream_index: int | None = None
    key: str | None = None
    # What a reader of it needs from generation `described_gid`: (metadata b64, descriptors b64,
    # whether that metadata names every region of the agent). Computed lazily after a move.
    description: tuple[str, str | None, bool] | None = None
    described_gid: int | None = None
    freeing: asyncio.Future | None = None
    # Namespaces besides the source's own whose pods may read it (GPUObject spec.sharedWith).
    shared_with: frozenset[str] = frozenset()
    # Pooled memory (a client's pack buffer, gpuobj/client/state_dicts.py): the owner keeps the bytes and
    # reuses them, so a free parks the region registered and hands the memory back here (see `_release`).
    on_release: Callable[[], None] | None = None

    @property
    def devices(self) -> list[str]:
        return sorted({layout.device for layout in self.layouts})

    def answer(self) -> api.ObjectDescription:
        return api.ObjectDescription(
            id=self.object_id,
            bytes=self.nbytes,
            tensors=tuple(self.layouts),
            created_at=iso_time(self.created_wall),
            stream=self.stream,
            stream_index=self.stream_index,
        )

    def describe(self) -> dict[str, Any]:
        return self.answer().to_json()


def iso_time(ts: float) -> str:
    """RFC 3339 UTC with milliseconds, as the API shows times."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _read_spans(spans: Sequence[Span | None]) -> tuple[api.ReadSpan | None, ...]:
    return tuple(None if s is None else api.ReadSpan(s.mem, s.dev, s.addr, s.nbytes) for s in spans)


def _sync_cuda(tensors: Sequence[torch.Tensor]) -> None:
    """Remote readers read the bytes directly: kernels still writing them must be finished."""
    for index in sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"}):
        torch.cuda.synchronize(index)


class ObjectStore:
    """Objects by id and everything that must stay consistent with them."""

    def __init__(
        self,
        config: AgentConfig,
        metrics: AgentMetrics,
        *,
        nixl: NixlState,
        incarnation: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.incarnation = incarnation
        self.metrics = metrics
        self.nixl = nixl  # shared with the fencer
        self._clock = clock
        self.tickets = ReadTickets(clock)
        self.objects: dict[str, StoredObject] = {}
        self.streams: dict[str, set[str]] = {}
        self.published: dict[str, list[torch.Tensor]] = {}
        # Objects whose GPUObject the embedding client has queued but not recorded yet (its write-behind);
        # set from the client's thread (single set operations: atomic under the GIL).
        self._record_pending: set[str] = set()
        self._private: set[str] = set()  # the same client's private objects: never to be recorded
        self._freed_grants: OrderedDict[str, frozenset[str]] = OrderedDict()  # object id -> sharedWith, bounded
        self.tickets_changed = asyncio.Condition()
        self.closing = False
        self._issued = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        # Pooled regions being registered ahead in a spare private agent (`_register_ahead`), by region; and
        # the registrations themselves, shielded so that a shutdown never leaves one half recorded.
        self._ahead: dict[tuple[RegionKey, ...], asyncio.Task] = {}
        self._ahead_inner: set[asyncio.Task] = set()

    # -- helpers -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.nixl.gens.active is not None and not self.closing

    @property
    def active_nixl_agent(self) -> str | None:
        """The NIXL agent new objects are registered in; None while starting or stopping (not ready)."""
        gen = self.nixl.gens.active
        return gen.name if gen is not None and not self.closing else None

    @property
    def registering_ahead(self) -> int:
        """Pooled regions whose registration ahead of the next put is under way (`_register_ahead`)."""
        return len(self._ahead)

    def levels(self) -> Levels:
        by_device: dict[str, int] = {"cpu": 0}  # a series from the start, so dashboards show 0, not nothing
        for obj in self.objects.values():
            for layout in obj.layouts:
                by_device[layout.device] = by_device.get(layout.device, 0) + layout.nbytes
        gens: dict[str, int] = {"active": 0, "sealed": 0}
        for gen in self.nixl.gens.live():
            gens[gen.state.value] = gens.get(gen.state.value, 0) + 1
        return Levels(
            by_device,
            len(self.objects),
            self.nixl.ledger.registered_bytes,
            len(self.tickets.live()),
            self.nixl.quarantine.bytes,
            gens,
        )

    def _describe_in(self, agent: NixlAgent, obj_keys: Sequence[RegionKey], spans: Sequence[Span | None]):
        """On the control thread: the metadata and descriptors a reader of this object needs."""
        md = agent.partial_metadata(list(obj_keys))
        descs = agent.serialized_descriptors([s for s in spans if s is not None])
        whole = len({k.mem for k in obj_keys}) > 1  # DRAM and VRAM: NIXL's full metadata, every region in it
        return _b64(md), _b64(descs), whole

    def _register_in(
        self,
        agent: NixlAgent,
        new_keys: Sequence[RegionKey],
        objects: Sequence[tuple[Sequence[RegionKey], Sequence[Span | None]]],
    ):
        """On the control thread: register new regions, then describe each object (one thread hop)."""
        if new_keys:
            agent.register(list(new_keys))
        try:
            return [self._describe_in(agent, keys, spans) for keys, spans in objects]
        except Exception:
            if new_keys:
                agent.deregister(list(new_keys))
            raise

    # -- put ---------------------------------------------------------------------------
    def _prepare(self, tensors: Any, copy: bool) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise BadRequest("an object is a non-empty list of tensors")
        out = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise BadRequest(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            layout_of(t)  # validates dtype and device
            if not t.is_contiguous():
                if not copy:
                    raise BadRequest(
                        f"tensor {i} is not contiguous (stride {tuple(t.stride())} for shape {tuple(t.shape)}); "
                        "NIXL reads one contiguous span per tensor: pass tensor.contiguous(), or put(..., copy=True) "
                        "to let the agent store a contiguous copy"
                    )
                t = t.contiguous()
            out.append(t)
        return out

    async def put(
        self,
        object_id: str,
        tensors: Any,
        *,
        stream: str | None = None,
        stream_index: int | None = None,
        key: str | None = None,
        copy: bool = False,
        shared_with: Sequence[str] = (),
        on_release: Callable[[], None] | None = None,
    ) -> StoredObject:
        """Hold `tensors` under `object_id` (zero-copy) and register them for remote reads.

        ``on_release``: the tensors are pooled memory their owner reuses; called once the object is
        freed (no read of it is in flight, no reader may start one), and the region stays registered."""
        check_id(object_id)
        if stream is not None:
            check_stream(stream)
        if stream_index is not None and (isinstance(stream_index, bool) or not isinstance(stream_index, int)):
            raise BadRequest("streamIndex must be an integer")
        if not self.ready:
            raise NotReady("the agent is not ready (starting or stopping)")
        if object_id in self.objects:
            raise Conflict(f"object {object_id} already exists")
        tensors = self._prepare(tensors, copy)
        self._check_quota(sum(t.nbytes for t in tensors))
        if any(t.device.type == "cuda" for t in tensors):
            await self.nixl.control(_sync_cuda, tensors)  # off the loop: a device sync may take a while
        layouts = [layout_of(t) for t in tensors]
        spans = [Span.of(t) for t in tensors]
        keys = exact_regions(spans)  # the object's own bytes, never the rest of the storage it views
        if len({k.mem for k in keys}) > 1:
            # NIXL's partial metadata cannot describe both; its full metadata names every region of the agent.
            raise BadRequest("an object is in host memory or on GPUs, not both: put the CPU and CUDA tensors apart")
        fields = (layouts, spans, keys, stream, stream_index, key, frozenset(shared_with), on_release)
        if on_release is not None:
            return await self._put_pooled(object_id, tensors, fields)
        for attempt in range(2):
            async with self.nixl.lock:
                if object_id in self.objects:
                    raise Conflict(f"object {object_id} already exists")
                gen = self.nixl.gens.active
                if gen is None or self.closing:
                    raise NotReady("the agent is not ready (starting or stopping)")
                try:
                    new = self.nixl.ledger.acquire(gen.gid, keys, object_id)
                except RegionReused:
                    if attempt:
                        raise
                    new = None
                if new is not None:
                    try:
                        [described] = await self.nixl.control(self._register_in, gen.agent, new, [(keys, spans)])
                    except Exception as exc:
                        self.nixl.ledger.rollback(gen.gid, new, object_id)
                        self.metrics.error("nixl_register")
                        raise TransportError(f"registering object {object_id} with NIXL failed: {exc}") from exc
                    self.metrics.registrations.labels(op="register").inc(len(new))
                    return self._stored(object_id, tensors, fields, gen.gid, described)
            # One of these storages was freed after a reader saw it, and is alive again (the workload
            # re-put a tensor it still holds): a newer NIXL agent must take it. Rotate and retry.
            await self.nixl.rotate_now()
        raise AssertionError("unreachable")

    def _stored(
        self, object_id: str, tensors: list[torch.Tensor], fields: tuple, gid: int, described: Any
    ) -> StoredObject:
        """Record a registered object (the caller holds the NIXL lock)."""
        layouts, spans, keys, stream, stream_index, key, shared_with, on_release = fields
        obj = StoredObject(
            object_id,
            tensors,
            layouts,
            spans,
            keys,
            sum(lay.nbytes for lay in layouts),
            time.time(),
            self._clock(),
            gid,
            stream,
            stream_index,
            key,
        )
        obj.description, obj.described_gid = described, gid
        obj.shared_with = shared_with
        obj.on_release = on_release
        self.objects[object_id] = obj
        self.nixl.members.setdefault(gid, set()).add(object_id)
        if stream is not None:
            self.streams.setdefault(stream, set()).add(object_id)
        return obj

    async def _put_pooled(self, object_id: str, tensors: list[torch.Tensor], fields: tuple) -> StoredObject:
        """Put pooled memory (a pack buffer the owner refills with the next version) in a NIXL agent of its own.

        Why its own agent: destroying the agent that registered a region is the only way NIXL lets us end
        a reader's use of a key it was handed (fencing.py), and a pooled region is refilled right after
        its free, so the free destroys that agent at once when a reader saw the key (`_release`), before
        the owner gets the buffer back; the next version is registered in a fresh agent (one registration).
        A version no reader ever saw leaves its region parked in its agent, and the next version in the
        same buffer is put there with no registration.
        """
        keys = fields[2]
        region = tuple(keys)
        ahead = self._ahead.get(region)
        if ahead is not None:  # its registration started at the last version's free: let it finish
            with contextlib.suppress(Exception):
                async with asyncio.timeout(AHEAD_TIMEOUT):
                    await asyncio.shield(ahead)
        for _attempt in range(3):
            fresh = None if region in self.nixl.pooled_parked else await self.nixl.new_private()
            retired = None
            try:
                async with self.nixl.lock:
                    if object_id in self.objects:
                        raise Conflict(f"object {object_id} already exists")
                    if self.nixl.gens.active is None or self.closing:
                        raise NotReady("the agent is not ready (starting or stopping)")
                    gid = self.nixl.pooled_parked.pop(region, None)
                    if gid is not None:  # parked, never seen by a reader: no registration
                        gen = self.nixl.gens.get(gid)
                        new = self.nixl.ledger.acquire(gid, keys, object_id)
                        assert not new, "a parked pooled region is registered in its agent"
                        try:
                            described = await self.nixl.control(self._describe_in, gen.agent, keys, fields[1])
                        except Exception as exc:
                            self.nixl.ledger.release(gid, object_id, park_all=True)
                            self.nixl.pooled_parked[region] = gid
                            self.metrics.error("nixl_describe")
                            raise TransportError(f"describing object {object_id} for NIXL failed: {exc}") from exc
                        return self._stored(object_id, tensors, fields, gid, described)
                    if fresh is None:
                        continue  # its parked agent went meanwhile (a shutdown): take a fresh one
                    gen, fresh = fresh, None
                    self.nixl.gens.add_private(gen)
                    self.nixl.ledger.add_generation(gen.gid)
                    self.nixl.members.setdefault(gen.gid, set())
                    new = self.nixl.ledger.acquire(gen.gid, keys, object_id)
                    try:
                        [described] = await self.nixl.control(self._register_in, gen.agent, new, [(keys, fields[1])])
                    except Exception as exc:
                        self.nixl.ledger.rollback(gen.gid, new, object_id)
                        self.metrics.error("nixl_register")
                        retired = self.nixl.retire_generation(gen.gid)
                        raise TransportError(f"registering object {object_id} with NIXL failed: {exc}") from exc
                    self.metrics.registrations.labels(op="register").inc(len(new))
                    return self._stored(object_id, tensors, fields, gen.gid, described)
            finally:
                if retired is not None:
                    await self.nixl.destroy_retired(retired)
                if fresh is not None:  # taken but not used
                    assert self.nixl.destroy is not None
                    await self.nixl.destroy(fresh)
        raise NotReady(f"object {object_id}: no NIXL agent could take it; retry")

    def _check_quota(self, nbytes: int) -> None:
        limit = self.config.max_store_bytes
        held = sum(o.nbytes for o in self.objects.values())
        if limit and held + nbytes > limit:
            raise QuotaExceeded(
                f"storing {nbytes} bytes would exceed this pod's quota of {limit} bytes ({held} held; "
                f"${MAX_STORE_BYTES_ENV})"
            )

    def publish(self, key: str, tensors: Any) -> None:
        """Offer tensors under a key, for a declared GPUObject (`PUT` with `key`) to bind."""
        check_id(key, "key")
        self.published[key] = self._prepare(tensors, copy=False)

    def unpublish(self, key: str) -> bool:
        return self.published.pop(key, None) is not None

    async def materialize(
        self,
        object_id: str,
        layouts: list[TensorLayout],
        *,
        key: str | None = None,
        stream: str | None = None,
        stream_index: int | None = None,
        shared_with: Sequence[str] = (),
    ) -> tuple[bool, StoredObject]:
        """Create a declared object: bind published tensors or allocate zeroed ones. Idempotent."""
        check_id(object_id)
        existing = self.objects.get(object_id)
        if existing is not None and existing.freeing is None:
            if existing.layouts != layouts:
                raise Conflict(f"object {object_id} exists with another layout")
            return False, existing
        if key is not None:
            check_id(key, "key")
            tensors = self.published.get(key)
            if tensors is None:
                raise KeyNotPublished(f"key {key!r} is not published by the workload")
            have = [layout_of(t) for t in tensors]
            if have != layouts:
                raise Conflict(
                    f"the tensors published under {key!r} have layouts "
                    f"{[h.to_json() for h in have]}, not the declared ones"
                )
        else:
            total = sum(layout.nbytes for layout in layouts)
            self._check_quota(total)  # before allocating: a declared object must not make us allocate past it
            if total > self.config.max_object_bytes:
                raise BadRequest(f"object of {total} bytes exceeds the agent's limit of {self.config.max_object_bytes}")
            for layout in layouts:
                if layout.device.startswith("cuda") and (
                    not torch.cuda.is_available() or int(layout.device.split(":")[1]) >= torch.cuda.device_count()
                ):
                    raise BadRequest(f"device {layout.device} is not available on this pod")
            try:
                tensors = [allocate(layout, zero=True) for layout in layouts]
            except (RuntimeError, MemoryError) as exc:
                raise InsufficientMemory(f"allocating {total} bytes failed: {exc}") from exc
        try:
            obj = await self.put(
                object_id, tensors, stream=stream, stream_index=stream_index, key=key, shared_with=shared_with
            )
        except Conflict:
            raced = self.objects.get(object_id)
            if raced is not None and raced.layouts == layouts:
                return False, raced
            raise
        return True, obj

    # -- reads -------------------------------------------------------------------------
    async def _described(self, object_id: str) -> StoredObject:
        """The live object, with its description current for the NIXL agent that now holds it."""
        for _ in range(8):
            obj = self.objects.get(object_id)
            if obj is None or obj.freeing is not None:
                raise ObjectNotFound(object_id)
            gid = obj.gid
            if obj.described_gid != gid or obj.description is None:
                # First read since the object moved to another NIXL agent: describe it there.
                agent = self.nixl.gens.get(gid).agent
                description = await self.nixl.control(self._describe_in, agent, obj.keys, obj.spans)
                if self.objects.get(object_id) is not obj or obj.freeing is not None or obj.gid != gid:
                    continue  # freed or moved meanwhile: look again
                obj.description, obj.described_gid = description, gid
            return obj
        raise NotReady(f"object {object_id} keeps moving between NIXL agents; retry")

    async def begin_read(self, object_id: str, reader: str) -> dict[str, Any]:
        """Issue a read ticket: everything a reader needs, and a lease the free will respect."""
        return self._issue(await self._described(object_id), reader)

    async def grant(self, object_id: str) -> dict[str, Any]:
        """A read grant: what a reader holding a live claim needs to read this object with no request here.

        Exactly this object's spans and the NIXL partial metadata of its own registration, under
        the source incarnation and generation. No ticket and no lease: the reader's live claim keeps
        the bytes (the operator frees only once no claim is left, and the client releases a claim
        only after its reads ended). The keys count as exposed, so a free quarantines the memory
        until the generation is fenced, and a reader still holding the grant after a move or a
        free fails cleanly on the retired NIXL agent and falls back to a ticket.
        """
        obj = await self._described(object_id)
        gen = self.nixl.gens.get(obj.gid)
        assert obj.description is not None
        metadata, descriptors, whole = obj.description
        self.nixl.ledger.expose(obj.gid, self.nixl.ledger.keys_in(obj.gid) if whole else obj.keys)
        self.metrics.tickets.labels(result="granted").inc()
        return api.ReadTicket(
            nixl_agent=gen.name,
            agent_metadata=metadata or "",
            descriptors=descriptors,
            spans=_read_spans(obj.spans),
            tensors=tuple(obj.layouts),
            nbytes=obj.nbytes,
            live_agents=tuple(self.nixl.gens.live_names()),
            incarnation=self.incarnation,
            generation=obj.gid,
            **self._announce(obj),
        ).to_json()

    def _issue(self, obj: StoredObject, reader: str) -> dict[str, Any]:
        gen = self.nixl.gens.get(obj.gid)
        assert obj.description is not None
        metadata, descriptors, whole = obj.description
        lease = round(self.config.lease_for(obj.nbytes), 3)
        ticket = self.tickets.issue(obj.object_id, obj.gid, tuple(obj.keys), obj.nbytes, reader, lease)
        self.nixl.ledger.expose(obj.gid, self.nixl.ledger.keys_in(obj.gid) if whole else obj.keys)
        self.metrics.tickets.labels(result="issued").inc()
        self._issued.set()
        return api.ReadTicket(
            read_id=ticket.read_id,
            nixl_agent=gen.name,
            agent_metadata=metadata or "",
            descriptors=descriptors,
            spans=_read_spans(obj.spans),
            tensors=tuple(obj.layouts),
            nbytes=obj.nbytes,
            lease_seconds=lease,
            live_agents=tuple(self.nixl.gens.live_names()),
            incarnation=self.incarnation,
            **self._announce(obj),
        ).to_json()

    def _announce(self, obj: StoredObject) -> dict[str, Any]:
        """For a pooled object's reader: the spare agent the next version will most likely be registered in,
        with its connection info alone (it names no region: nothing can be read through it until a grant or
        ticket of that version hands over the region's key). Nothing when no spare is ready."""
        if obj.on_release is None:
            return {}
        spare = self.nixl.next_private()
        if spare is None or not spare.announce:
            return {}
        return {"next_agent": spare.name, "next_agent_metadata": spare.announce}

    def read_taken_by(self, read_id: str) -> str | None:
        """Who took a live read ticket (the server lets only that pod end it)."""
        return self.tickets.reader_of(read_id)

    async def end_read(self, read_id: str) -> dict[str, Any]:
        expired = self._expire()
        result = self._end(read_id)
        if result.ended or expired:
            await self._tickets_changed()
        return api.ReadEndAnswer(result.ended, result.valid, self.tickets.was_expired(read_id)).to_json()

    def _end(self, read_id: str):
        result = self.tickets.end(read_id)
        if result.ended and result.ticket is not None:
            t = result.ticket
            self.metrics.tickets.labels(result="ended").inc()
            self.metrics.transfer_bytes.labels(direction="out").inc(t.nbytes)
            self.metrics.transfer_seconds.labels(direction="out").observe(self._clock() - t.issued_at)
        return result

    # -- read ends delivered by NIXL ------------------------------------------------------
    def start_pump(self) -> None:
        self._pump_task = asyncio.create_task(self._pump(), name="gpuobj-read-end-pump")

    async def stop_pump(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
            self._pump_task = None

    @staticmethod
    def _poll(agents: list[NixlAgent]) -> list[bytes]:
        out = []
        for agent in agents:
            for messages in agent.notifications().values():
                out.extend(messages)
        return out

    async def _pump(self) -> None:
        """While reads are in flight, collect the read-end notes readers attach to their READs.

        This ends our own readers' tickets without a second HTTP request; DELETE /v1/reads
        remains for everyone else. Polls only while some ticket is live.
        """
        while True:
            if not self.tickets.inflight():
                self._issued.clear()
                await self._issued.wait()
                continue
            try:
                notes = await self.nixl.control(self._poll, [g.agent for g in self.nixl.gens.live()])
            except Exception as exc:  # a failed poll must not stop the pump: leases still bound every ticket
                log.error("polling NIXL notifications failed: %s", exc)
                self.metrics.error("nixl_notifications")
                notes = []
            ended = False
            for note in notes:
                if note.startswith(READ_END_PREFIX):
                    ended = self._end(note[len(READ_END_PREFIX) :].decode(errors="replace")).ended or ended
            if ended:
                await self._tickets_changed()
            await asyncio.sleep(NOTIFY_POLL_SECONDS)

    def _expire(self) -> int:
        expired = self.tickets.expire()
        if expired:
            self.metrics.tickets.labels(result="expired").inc(len(expired))
        return len(expired)

    async def _tickets_changed(self) -> None:
        async with self.tickets_changed:
            self.tickets_changed.notify_all()
        self.nixl.poke()

    async def expire_leases(self) -> None:
        """End the tickets whose lease ran out, and wake whoever waits on tickets (the fencer's heartbeat)."""
        if self._expire():
            await self._tickets_changed()

    async def wait_tickets(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds, re-checking on every ticket end and lease expiry."""
        deadline = self._clock() + timeout
        async with self.tickets_changed:
            while True:
                if self._expire():
                    self.nixl.poke()
                if predicate():
                    return True
                now = self._clock()
                if now >= deadline:
                    return False
                wake = deadline
                nxt = self.tickets.next_deadline()
                if nxt is not None:
                    wake = min(wake, nxt)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, wake - now) + 0.001):
                        await self.tickets_changed.wait()

    # -- free --------------------------------------------------------------------------
    async def free(self, object_id: str, *, reason: str | None = None, wait_fence: bool = False) -> dict[str, Any]:
        """Free an object: idempotent, bounded, and nothing about it remains afterwards."""
        started = self._clock()
        check_id(object_id)
        obj = self.objects.get(object_id)
        if obj is not None and obj.freeing is not None:
            await asyncio.shield(obj.freeing)
            obj = self.objects.get(object_id)
            if obj is not None:
                raise FreeTimeout(f"object {object_id} still has reads in flight; nothing freed")
        if obj is None:
            self.metrics.frees.labels(result="noop").inc()
            return api.FreeAnswer(False, reason="unknown object").to_json()
        obj.freeing = asyncio.get_running_loop().create_future()
        try:
            ok = await self.wait_tickets(
                lambda: self.tickets.inflight(object_id=object_id) == 0, self.config.free_wait_timeout
            )
            waited = self._clock() - started
            self.metrics.free_wait.observe(waited)
            if not ok:
                self.metrics.error("free_timeout")
                raise FreeTimeout(
                    f"object {object_id} still has {self.tickets.inflight(object_id=object_id)} "
                    f"read(s) in flight after {self.config.free_wait_timeout:g}s; nothing freed"
                )
            fenced_gens = await self._release(obj)
        finally:
            fut, obj.freeing = obj.freeing, None
            if not fut.done():
                fut.set_result(None)
        self.metrics.frees.labels(result="freed").inc()
        fenced = True
        if wait_fence and fenced_gens:
            fenced = await self.nixl.wait_retired(fenced_gens, self.config.free_wait_timeout)
        elif fenced_gens:
            fenced = False
        self.metrics.free_seconds.observe(self._clock() - started)
        log.debug("freed %s (%d bytes, reason %s)", object_id, obj.nbytes, reason)
        return api.FreeAnswer(True, obj.nbytes, round(waited, 6), fenced).to_json()

    async def release_all(self) -> None:
        """At shutdown, once reads ended or their wait ran out: deregister and forget every object."""
        await self._stop_ahead()
        for obj in list(self.objects.values()):
            await self._release(obj)

    # -- registering pooled regions ahead -------------------------------------------------
    def _start_ahead(self, keys: list[RegionKey]) -> None:
        region = tuple(keys)
        if region in self._ahead or region in self.nixl.pooled_parked:
            return
        task = asyncio.get_running_loop().create_task(self._register_ahead(keys), name="gpuobj-pooled-ahead")
        self._ahead[region] = task
        task.add_done_callback(lambda t, r=region: self._ahead.pop(r, None) if self._ahead.get(r) is t else None)

    async def _register_ahead(self, keys: list[RegionKey]) -> None:
        """Register a fenced pooled region, now idle in its owner's pool, in the spare private agent.

        Why: the next version in this buffer is then put with no registration (the parked path of
        `_put_pooled`), and its readers, told of this agent with the version before (`_announce`), have
        connected to it already. Nobody was handed a key to the region here, so the fence still holds:
        a reader can read it only after a grant or ticket of the next version."""
        try:
            async with asyncio.timeout(AHEAD_TIMEOUT):
                assert self.nixl.new_private is not None
                gen = await self.nixl.new_private()
        except (TransportError, TimeoutError) as exc:  # the next put registers the region itself
            log.warning("no spare NIXL agent to register a pooled region ahead: %s", exc)
            return
        inner = asyncio.get_running_loop().create_task(self._park_ahead(keys, gen))
        self._ahead_inner.add(inner)
        inner.add_done_callback(self._ahead_inner.discard)
        await asyncio.shield(inner)  # a shutdown cancels the wait, never the registration half done

    async def _park_ahead(self, keys: list[RegionKey], gen: Generation) -> None:
        region, taken, retired = tuple(keys), False, None
        try:
            async with self.nixl.lock:
                if (
                    self.closing
                    or self.nixl.gens.active is None
                    or region in self.nixl.pooled_parked
                    or any(o.on_release is not None and tuple(o.keys) == region for o in self.objects.values())
                ):
                    return  # stopping, or the owner's put got there first (it waited AHEAD_TIMEOUT for us)
                self.nixl.gens.add_private(gen)
                self.nixl.ledger.add_generation(gen.gid)
                self.nixl.members.setdefault(gen.gid, set())
                owner = f"ahead.{gen.gid}"
                new = self.nixl.ledger.acquire(gen.gid, keys, owner)
                self.nixl.registered_ahead += len(new)  # with the ledger's count: the two always agree
                try:
                    await self.nixl.control(gen.agent.register, list(new))
                except Exception as exc:
                    self.nixl.ledger.rollback(gen.gid, new, owner)
                    self.nixl.registered_ahead -= len(new)
                    self.metrics.error("nixl_register")
                    retired = self.nixl.retire_generation(gen.gid)
                    log.error("registering a pooled region ahead in %s failed: %s", gen.name, exc)
                    return
                self.nixl.ledger.release(gen.gid, owner, park_all=True)
                self.nixl.pooled_parked[region] = gen.gid
                self.metrics.registrations.labels(op="register").inc(len(new))
                taken = True
        finally:
            if retired is not None:
                await self.nixl.destroy_retired(retired)
            elif not taken:
                assert self.nixl.destroy is not None
                await self.nixl.destroy(gen)

    async def _stop_ahead(self) -> None:
        """At shutdown: no new registration ahead; the ones under way finish (bounded) or are given up."""
        for task in list(self._ahead.values()):
            task.cancel()
        pending = [*self._ahead.values(), *self._ahead_inner]
        if pending:
            await asyncio.wait(pending, timeout=AHEAD_TIMEOUT)

    async def _release(self, obj: StoredObject) -> set[int]:
        """Deregister everywhere, forget the object, quarantine or drop its tensors; returns fence gens."""
        exposed: set[int] = set()
        pooled = obj.on_release is not None
        fenced: list[Generation] = []
        async with self.nixl.lock:
            for gid in self.nixl.ledger.owner_generations(obj.object_id):
                released = self.nixl.ledger.release(gid, obj.object_id, park_exposed=True, park_all=pooled)
                if released.deregister:
                    await self.nixl.deregister(gid, released.deregister)
                private = self.nixl.gens.has(gid) and self.nixl.gens.get(gid).lane == PRIVATE
                if private and released.exposed:
                    # A reader was handed this pooled region's key, and its owner refills the buffer next:
                    # destroy the agent now (below), before the owner gets the buffer back.
                    fenced.append(await self.nixl.retire_private(gid))
                elif private:
                    self.nixl.pooled_parked[tuple(obj.keys)] = gid
                elif released.exposed:
                    exposed.add(gid)
                if self.nixl.gens.has(gid):
                    self.nixl.gens.get(gid).migrated.discard(obj.object_id)
            self.objects.pop(obj.object_id, None)
            self._record_pending.discard(obj.object_id)
            self._private.discard(obj.object_id)
            if obj.shared_with:
                self._freed_grants[obj.object_id] = obj.shared_with
                if len(self._freed_grants) > FREED_GRANTS_KEPT:
                    self._freed_grants.popitem(last=False)
            members = self.nixl.members.get(obj.gid)
            if members is not None:
                members.discard(obj.object_id)
            if obj.stream is not None:
                items = self.streams.get(obj.stream)
                if items is not None:
                    items.discard(obj.object_id)
                    if not items:
                        del self.streams[obj.stream]
        for gen in fenced:
            await self.nixl.destroy_retired(gen)  # from here on a replay of this version's key fails
        if fenced and pooled and not self.closing:
            # The owner refills the buffer next: register it now in the spare agent readers were told of,
            # while the owner packs, so the next version's put registers nothing and its readers are connected.
            self._start_ahead(list(obj.keys))
        tensors, obj.tensors, obj.description = obj.tensors, [], None
        if exposed:
            self.nixl.quarantine.add(obj.object_id, obj.nbytes, tensors, exposed, self._clock())
        del tensors  # never exposed: the memory may go now
        if pooled:
            # The owner refills the buffer with the next version: fenced above if a reader saw this one,
            # else parked registered in its agent, where the next version is put with no registration.
            callback, obj.on_release = obj.on_release, None
            try:
                callback()
            except Exception:
                log.exception("handing pooled memory of %s back to its owner failed", obj.object_id)
        self.nixl.poke()  # a sealed agent may have just emptied, or a fence is now due
        return exposed

    async def free_stream(self, stream: str) -> dict[str, Any]:
        check_stream(stream)
        ids = sorted(self.streams.get(stream, ()))
        results = await asyncio.gather(*(self.free(i, reason=f"stream {stream}") for i in ids), return_exceptions=True)
        freed, total, failed = [], 0, []
        for object_id, res in zip(ids, results, strict=True):
            if isinstance(res, BaseException):
                failed.append((object_id, res))
            elif res.get("freed"):
                freed.append(object_id)
                total += res["bytes"]
        if failed:
            raise FreeTimeout(
                f"stream {stream}: {len(failed)} object(s) not freed ({failed[0][1]}); "
                f"{len(freed)} freed, retry to finish"
            )
        return api.StreamFreeAnswer(tuple(freed), total).to_json()

    # -- views -------------------------------------------------------------------------
    def describe(self, object_id: str) -> dict[str, Any]:
        obj = self.objects.get(object_id)
        if obj is None or obj.freeing is not None:
            raise ObjectNotFound(object_id)
        return obj.describe()

    def shared_with(self, object_id: str) -> frozenset[str]:
        """Namespaces besides the source's own whose pods may read `object_id` (none if it is unknown;
        those it granted if it was freed lately, so that a granted reader learns it is gone)."""
        obj = self.objects.get(object_id)
        return obj.shared_with if obj is not None else self._freed_grants.get(object_id, frozenset())

    def set_record_pending(self, object_id: str, pending: bool) -> None:
        """The embedding client says whether this object's GPUObject is still waiting to be recorded.

        Why: an object put during an API outage is referenced by a live handle but described by no
        GPUObject until its create lands; the inventory says so, and the audit then never reclaims it."""
        if pending:
            self._record_pending.add(object_id)
        else:
            self._record_pending.discard(object_id)

    def set_private(self, object_id: str, private: bool) -> None:
        """The embedding client says this object is private: its own handle holds it and it will not be
        recorded unless shared (docs/design.md, "Recording policy"). Only an in-process agent is told, so a
        standalone agent's unrecorded objects still count as leaked once their client is gone."""
        if private:
            self._private.add(object_id)
        else:
            self._private.discard(object_id)

    def agent_info(self, *, started_wall: float, endpoint: str) -> api.AgentInfo:
        """INFO's answer: whose agent holds this store (pod, namespace, UID, process incarnation) and its
        NIXL agents. One builder for the agent and the scale fleet's stand-in (gpuobj_dev.scale.fleet_agent)."""
        c, active = self.config, self.nixl.gens.active
        return api.AgentInfo(
            pod=c.pod_name,
            namespace=c.namespace,
            pod_uid=c.pod_uid,
            incarnation=self.incarnation,
            nixl_agent=active.name if active else None,
            nixl_agents=tuple(self.nixl.gens.live_names()),
            started_at=iso_time(started_wall),
            endpoint=endpoint,
        )

    def inventory(self) -> api.Inventory:
        """INVENTORY's whole answer: every object held, under the same identity as `agent_info`."""
        c = self.config
        return api.Inventory(c.pod_name, c.namespace, c.pod_uid, self.incarnation, tuple(self.inventory_objects()))

    def inventory_objects(self) -> list[api.InventoryItem]:
        now = self._clock()
        return [
            api.InventoryItem(
                id=obj.object_id,
                bytes=obj.nbytes,
                age_seconds=round(now - obj.created_mono, 3),
                stream=obj.stream,
                stream_index=obj.stream_index,
                key=obj.key,
                inflight_reads=self.tickets.inflight(object_id=obj.object_id),
                freeing=obj.freeing is not None,
                record_pending=obj.object_id in self._record_pending,
                private=obj.object_id in self._private,
                tensors=tuple(obj.layouts),
                created_at=iso_time(obj.created_wall),
                devices=tuple(obj.devices),
            )
            for obj in sorted(self.objects.values(), key=lambda o: o.created_mono)
        ]
