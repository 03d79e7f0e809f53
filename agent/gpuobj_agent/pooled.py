"""Pooled regions: memory its owner refills with the next version (a weight-sync pack buffer), each in a
NIXL agent of its own, and registered again ahead of its next put.

Why apart from the store: a pooled region follows its own rule of placement. Destroying the agent that
registered a region is the only way NIXL lets us end a reader's use of a key it was handed (fencing.py),
and a pooled region is refilled right after its free; so each region lives in a private agent that the
free destroys at once when a reader saw the key, and a version no reader saw leaves its region parked
there, registered, for the next version (docs/weight-sync.md). This module holds that rule and the
background registrations it starts; the store keeps the objects and hands each pooled put here.
It reads the store's records and records through the store (`Records`), never on its own; its NIXL
registrations and parked regions are written by nixl_state.py (the one writer of placement).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from gpuobj_agent.errors import Conflict, NotReady, TransportError
from gpuobj_agent.generations import Generation
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.objects import Description, NewObject, StoredObject
from gpuobj_agent.registrations import RegionKey

log = logging.getLogger(__name__)

# A pooled region is registered again ahead of its next put (`_register_ahead`): bounds on that background work
# (making the spare agent when none is ready, and a put waiting for a registration already under way).
AHEAD_TIMEOUT = 30.0


class Records(Protocol):
    """What the pooled placement needs of the store (store.ObjectStore)."""

    @property
    def objects(self) -> Mapping[str, StoredObject]: ...

    @property
    def closing(self) -> bool: ...

    def record(
        self, object_id: str, tensors: list[torch.Tensor], new: NewObject, gid: int, described: Description
    ) -> StoredObject: ...


class PooledRegions:
    """Puts of pooled memory, and the regions being registered ahead of their next put."""

    def __init__(self, records: Records, nixl: NixlState, metrics: AgentMetrics) -> None:
        self.records = records
        self.nixl = nixl
        self.metrics = metrics
        # Pooled regions being registered ahead in a spare private agent (`_register_ahead`), by region; and
        # the registrations themselves, shielded so that a shutdown never leaves one half recorded.
        self._ahead: dict[tuple[RegionKey, ...], asyncio.Task[None]] = {}
        self._ahead_inner: set[asyncio.Task[None]] = set()

    @property
    def registering_ahead(self) -> int:
        """Pooled regions whose registration ahead of the next put is under way (`_register_ahead`)."""
        return len(self._ahead)

    async def put(self, object_id: str, tensors: list[torch.Tensor], new_object: NewObject) -> StoredObject:
        """Put pooled memory in a NIXL agent of its own (see the module's doc).

        A parked region (its last version seen by no reader, or registered ahead) takes no registration;
        otherwise a fresh private agent registers it (one registration)."""
        keys, spans = new_object.keys, new_object.spans
        ahead = self._ahead.get(tuple(keys))
        if ahead is not None:  # its registration started at the last version's free: let it finish
            with contextlib.suppress(Exception):
                async with asyncio.timeout(AHEAD_TIMEOUT):
                    await asyncio.shield(ahead)
        for _attempt in range(3):
            fresh: Generation | None = None
            if not self.nixl.is_parked(keys):
                assert self.nixl.new_private is not None
                fresh = await self.nixl.new_private()
            retired = None
            try:
                async with self.nixl.lock:
                    if object_id in self.records.objects:
                        raise Conflict(f"object {object_id} already exists")
                    if self.nixl.gens.active is None or self.records.closing:
                        raise NotReady("the agent is not ready (starting or stopping)")
                    adopted = await self.nixl.adopt_parked(object_id, keys, spans)
                    if adopted is not None:  # parked, never seen by a reader: no registration
                        gid, described = adopted
                        return self.records.record(object_id, tensors, new_object, gid, described)
                    if fresh is None:
                        continue  # its parked agent went meanwhile (a shutdown): take a fresh one
                    gen, fresh = fresh, None
                    self.nixl.add_private(gen)
                    try:
                        described = await self.nixl.register(gen, object_id, keys, spans)
                    except TransportError:
                        retired = self.nixl.retire_generation(gen.gid)
                        raise
                    return self.records.record(object_id, tensors, new_object, gen.gid, described)
            finally:
                if retired is not None:
                    await self.nixl.destroy_retired(retired)
                if fresh is not None:  # taken but not used
                    assert self.nixl.destroy is not None
                    await self.nixl.destroy(fresh)
        raise NotReady(f"object {object_id}: no NIXL agent could take it; retry")

    # -- registering pooled regions ahead -------------------------------------------------
    def start_ahead(self, keys: list[RegionKey]) -> None:
        """After a free that fenced a pooled region: register it again, in the background (`_register_ahead`)."""
        region = tuple(keys)
        if region in self._ahead or self.nixl.is_parked(keys):
            return
        task = asyncio.get_running_loop().create_task(self._register_ahead(keys), name="gpuobj-pooled-ahead")
        self._ahead[region] = task
        task.add_done_callback(functools.partial(self._forget_ahead, region))

    def _forget_ahead(self, region: tuple[RegionKey, ...], task: asyncio.Task[None]) -> None:
        if self._ahead.get(region) is task:
            del self._ahead[region]

    async def _register_ahead(self, keys: list[RegionKey]) -> None:
        """Register a fenced pooled region, now idle in its owner's pool, in the spare private agent.

        Why: the next version in this buffer is then put with no registration (the parked path of
        `put`), and its readers, told of this agent with the version before (reads.py, `_announce`), have
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
                    self.records.closing
                    or self.nixl.gens.active is None
                    or self.nixl.is_parked(keys)
                    or any(o.on_release is not None and tuple(o.keys) == region for o in self.records.objects.values())
                ):
                    return  # stopping, or the owner's put got there first (it waited AHEAD_TIMEOUT for us)
                try:
                    await self.nixl.park_ahead(gen, keys)
                except TransportError as exc:
                    retired = gen  # retired by park_ahead: destroyed below
                    log.error("%s", exc)
                    return
                taken = True
        finally:
            if retired is not None:
                await self.nixl.destroy_retired(retired)
            elif not taken:
                assert self.nixl.destroy is not None
                await self.nixl.destroy(gen)

    async def stop(self) -> None:
        """At shutdown: no new registration ahead; the ones under way finish (bounded) or are given up."""
        for task in list(self._ahead.values()):
            task.cancel()
        pending = [*self._ahead.values(), *self._ahead_inner]
        if pending:
            await asyncio.wait(pending, timeout=AHEAD_TIMEOUT)
