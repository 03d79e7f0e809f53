"""Fencing stale readers by retiring the NIXL agent that exposed freed memory.

The problem (NIXL 1.5.1, UCX backend; measured on this machine, two processes):
- Deregistration fences nobody: a reader holding the old metadata and descriptors reads
  the region after `deregister_memory` as if nothing happened.
- Freed memory is worse: with UCX_TLS=tcp the *source* serves the read in its progress
  thread and dies of SIGSEGV once the pages are unmapped; with the default transports
  (cma: the reader copies with process_vm_readv) the reader's connection breaks when the
  pages are gone, and when they are still mapped (small tensors live in the malloc heap)
  it silently gets whatever is there now.
- NIXL has no per-region revocation: a loaded remote key cannot be made invalid.

What works: destroying the NIXL agent (its UCX worker) whose metadata the reader holds.
Later reads by that reader fail with NIXL_ERR_REMOTE_DISCONNECT, under the default
transports and UCX_TLS=tcp, whether it had connected before or not, whether the memory
is still there or not, and while it hammers the agent with 256 MiB reads; the source
process stays up and its other agents keep serving. Creating an agent costs 20-60 ms
(0.45 s for the first one in a process: plugin loading), destroying one 3-5 ms, both
with the GIL mostly released.

The design. NIXL agents come in generations (generations.py), in two lanes like a
generational garbage collector: objects are registered in the young lane's active
agent; when an agent is sealed, its live objects move (one bulk registration, 3.3 us a
region) to the tenured lane's active agent. A free deregisters at once, with the agent
that registered the memory, forgets the object and answers; if some reader was ever
handed the object's keys, its tensors go to the quarantine (quarantine.py) instead of
being dropped, waiting on that agent, and its regions stay registered there, parked,
until that agent is retired (deregistering them would fence nobody, and NIXL refuses a
reader a second key for the same region, so a persistent tensor put again would need a
newer agent every time; parked, the same key serves it). The fencer then rotates: within
`fence_interval` (young) or `tenured_fence_interval` (long-lived objects); within
`small_fence_interval` while fewer than `quarantine_low_bytes` wait on a young agent (a rotation's
20-60 ms of CPU is not worth a few KiB four times a second); at once above `quarantine_high_bytes`
or when a free asks to wait for its fence. It activates a pre-created spare agent in that lane,
moves the sealed agent's live objects out in chunks (their metadata is recomputed lazily, on
their next read), waits until no ticket
reads from the sealed agent (leases bound that), deregisters what it still holds,
destroys it, and only then releases the quarantined memory. So a stale reader is fenced
before the memory it could touch is released: it gets a clean error, never the source's
death. Objects no reader ever saw skip all of this; an agent with nothing freed never
rotates; churn of short-lived objects only ever moves the few young survivors, and a
free of a long-lived object costs one move of the tenured population per
`tenured_fence_interval` at most, never per free.

Measured here (bench/fence_costs.py, 2 CPUs, 4 KiB objects, free called from a workload
thread): free p50 0.6 ms (object never read) / 2.1 ms (read: waits for the ticket end),
p99 under 4 ms with 1,000 live objects and under 20 ms with 10,000; memory released
(fence latency) 0.18-0.26 s after the free on average; a forced tenured rotation moving
10,000 live objects 0.31 s, in the background, in chunks that let frees through.
The release of freed bytes is delayed by at most the lane's interval + the longest read
lease + agent teardown, and exported as gpuobj_agent_quarantined_bytes and
gpuobj_agent_quarantine_seconds.

Costs: a spare agent kept ready, and a tenured one once objects live long; each agent is
about 5 MiB and, with the 1 ms progress poll (nixl_transport.py), 1.6% of a core. A process
that puts pooled regions (state dicts) also keeps PRIVATE_SPARES private agents ready, each
announced to readers before a region is registered in it (reads.py, docs/weight-sync.md). A
rotation costs 20-60 ms of CPU on a background thread.

Who writes what: this module decides when to rotate, which objects move and when a sealed agent
goes; the registrations, deregistrations and moves themselves are nixl_state.py's placement verbs
(`move`, `release_moved`, `deregister_parked`), the one writer of where an object is registered.

Limits (measured or unmeasurable here):
- cma, and a raw reader with no NIXL progress thread: its worker learns of the fence only
  when it progresses, so if its first action after the fence is a new READ, that one READ
  copies whatever the address holds now (the source is never harmed; every later READ
  fails). NIXL's default agent config has a progress thread, and then the READ fails at
  once; over tcp it always fails at once. Our own fetches are never stale (read tickets).
- CUDA memory read over cuda_ipc is mapped by the reader itself; destroying our agent
  does not unmap it there, so a stale reader on the same node may still read a released
  VRAM block (never crashing the source). No GPU here to measure it.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.errors import TransportError
from gpuobj_agent.generations import LANES, TENURED, YOUNG, Generation
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.nixl_transport import NixlAgent
from gpuobj_agent.store import ObjectStore

log = logging.getLogger(__name__)

PRIVATE_SPARES = 2  # private NIXL agents kept ready for pooled regions (each ~5 MiB, 1.6% of a core idle)
MIGRATION_CHUNK = 512  # objects moved per step under the NIXL lock, so frees and puts interleave


def rotation_due(
    now: float,
    oldest: float | None,
    waiting_bytes: int,
    interval: float,
    high_bytes: int,
    *,
    low_bytes: int = 0,
    small_interval: float = 0.0,
) -> float | None:
    """Seconds until an active agent must be rotated (0: now), or None if nothing waits on it.

    Fewer than ``low_bytes`` waiting wait ``small_interval`` (when longer): a rotation's CPU buys little then."""
    if oldest is None:
        return None
    if waiting_bytes >= high_bytes:
        return 0.0
    if waiting_bytes < low_bytes:
        interval = max(interval, small_interval)
    return max(0.0, oldest + interval - now)


