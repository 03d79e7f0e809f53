"""The object store: objects (tensors under an id), their NIXL registrations and frees.

Why it is shaped this way:
- Every piece of state lives on the agent's event loop and is changed by one coroutine at
  a time; NIXL calls run on a dedicated control thread (`await self.nixl.control(...)`), so
  the loop never blocks on NIXL and the server keeps answering (docs/design.md, "out-of-order deadlock").
- Bookkeeping is delegated to plain-Python modules: the registrations ledger (what each
  NIXL agent holds), generations (which NIXL agent is active) and the quarantine (freed memory
  waiting for its fence). This class wires them to NIXL and to the objects (objects.py). The read
  side (tickets, grants, read ends, expiry) is reads.py, and pooled memory's placement pooled.py.
- Answers are the contract's typed shapes (gpuobj_contract.agent_api); only the routes (server.py)
  turn them into JSON.
- A free is idempotent and leaves nothing behind: it waits (bounded) for the object's
  tickets, deregisters from the NIXL agent that registered it, forgets the object, and
  either drops the tensors or, if a reader was ever handed their keys, quarantines them
  until fencing.py has destroyed every NIXL agent that exposed them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
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
)
from gpuobj_agent.generations import PRIVATE, Generation
from gpuobj_agent.layouts import TensorLayout, allocate, layout_of
from gpuobj_agent.metrics import AgentMetrics, Levels
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.nixl_transport import Span, exact_regions
from gpuobj_agent.objects import Description, NewObject, StoredObject, check_id, check_stream, iso_time
from gpuobj_agent.pooled import PooledRegions
from gpuobj_agent.reads import Reads
from gpuobj_agent.registrations import RegionReused
from gpuobj_contract import agent_api as api

log = logging.getLogger(__name__)

# Freed objects that granted other namespaces (spec.sharedWith) are remembered, this many at most, so
# that a granted reader of another namespace hears "not found" (404), not "may not read" (403).
FREED_GRANTS_KEPT = 4096


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
        self.objects: dict[str, StoredObject] = {}
        # The read side: tickets, grants, read ends, expiry (reads.py); it reads `objects`, never changes them.
        self.reads = Reads(self.objects, nixl, config, metrics, incarnation=incarnation, clock=clock)
        self.streams: dict[str, set[str]] = {}
        self.published: dict[str, list[torch.Tensor]] = {}
        # Objects whose GPUObject the embedding client has queued but not recorded yet (its write-behind);
        # set by the client's core, which runs on this store's loop (gpuobj.client.loop): one thread.
        self._record_pending: set[str] = set()
        self._private: set[str] = set()  # the same client's private objects: never to be recorded
        self._freed_grants: OrderedDict[str, frozenset[str]] = OrderedDict()  # object id -> sharedWith, bounded
        self.closing = False
        self.pooled = PooledRegions(self, nixl, metrics)  # pack buffers, each in a NIXL agent of its own

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
        """Pooled regions whose registration ahead of the next put is under way (pooled.py)."""
        return self.pooled.registering_ahead

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
            len(self.reads.tickets.live()),
            self.nixl.quarantine.bytes,
            gens,
        )

    # -- put ---------------------------------------------------------------------------
    def _prepare(self, tensors: Any, copy: bool) -> tuple[list[torch.Tensor], list[TensorLayout]]:
        """The tensors to hold (contiguous) and their layouts; BadRequest names the first that cannot be."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise BadRequest("an object is a non-empty list of tensors")
        out, layouts = [], []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise BadRequest(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            layouts.append(layout_of(t))  # validates dtype and device
            if not t.is_contiguous():
                if not copy:
                    raise BadRequest(
                        f"tensor {i} is not contiguous (stride {tuple(t.stride())} for shape {tuple(t.shape)}); "
                        "NIXL reads one contiguous span per tensor: pass tensor.contiguous(), or put(..., copy=True) "
                        "to let the agent store a contiguous copy"
                    )
                t = t.contiguous()
            out.append(t)
        return out, layouts

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
        tensors, layouts = self._prepare(tensors, copy)
        self._check_quota(sum(lay.nbytes for lay in layouts))
        if any(lay.device != "cpu" for lay in layouts):
            await self.nixl.control(_sync_cuda, tensors)  # off the loop: a device sync may take a while
        spans = [Span.of(t) for t in tensors]
        keys = exact_regions(spans)  # the object's own bytes, never the rest of the storage it views
        if len({k.mem for k in keys}) > 1:
            # NIXL's partial metadata cannot describe both; its full metadata names every region of the agent.
            raise BadRequest("an object is in host memory or on GPUs, not both: put the CPU and CUDA tensors apart")
        new_object = NewObject(layouts, spans, keys, stream, stream_index, key, frozenset(shared_with), on_release)
        if on_release is not None:
            return await self.pooled.put(object_id, tensors, new_object)
        for attempt in range(2):
            async with self.nixl.lock:
                if object_id in self.objects:
                    raise Conflict(f"object {object_id} already exists")
                gen = self.nixl.gens.active
                if gen is None or self.closing:
                    raise NotReady("the agent is not ready (starting or stopping)")
                try:
                    described = await self.nixl.register(gen, object_id, keys, spans)
                except RegionReused:
                    if attempt:
                        raise
                else:
                    return self.record(object_id, tensors, new_object, gen.gid, described)
            # One of these storages was freed after a reader saw it, and is alive again (the workload
            # re-put a tensor it still holds): a newer NIXL agent must take it. Rotate and retry.
            await self.nixl.rotate_now()
        raise AssertionError("unreachable")

    def record(
        self, object_id: str, tensors: list[torch.Tensor], new: NewObject, gid: int, described: Description
    ) -> StoredObject:
        """Record a registered object (the caller holds the NIXL lock; pooled.py records through it too)."""
        layouts, spans, keys, stream, stream_index, key, shared_with, on_release = new
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
        self.nixl.placed(gid, object_id)
        if stream is not None:
            self.streams.setdefault(stream, set()).add(object_id)
        return obj

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
        self.published[key] = self._prepare(tensors, copy=False)[0]

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

    # -- free --------------------------------------------------------------------------
    async def free(self, object_id: str, *, reason: str | None = None, wait_fence: bool = False) -> api.FreeAnswer:
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
            return api.FreeAnswer(False, reason="unknown object")
        obj.freeing = asyncio.get_running_loop().create_future()
        tickets = self.reads.tickets
        try:
            ok = await self.reads.wait_tickets(
                lambda: tickets.inflight(object_id=object_id) == 0, self.config.free_wait_timeout
            )
            waited = self._clock() - started
            self.metrics.free_wait.observe(waited)
            if not ok:
                self.metrics.error("free_timeout")
                raise FreeTimeout(
                    f"object {object_id} still has {tickets.inflight(object_id=object_id)} "
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
        return api.FreeAnswer(True, obj.nbytes, round(waited, 6), fenced)

    async def release_all(self) -> None:
        """At shutdown, once reads ended or their wait ran out: deregister and forget every object."""
        await self.pooled.stop()
        for obj in list(self.objects.values()):
            await self._release(obj)

    async def _release(self, obj: StoredObject) -> set[int]:
        """Deregister everywhere, forget the object, quarantine or drop its tensors; returns fence gens."""
        exposed: set[int] = set()
        pooled = obj.on_release is not None
        fenced: list[Generation] = []
        async with self.nixl.lock:
            for gid, released in await self.nixl.release(obj):
                private = self.nixl.gens.has(gid) and self.nixl.gens.get(gid).lane == PRIVATE
                if private and released.exposed:
                    # A reader was handed this pooled region's key, and its owner refills the buffer next:
                    # destroy the agent now (below), before the owner gets the buffer back.
                    fenced.append(await self.nixl.retire_private(gid))
                elif private:
                    self.nixl.park_pooled(obj.keys, gid)
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
            self.pooled.start_ahead(list(obj.keys))
        tensors, obj.tensors, obj.description = obj.tensors, [], None
        if exposed:
            self.nixl.quarantine.add(obj.object_id, obj.nbytes, tensors, exposed, self._clock())
        del tensors  # never exposed: the memory may go now
        if obj.on_release is not None:
            # The owner refills the buffer with the next version: fenced above if a reader saw this one,
            # else parked registered in its agent, where the next version is put with no registration.
            callback, obj.on_release = obj.on_release, None
            try:
                callback()
            except Exception:
                log.exception("handing pooled memory of %s back to its owner failed", obj.object_id)
        self.nixl.poke()  # a sealed agent may have just emptied, or a fence is now due
        return exposed

    async def free_stream(self, stream: str) -> api.StreamFreeAnswer:
        check_stream(stream)
        ids = sorted(self.streams.get(stream, ()))
        results = await asyncio.gather(*(self.free(i, reason=f"stream {stream}") for i in ids), return_exceptions=True)
        freed, total, failed = [], 0, []
        for object_id, res in zip(ids, results, strict=True):
            if isinstance(res, BaseException):
                failed.append((object_id, res))
            elif res.freed:
                freed.append(object_id)
                total += res.bytes
        if failed:
            raise FreeTimeout(
                f"stream {stream}: {len(failed)} object(s) not freed ({failed[0][1]}); "
                f"{len(freed)} freed, retry to finish"
            )
        return api.StreamFreeAnswer(tuple(freed), total)

    # -- views -------------------------------------------------------------------------
    def describe(self, object_id: str) -> api.ObjectDescription:
        obj = self.objects.get(object_id)
        if obj is None or obj.freeing is not None:
            raise ObjectNotFound(object_id)
        return obj.answer()

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

    def agent_info(self, *, started_wall: float, endpoint: str, write_rate: float | None = None) -> api.AgentInfo:
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
            write_rate=write_rate,
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
                inflight_reads=self.reads.tickets.inflight(object_id=obj.object_id),
                freeing=obj.freeing is not None,
                record_pending=obj.object_id in self._record_pending,
                private=obj.object_id in self._private,
                tensors=tuple(obj.layouts),
                created_at=iso_time(obj.created_wall),
                devices=tuple(obj.devices),
            )
            for obj in sorted(self.objects.values(), key=lambda o: o.created_mono)
        ]
