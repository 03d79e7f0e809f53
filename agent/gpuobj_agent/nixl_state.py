"""The agent's NIXL state: generations, registrations, quarantine, the control thread and the lock; and the
one writer of placement (which NIXL agent a stored object's regions are registered in).

Why one object: the object store (puts, frees) and the fencer (rotations, retirements) change
the same NIXL bookkeeping, in a known order under one lock, on one control thread. Both are
handed this object; neither holds the other's internals. The store asks for a fence through
it (`poke`, `rotate_now`, `wait_retired`) and the fencer answers through it (`rotated`,
`retired`), so there is no back-reference from the store to the fencer.

Placement has one writer, this object (the "placement" verbs below: `register`, `adopt_parked`, `park_ahead`,
`move`, `release`, `release_moved`, `deregister_parked`, `retire_*`). The store, the pooled regions and the
fencer decide *when* and *what* (a put, a free, a rotation and which objects move); every NIXL
registration, deregistration and move of an object's region, and its ledger record, happens here, so the
ledger and the agents cannot disagree (tests/unit/agent/test_placement_owner.py keeps it so).

Everything here lives on the agent's event loop; only `control` runs NIXL calls, on the
dedicated control thread, so the loop never blocks on NIXL (docs/design.md, "out-of-order deadlock").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from typing import TypeVar, TypeVarTuple

from gpuobj_agent.errors import TransportError
from gpuobj_agent.generations import Generation, GenerationTable
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_transport import Span
from gpuobj_agent.objects import Description, StoredObject, describe_in, register_in
from gpuobj_agent.quarantine import Quarantine
from gpuobj_agent.registrations import RegionKey, RegionReused, RegistrationLedger, Released

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")

log = logging.getLogger(__name__)


class NixlState:
    """What each NIXL agent of this pod holds, and the requests the fencer has to serve."""

    def __init__(
        self,
        base_name: str,
        *,
        control: Executor,
        metrics: AgentMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gens = GenerationTable(base_name)
        self.ledger = RegistrationLedger()
        self.quarantine = Quarantine()
        self.members: dict[int, set[str]] = {}  # generation id -> objects whose tickets it serves
        self.lock = asyncio.Lock()  # one NIXL registration change at a time, in a known order
        self.metrics = metrics
        self._control_executor = control
        self._clock = clock
        # Requests to the fencer (fencing.py serves them).
        self.wake = asyncio.Event()
        self._forced: list[asyncio.Future[None]] = []
        self._urgent: set[int] = set()  # generations someone waits to see fenced: rotate without batching
        self._retired: dict[int, asyncio.Event] = {}
        # Private NIXL agents for pooled regions (pooled.py), made and destroyed by the fencer, which sets
        # these at its construction: `new_private` returns a fresh agent in no lane (not yet added here),
        # `destroy` tears one down on the lifecycle thread.
        self.new_private: Callable[[], Awaitable[Generation]] | None = None
        self.destroy: Callable[[Generation], Awaitable[None]] | None = None
        # The private agent `new_private` will return next, if ready (announced to readers ahead, reads.py).
        self.next_private: Callable[[], Generation | None] = lambda: None
        # Pooled regions parked in their private agent, never handed to a reader: the next version in the
        # same buffer is put there with no registration. regions -> generation id.
        self._pooled_parked: dict[tuple[RegionKey, ...], int] = {}
        # Regions registered ahead of a put, in a spare private agent, after the free that fenced the
        # version before (pooled.py): off every version's path. Counted apart from `ledger.registrations`
        # (which counts them too), so "registrations on a put's path" = the difference.
        self.registered_ahead = 0

    # -- the control thread ---------------------------------------------------------------
    async def control(self, fn: Callable[[*_Args], _T], *args: *_Args) -> _T:
        """Run a NIXL call on the control thread."""
        return await asyncio.get_running_loop().run_in_executor(self._control_executor, fn, *args)

    async def barrier(self) -> None:
        """Return once no control-thread call queued before this one is still running."""
        await self.control(lambda: None)

    async def _deregister(self, gid: int, keys: list[RegionKey]) -> None:
        """Deregister from the NIXL agent that registered them; the ledger records it either way.

        The caller holds `lock`."""
        agent = self.gens.get(gid).agent
        try:
            await self.control(agent.deregister, keys)
        except TransportError as exc:
            # The agent will be destroyed anyway; the registration cannot outlive it.
            log.error("NIXL deregister in generation %d failed: %s", gid, exc)
            self.metrics.error("nixl_deregister")
        self.ledger.deregistered(gid, keys)
        self.metrics.registrations.labels(op="deregister").inc(len(keys))

    # -- placement: the one writer (every verb: the caller holds `lock`) -----------------------
    async def register(
        self, gen: Generation, object_id: str, keys: list[RegionKey], spans: list[Span | None]
    ) -> Description:
        """Register an object's regions in `gen` (those it does not hold yet) and describe them for readers.

        Raises RegionReused (nothing recorded: a newer agent must take it) or TransportError (rolled back)."""
        new = self.ledger.acquire(gen.gid, keys, object_id)
        try:
            [described] = await self.control(register_in, gen.agent, new, [(keys, spans)])
        except Exception as exc:
            self.ledger.rollback(gen.gid, new, object_id)
            self.metrics.error("nixl_register")
            raise TransportError(f"registering object {object_id} with NIXL failed: {exc}") from exc
        self.metrics.registrations.labels(op="register").inc(len(new))
        return described

    def placed(self, gid: int, object_id: str) -> None:
        """A recorded object is served by generation `gid` (its tickets name that agent)."""
        self.members.setdefault(gid, set()).add(object_id)

    def is_parked(self, keys: list[RegionKey]) -> bool:
        """A pooled region is parked, registered, in a private agent (its next put registers nothing)."""
        return tuple(keys) in self._pooled_parked

    async def adopt_parked(
        self, object_id: str, keys: list[RegionKey], spans: list[Span | None]
    ) -> tuple[int, Description] | None:
        """Put a pooled object in the private agent its region is parked in (no registration), or None."""
        region = tuple(keys)
        gid = self._pooled_parked.pop(region, None)
        if gid is None:
            return None
        gen = self.gens.get(gid)
        new = self.ledger.acquire(gid, keys, object_id)
        assert not new, "a parked pooled region is registered in its agent"
        try:
            described = await self.control(describe_in, gen.agent, keys, spans)
        except Exception as exc:
            self.ledger.release(gid, object_id, park_all=True)
            self._pooled_parked[region] = gid
            self.metrics.error("nixl_describe")
            raise TransportError(f"describing object {object_id} for NIXL failed: {exc}") from exc
        return gid, described

    def add_private(self, gen: Generation) -> None:
        """A fresh private agent (pooled.py) joins, in no lane."""
        self.gens.add_private(gen)
        self.ledger.add_generation(gen.gid)
        self.members.setdefault(gen.gid, set())

    async def park_ahead(self, gen: Generation, keys: list[RegionKey]) -> None:
        """Register an idle pooled region in the fresh private agent `gen` and park it there, owned by nobody.

        On failure (TransportError) `gen` holds nothing and is retired; the caller destroys it."""
        self.add_private(gen)
        owner = f"ahead.{gen.gid}"
        new = self.ledger.acquire(gen.gid, keys, owner)
        self.registered_ahead += len(new)  # with the ledger's count: the two always agree
        try:
            await self.control(gen.agent.register, list(new))
        except Exception as exc:
            self.ledger.rollback(gen.gid, new, owner)
            self.registered_ahead -= len(new)
            self.metrics.error("nixl_register")
            self.retire_generation(gen.gid)
            raise TransportError(f"registering a pooled region ahead in {gen.name} failed: {exc}") from exc
        self.ledger.release(gen.gid, owner, park_all=True)
        self._pooled_parked[tuple(keys)] = gen.gid
        self.metrics.registrations.labels(op="register").inc(len(new))

    async def move(self, target: Generation, candidates: Iterable[StoredObject], limit: int) -> list[StoredObject]:
        """Register up to `limit` of `candidates` in `target` (one bulk registration) and move them there.

        Objects whose region `target` deregistered after a reader saw it stay (RegionReused); a failed
        registration moves none. Each moved object is described again lazily, on its next read."""
        batch: list[StoredObject] = []
        new_keys: list[RegionKey] = []
        for obj in candidates:
            if len(batch) >= limit:
                break
            try:
                new_keys.extend(self.ledger.acquire(target.gid, obj.keys, obj.object_id))
            except RegionReused:
                continue  # that region must wait for a newer agent
            batch.append(obj)
        if not batch:
            return []
        try:
            if new_keys:
                await self.control(target.agent.register, new_keys)
        except Exception as exc:
            fresh = set(new_keys)
            for obj in batch:
                mine = [k for k in obj.keys if k in fresh]
                fresh.difference_update(mine)
                self.ledger.rollback(target.gid, mine, obj.object_id)
            log.error("moving %d objects to %s failed: %s", len(batch), target.name, exc)
            self.metrics.error("nixl_register")
            return []
        self.metrics.registrations.labels(op="register").inc(len(new_keys))
        into = self.members.setdefault(target.gid, set())
        for obj in batch:
            self.members.get(obj.gid, set()).discard(obj.object_id)
            obj.gid = target.gid
            obj.description = None  # described lazily, on its next read
            into.add(obj.object_id)
        return batch

    async def release_moved(self, gid: int, object_ids: Iterable[str]) -> None:
        """Drop moved objects from the agent they left, deregistering what nobody there uses."""
        keys: list[RegionKey] = []
        for oid in object_ids:
            keys.extend(self.ledger.release(gid, oid).deregister)
        if keys:
            await self._deregister(gid, keys)

    async def release(self, obj: StoredObject) -> list[tuple[int, Released]]:
        """A freed object leaves every agent that holds its regions: what nobody uses is deregistered now;
        an exposed region is parked until its agent's fence, and a pooled region is parked for its next
        version (`park_pooled`, or its private agent retired). Returns what each agent released."""
        pooled = obj.on_release is not None
        out: list[tuple[int, Released]] = []
        for gid in self.ledger.owner_generations(obj.object_id):
            released = self.ledger.release(gid, obj.object_id, park_exposed=True, park_all=pooled)
            if released.deregister:
                await self._deregister(gid, released.deregister)
            out.append((gid, released))
        members = self.members.get(obj.gid)
        if members is not None:
            members.discard(obj.object_id)
        return out

    def park_pooled(self, keys: list[RegionKey], gid: int) -> None:
        """A freed pooled version no reader saw: its region stays registered in private agent `gid`."""
        self._pooled_parked[tuple(keys)] = gid

    async def deregister_parked(self, gid: int) -> None:
        """Deregister the regions nobody uses that agent `gid` still holds (before its fence)."""
        parked = self.ledger.parked(gid) if gid in self.ledger.generations() else []
        if parked:
            await self._deregister(gid, parked)

    # -- generations -----------------------------------------------------------------------
    def add_generation(self, gen: Generation) -> None:
        """A new NIXL agent joins (the caller holds `lock`)."""
        self.gens.add(gen)
        self.ledger.add_generation(gen.gid)
        self.members.setdefault(gen.gid, set())

    async def retire_private(self, gid: int) -> Generation:
        """Deregister what a private generation still holds and retire it (the caller holds `lock`).

        Nothing may own a region there any more. Its agent is destroyed by `destroy_retired`, outside the lock."""
        await self.deregister_parked(gid)
        self._pooled_parked = {k: g for k, g in self._pooled_parked.items() if g != gid}
        return self.retire_generation(gid)

    async def destroy_retired(self, gen: Generation) -> None:
        """Destroy a retired generation's agent: a reader's old key to its regions fails from here on."""
        await self.barrier()  # no control-thread call (a notification poll) on this agent is left
        assert self.destroy is not None
        await self.destroy(gen)
        self.retired(gen.gid)

    def retire_generation(self, gid: int) -> Generation:
        """Forget an emptied NIXL agent before it is destroyed (the caller holds `lock`)."""
        gen = self.gens.retire(gid, self._clock())
        self.ledger.drop_generation(gid)
        self.members.pop(gid, None)
        return gen

    # -- requests to the fencer ------------------------------------------------------------
    def poke(self) -> None:
        """Something changed (a free, a ticket end): the fencer looks again."""
        self.wake.set()

    async def rotate_now(self, timeout: float = 30.0) -> None:
        """Rotate the young agent as soon as a spare is ready (a region must be registered anew)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._forced.append(fut)
        self.poke()
        async with asyncio.timeout(timeout):
            await asyncio.shield(fut)

    async def wait_retired(self, gids: Iterable[int], timeout: float) -> bool:
        """Fence `gids` now (no batching delay) and wait until each is destroyed."""
        deadline = self._clock() + timeout
        gids = list(gids)
        self._urgent.update(gids)
        self.poke()
        for gid in gids:
            if not self.gens.has(gid):
                continue
            event = self._retired.setdefault(gid, asyncio.Event())
            try:
                async with asyncio.timeout(max(0.0, deadline - self._clock())):
                    await event.wait()
            except TimeoutError:
                return False
        return True

    # -- the fencer's answers --------------------------------------------------------------
    @property
    def rotation_forced(self) -> bool:
        return bool(self._forced)

    def urgent(self, gid: int) -> bool:
        return gid in self._urgent

    def rotated(self) -> None:
        """The young agent was rotated: every `rotate_now` waiting returns."""
        forced, self._forced = self._forced, []
        for fut in forced:
            if not fut.done():
                fut.set_result(None)

    def retired(self, gid: int) -> None:
        """Generation `gid` was destroyed: its fence is up; `wait_retired` on it returns."""
        self._urgent.discard(gid)
        event = self._retired.pop(gid, None)
        if event is not None:
            event.set()

    def stopping(self) -> None:
        """The fencer stops: nobody will rotate any more."""
        forced, self._forced = self._forced, []
        for fut in forced:
            if not fut.done():
                fut.set_exception(TransportError("agent stopping"))