class Fencer:
    """Keeps a spare NIXL agent ready, rotates active ones, drains and destroys sealed ones."""

    def __init__(
        self,
        store: ObjectStore,
        nixl: NixlState,
        config: AgentConfig,
        metrics: AgentMetrics,
        *,
        lifecycle: Executor,
        agent_factory: Callable[[str], NixlAgent],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store  # read here: its objects (to move them), read tickets (store.reads) and closing
        self.nixl = nixl  # shared with the store: what each NIXL agent holds, the lock, the requests to serve
        self.config = config
        self.metrics = metrics
        self._lifecycle = lifecycle
        # Destroying an agent is a pooled version's fence, on its free's path: never queued behind the making
        # of a spare on the lifecycle thread (20-150 ms), so it has a thread of its own (3-5 ms each).
        self._teardown = ThreadPoolExecutor(1, thread_name_prefix="gpuobj-nixl-teardown")
        self._factory = agent_factory
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._spare: Generation | None = None
        self._spare_task: asyncio.Task[None] | None = None
        self._spare_failed_at: float | None = None
        self._stopping = False
        # Private agents for pooled regions (pooled.py): PRIVATE_SPARES kept ready, oldest first, so that a
        # region rarely waits for one, and the one taken next was announced to readers while ready
        # (`ready_private`) even when versions come faster than an agent is made (20-150 ms).
        self._private_spares: collections.deque[Generation] = collections.deque()
        self._private_task: asyncio.Task[None] | None = None
        self._private_waiters: list[asyncio.Event] = []
        nixl.new_private = self.new_private
        nixl.next_private = self.ready_private
        nixl.destroy = self._destroy

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Create and activate the first NIXL agent, then start the loop and the spare."""
        gen = await self._create()
        async with self.nixl.lock:
            self.nixl.add_generation(gen)
            self.nixl.gens.activate(gen.gid, self._clock(), YOUNG)
        self._refill()
        self._task = asyncio.create_task(self._run(), name="gpuobj-fencer")

    async def close(self) -> None:
        """Stop the loop and destroy every NIXL agent (the store must hold nothing by now)."""
        self._stopping = True
        self.nixl.poke()
        if self._task is not None:
            try:
                async with asyncio.timeout(30):
                    await asyncio.shield(self._task)
            except TimeoutError:
                log.error("the fencer did not stop within 30s; cancelling it")
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        for task in (self._spare_task, self._private_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.nixl.stopping()
        gens = self.nixl.gens.live()
        for spare in (self._spare, *self._private_spares):
            if spare is not None:
                gens.append(spare)
        self._spare = None
        self._private_spares.clear()
        await self.nixl.barrier()  # nothing of ours still runs on the control thread
        for gen in gens:  # nothing else runs now: no lock needed
            await self.nixl.deregister_parked(gen.gid)
        for gen in gens:
            await self._destroy(gen)
        for entry in self.nixl.quarantine.drain():
            self.metrics.quarantine_seconds.observe(self._clock() - entry.since)
        self._teardown.shutdown(wait=True)

    async def _create(self) -> Generation:
        gid, name = self.nixl.gens.new_name()
        agent = await asyncio.get_running_loop().run_in_executor(self._lifecycle, self._factory, name)
        return Generation(gid, name, agent, self._clock())

    async def _create_private(self) -> Generation:
        """A private agent and its connection info (what readers are told ahead: it names no region)."""
        gen = await self._create()
        try:
            conn = await asyncio.get_running_loop().run_in_executor(self._lifecycle, gen.agent.partial_metadata, [])
        except Exception as exc:  # still usable; only its announcement is missing
            log.error("describing spare NIXL agent %s failed: %s", gen.name, exc)
            self.metrics.error("nixl_agent_create")
        else:
            gen.announce = base64.b64encode(conn).decode()
        return gen

    @property
    def private_spares(self) -> int:
        """Private agents ready for pooled regions now."""
        return len(self._private_spares)

    def ready_private(self) -> Generation | None:
        """The private agent the next pooled region will take (`new_private`), if one is ready."""
        return None if self._stopping or not self._private_spares else self._private_spares[0]

    def _refill(self) -> None:
        if self._spare is None and (self._spare_task is None or self._spare_task.done()):
            self._spare_task = asyncio.create_task(self._make_spare(), name="gpuobj-spare-nixl-agent")

    async def _make_spare(self) -> None:
        try:
            self._spare = await self._create()
            self._spare_failed_at = None
        except TransportError as exc:
            log.error("creating a spare NIXL agent failed: %s", exc)
            self.metrics.error("nixl_agent_create")
            self._spare_failed_at = self._clock()
        self.nixl.poke()

    async def new_private(self) -> Generation:
        """A fresh NIXL agent for one pooled region: the ready one if there is one, else made now."""
        if self._stopping:
            raise TransportError("agent stopping")
        spare = self._private_spares.popleft() if self._private_spares else None
        if spare is None:
            task = self._private_task
            if task is not None and not task.done():
                made = asyncio.Event()  # one is being made: take it rather than make another
                self._private_waiters.append(made)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(30):
                        await made.wait()
                spare = self._private_spares.popleft() if self._private_spares else None
            if spare is None:
                spare = await self._create_private()
        if not self._stopping and (self._private_task is None or self._private_task.done()):
            self._private_task = asyncio.create_task(self._make_private(), name="gpuobj-private-nixl-agent")
        return spare

    async def _make_private(self) -> None:
        """Make private spares until PRIVATE_SPARES are ready."""
        try:
            while not self._stopping and len(self._private_spares) < PRIVATE_SPARES:
                try:
                    gen = await self._create_private()
                except TransportError as exc:  # the next put makes one itself (and says why if that fails too)
                    log.error("creating a spare private NIXL agent failed: %s", exc)
                    self.metrics.error("nixl_agent_create")
                    return
                if self._stopping:
                    await self._destroy(gen)
                    return
                self._private_spares.append(gen)
                waiters, self._private_waiters = self._private_waiters, []
                for made in waiters:
                    made.set()
        finally:
            waiters, self._private_waiters = self._private_waiters, []
            for made in waiters:
                made.set()

    def _want_spare(self) -> None:
        """A rotation is due and no spare is ready: make one (retrying a failure after a second)."""
        if self._spare_failed_at is None or self._clock() - self._spare_failed_at > 1.0:
            self._refill()

    async def _destroy(self, gen: Generation) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._teardown, gen.agent.close)
        except Exception as exc:  # a teardown error must not keep memory forever
            log.error("destroying NIXL agent %s failed: %s", gen.name, exc)
            self.metrics.error("nixl_agent_destroy")

    # -- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep fencing: a failed step is retried on the next wake
                log.exception("fencer step failed")
                self.metrics.error("fencer")
                await asyncio.sleep(0.5)
            delay = self._next_wake()
            self.nixl.wake.clear()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self.nixl.wake.wait()
            else:
                await asyncio.sleep(0)  # never starve the loop, even when work is due at once

    def _due(self, lane: str, now: float) -> float | None:
        gen = self.nixl.gens.active_in(lane)
        if gen is None:
            return None
        if self.nixl.urgent(gen.gid) or (lane == YOUNG and self.nixl.rotation_forced):
            return 0.0
        interval = self.config.fence_interval if lane == YOUNG else self.config.tenured_fence_interval
        q = self.nixl.quarantine
        return rotation_due(
            now,
            q.oldest(gen.gid),
            q.bytes_waiting_on(gen.gid),
            interval,
            self.config.quarantine_high_bytes,
            low_bytes=self.config.quarantine_low_bytes,
            small_interval=self.config.small_fence_interval if lane == YOUNG else 0.0,
        )

    def _next_wake(self) -> float:
        now = self._clock()
        waits: list[float] = [1.0]  # a slow heartbeat: expiry and retries never depend on a poke alone
        if not self.store.closing:
            for lane in LANES:
                due = self._due(lane, now)
                if due is not None and (self._spare is not None or due > 0):
                    waits.append(due)  # without a spare, its creation pokes us when ready
        sealed = self.nixl.gens.sealed()
        if sealed:
            if (
                any(self.nixl.members.get(g.gid) for g in sealed)
                and self.nixl.gens.active_in(TENURED) is None
                and self._spare is not None
            ):
                waits.append(0.0)  # objects wait to move and the tenured lane can open now
            nxt = self.store.reads.tickets.next_deadline()
            if nxt is not None:
                waits.append(max(0.0, nxt - now))
        return min(waits)

    async def _step(self) -> None:
        await self.store.reads.expire_leases()
        if not self.store.closing:
            for lane in LANES:
                if self._due(lane, self._clock()) == 0.0:
                    if self._spare is None:
                        self._want_spare()
                        break
                    await self._rotate(lane)
        for gen in self.nixl.gens.sealed():
            await self._drain(gen)

    async def _rotate(self, lane: str) -> None:
        spare, self._spare = self._spare, None
        assert spare is not None
        async with self.nixl.lock:
            self.nixl.add_generation(spare)
            old = self.nixl.gens.activate(spare.gid, self._clock(), lane)
        self.metrics.rotations.inc()
        log.debug("rotated %s NIXL agent %s -> %s", lane, old.name if old else None, spare.name)
        self._refill()
        if lane == YOUNG:
            self.nixl.rotated()

    async def _drain(self, gen: Generation) -> None:
        """Move a sealed agent's live objects out, deregister what no ticket reads, then destroy it."""
        tickets, nixl = self.store.reads.tickets, self.nixl
        await self._migrate(gen)
        reading = tickets.objects_reading(gen.gid)
        done = [oid for oid in gen.migrated if oid not in reading]
        if done:
            async with nixl.lock:
                gen.migrated.difference_update(done)
                await nixl.release_moved(gen.gid, done)
        if not nixl.members.get(gen.gid) and not tickets.inflight(gid=gen.gid):
            async with nixl.lock:  # freed regions parked here until the fence (registrations.py)
                await nixl.deregister_parked(gen.gid)
        if nixl.members.get(gen.gid) or nixl.ledger.count(gen.gid) or tickets.inflight(gid=gen.gid):
            return
        async with nixl.lock:
            nixl.retire_generation(gen.gid)
        await nixl.barrier()  # no control-thread call on this agent is left
        await self._destroy(gen)  # the fence: from here on every reader of this agent fails cleanly
        now = self._clock()
        for entry in nixl.quarantine.generation_retired(gen.gid):
            self.metrics.quarantine_seconds.observe(now - entry.since)
            entry.refs.clear()  # the memory may be reused now
        nixl.retired(gen.gid)

    async def _migrate(self, gen: Generation) -> None:
        """Register a sealed agent's live objects in the tenured agent, a chunk at a time."""
        members = self.nixl.members.get(gen.gid)
        while members:
            target = self.nixl.gens.active_in(TENURED)
            if target is None:
                if self._spare is None:
                    self._want_spare()
                    return
                spare, self._spare = self._spare, None
                async with self.nixl.lock:
                    self.nixl.add_generation(spare)
                    self.nixl.gens.activate(spare.gid, self._clock(), TENURED)
                self._refill()
                continue
            moved = await self._migrate_chunk(gen, target, members)
            if not moved:
                return  # what is left cannot move yet (being freed, or a region that needs a newer agent)
            await asyncio.sleep(0)  # let frees, puts and tickets in between chunks

    async def _migrate_chunk(self, gen: Generation, target: Generation, members: set[str]) -> int:
        """Ask the placement (nixl_state.py) to move the next chunk of live objects; return how many moved."""
        objects, nixl = self.store.objects, self.nixl
        async with nixl.lock:
            if nixl.gens.active_in(TENURED) is not target:
                return 0
            # An object being freed stays: its free releases it here.
            candidates = (objects[oid] for oid in list(members) if objects[oid].freeing is None)
            moved = await nixl.move(target, candidates, MIGRATION_CHUNK)
            self.metrics.migrations.inc(len(moved))
            gen.migrated.update(obj.object_id for obj in moved)
            return len(moved)
