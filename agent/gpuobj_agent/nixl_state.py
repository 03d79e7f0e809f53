"""The agent's NIXL state: generations, registrations, quarantine, the control thread and the lock.

Why one object: the object store (puts, frees) and the fencer (rotations, retirements) change
the same NIXL bookkeeping, in a known order under one lock, on one control thread. Both are
handed this object; neither holds the other's internals. The store asks for a fence through
it (`poke`, `rotate_now`, `wait_retired`) and the fencer answers through it (`rotated`,
`retired`), so there is no back-reference from the store to the fencer.

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
from gpuobj_agent.quarantine import Quarantine
from gpuobj_agent.registrations import RegionKey, RegistrationLedger

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
        self.pooled_parked: dict[tuple[RegionKey, ...], int] = {}
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

    async def deregister(self, gid: int, keys: list[RegionKey]) -> None:
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

    # -- generations -----------------------------------------------------------------------
    def add_generation(self, gen: Generation) -> None:
        """A new NIXL agent joins (the caller holds `lock`)."""
        self.gens.add(gen)
        self.ledger.add_generation(gen.gid)
        self.members.setdefault(gen.gid, set())

    async def retire_private(self, gid: int) -> Generation:
        """Deregister what a private generation still holds and retire it (the caller holds `lock`).

        Nothing may own a region there any more. Its agent is destroyed by `destroy_retired`, outside the lock."""
        parked = self.ledger.parked(gid)
        if parked:
            await self.deregister(gid, parked)
        self.pooled_parked = {k: g for k, g in self.pooled_parked.items() if g != gid}
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
