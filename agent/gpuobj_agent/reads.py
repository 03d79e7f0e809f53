"""The read side of the store: read tickets, grants, read ends and lease expiry.

Why apart from the store: a read changes no object and no NIXL registration. It hands a reader the
keys of what the store placed (and marks them exposed, so a free quarantines the memory until the
fence) and keeps the ticket a free waits for. The store writes objects and their placement; this
module only reads them, through a mapping of the store's records (objects.StoredObject) and the
shared NIXL state, and the store asks it one question back: may this object go now (`wait_tickets`).
Every answer is the contract's typed shape (gpuobj_contract.agent_api); the routes serialise it.

Like the store, everything here runs on the agent's event loop; NIXL calls go to the control thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from gpuobj_agent.config import AgentConfig
from gpuobj_agent.errors import NotReady, ObjectNotFound
from gpuobj_agent.metrics import AgentMetrics
from gpuobj_agent.nixl_state import NixlState
from gpuobj_agent.nixl_transport import NixlAgent, Span
from gpuobj_agent.objects import StoredObject, describe_in
from gpuobj_agent.tickets import EndResult, ReadTickets
from gpuobj_contract import agent_api as api

log = logging.getLogger(__name__)

# A reader attaches this + readId to its READ; NIXL hands it to us once the data was read.
READ_END_PREFIX = api.READ_END_NOTIF_PREFIX.encode()
NOTIFY_POLL_SECONDS = 0.001


def _read_spans(spans: Sequence[Span | None]) -> tuple[api.ReadSpan | None, ...]:
    return tuple(None if s is None else api.ReadSpan(s.mem, s.dev, s.addr, s.nbytes) for s in spans)


class Reads:
    """Who may be reading which object, and everything a reader is handed."""

    def __init__(
        self,
        objects: Mapping[str, StoredObject],
        nixl: NixlState,
        config: AgentConfig,
        metrics: AgentMetrics,
        *,
        incarnation: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._objects = objects  # the store's records, read here and never changed but for their description
        self.nixl = nixl
        self.config = config
        self.metrics = metrics
        self.incarnation = incarnation
        self._clock = clock
        self.tickets = ReadTickets(clock)
        self.changed = asyncio.Condition()  # notified on every ticket end and lease expiry
        self._issued = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None

    # -- tickets and grants ----------------------------------------------------------------
    async def described(self, object_id: str) -> StoredObject:
        """The live object, with its description current for the NIXL agent that now holds it."""
        for _ in range(8):
            obj = self._objects.get(object_id)
            if obj is None or obj.freeing is not None:
                raise ObjectNotFound(object_id)
            gid = obj.gid
            if obj.described_gid != gid or obj.description is None:
                # First read since the object moved to another NIXL agent: describe it there.
                agent = self.nixl.gens.get(gid).agent
                description = await self.nixl.control(describe_in, agent, obj.keys, obj.spans)
                if self._objects.get(object_id) is not obj or obj.freeing is not None or obj.gid != gid:
                    continue  # freed or moved meanwhile: look again
                obj.description, obj.described_gid = description, gid
            return obj
        raise NotReady(f"object {object_id} keeps moving between NIXL agents; retry")

    async def begin_read(self, object_id: str, reader: str) -> api.ReadTicket:
        """Issue a read ticket: everything a reader needs, and a lease the free will respect."""
        obj = await self.described(object_id)
        lease = round(self.config.lease_for(obj.nbytes), 3)
        ticket = self.tickets.issue(obj.object_id, obj.gid, tuple(obj.keys), obj.nbytes, reader, lease)
        answer = self._hand_over(obj, "issued", read_id=ticket.read_id, lease_seconds=lease)
        self._issued.set()
        return answer

    async def grant(self, object_id: str) -> api.ReadTicket:
        """A read grant: what a reader holding a live claim needs to read this object with no request here.

        Exactly this object's spans and the NIXL partial metadata of its own registration, under
        the source incarnation and generation. No ticket and no lease: the reader's live claim keeps
        the bytes (the operator frees only once no claim is left, and the client releases a claim
        only after its reads ended). The keys count as exposed, so a free quarantines the memory
        until the generation is fenced, and a reader still holding the grant after a move or a
        free fails cleanly on the retired NIXL agent and falls back to a ticket.
        """
        obj = await self.described(object_id)
        return self._hand_over(obj, "granted", generation=obj.gid)

    def _hand_over(
        self,
        obj: StoredObject,
        result: str,
        *,
        read_id: str = "",
        lease_seconds: float = 0.0,
        generation: int | None = None,
    ) -> api.ReadTicket:
        """A ticket or grant of a described object; its keys now count as exposed."""
        gen = self.nixl.gens.get(obj.gid)
        assert obj.description is not None
        metadata, descriptors, whole = obj.description
        self.nixl.ledger.expose(obj.gid, self.nixl.ledger.keys_in(obj.gid) if whole else obj.keys)
        self.metrics.tickets.labels(result=result).inc()
        next_agent, next_metadata = self._announce(obj)
        return api.ReadTicket(
            read_id=read_id,
            nixl_agent=gen.name,
            agent_metadata=metadata or "",
            descriptors=descriptors,
            spans=_read_spans(obj.spans),
            tensors=tuple(obj.layouts),
            nbytes=obj.nbytes,
            lease_seconds=lease_seconds,
            live_agents=tuple(self.nixl.gens.live_names()),
            incarnation=self.incarnation,
            generation=generation,
            next_agent=next_agent,
            next_agent_metadata=next_metadata,
        )

    def _announce(self, obj: StoredObject) -> tuple[str | None, str]:
        """For a pooled object's reader: the spare agent the next version will most likely be registered in,
        with its connection info alone (it names no region: nothing can be read through it until a grant or
        ticket of that version hands over the region's key). Nothing when no spare is ready."""
        if obj.on_release is None:
            return None, ""
        spare = self.nixl.next_private()
        if spare is None or not spare.announce:
            return None, ""
        return spare.name, spare.announce

    def read_taken_by(self, read_id: str) -> str | None:
        """Who took a live read ticket (the server lets only that pod end it)."""
        return self.tickets.reader_of(read_id)

    async def end_read(self, read_id: str) -> api.ReadEndAnswer:
        expired = self._expire()
        result = self._end(read_id)
        if result.ended or expired:
            await self._tickets_changed()
        return api.ReadEndAnswer(result.ended, result.valid, self.tickets.was_expired(read_id))

    def _end(self, read_id: str) -> EndResult:
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
                notes: list[bytes] = await self.nixl.control(self._poll, [g.agent for g in self.nixl.gens.live()])
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

    # -- lease expiry ----------------------------------------------------------------------
    def _expire(self) -> int:
        expired = self.tickets.expire()
        if expired:
            self.metrics.tickets.labels(result="expired").inc(len(expired))
        return len(expired)

    async def _tickets_changed(self) -> None:
        async with self.changed:
            self.changed.notify_all()
        self.nixl.poke()

    async def expire_leases(self) -> None:
        """End the tickets whose lease ran out, and wake whoever waits on tickets (the fencer's heartbeat)."""
        if self._expire():
            await self._tickets_changed()

    async def wait_tickets(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds, re-checking on every ticket end and lease expiry."""
        deadline = self._clock() + timeout
        async with self.changed:
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
                        await self.changed.wait()
