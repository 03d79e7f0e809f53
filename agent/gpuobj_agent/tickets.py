"""Read tickets: the source's record of which readers may be reading which object right now.

Why: a free must wait for in-flight reads, and memory of a freed object must stay intact
while any reader is inside its read. Our fetch path takes a ticket before it reads and
ends it after; a ticket that is never ended expires after its lease, so a crashed reader
can delay a free by at most one lease. An ended ticket reports whether it was still
valid: a reader whose ticket expired mid-read discards the bytes it got.

Plain Python with an injectable clock, so unit tests drive expiry without sleeping.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gpuobj_agent.registrations import RegionKey


@dataclass
class ReadTicket:
    read_id: str
    object_id: str
    gid: int
    keys: tuple[RegionKey, ...]
    nbytes: int
    reader: str
    issued_at: float
    deadline: float


@dataclass(frozen=True)
class EndResult:
    """`ended`: this call ended the ticket; `valid`: it ended within its lease (the bytes are good),
    now or earlier (a repeated end of a validly ended ticket is still valid)."""

    ended: bool
    valid: bool
    ticket: ReadTicket | None = None


class ReadTickets:
    """Live tickets indexed by object and by NIXL generation, with lease expiry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, tombstones: int = 4096) -> None:
        self._clock = clock
        self._live: dict[str, ReadTicket] = {}
        self._by_object: dict[str, set[str]] = {}
        self._by_gen: dict[int, set[str]] = {}
        self._heap: list[tuple[float, str]] = []
        # Recently finished tickets -> ended within the lease? So a repeated or late end gets the truth.
        self._done: OrderedDict[str, bool] = OrderedDict()
        self._tombstones = tombstones

    def issue(
        self, object_id: str, gid: int, keys: tuple[RegionKey, ...], nbytes: int, reader: str, lease: float
    ) -> ReadTicket:
        now = self._clock()
        ticket = ReadTicket(f"r-{secrets.token_hex(16)}", object_id, gid, keys, nbytes, reader, now, now + lease)
        self._live[ticket.read_id] = ticket
        self._by_object.setdefault(object_id, set()).add(ticket.read_id)
        self._by_gen.setdefault(gid, set()).add(ticket.read_id)
        heapq.heappush(self._heap, (ticket.deadline, ticket.read_id))
        return ticket

    def end(self, read_id: str) -> EndResult:
        """End a ticket (idempotent). Expired tickets end as invalid; unknown ids end nothing."""
        self.expire()
        ticket = self._live.get(read_id)
        if ticket is None:
            return EndResult(False, self._done.get(read_id, False))
        self._remove(ticket)
        self._remember(read_id, True)
        return EndResult(True, True, ticket)

    def _remember(self, read_id: str, valid: bool) -> None:
        self._done[read_id] = valid
        while len(self._done) > self._tombstones:
            self._done.popitem(last=False)

    def expire(self) -> list[ReadTicket]:
        """Drop tickets whose lease has passed; they no longer hold a free back."""
        now = self._clock()
        out: list[ReadTicket] = []
        while self._heap and self._heap[0][0] <= now:
            _, read_id = heapq.heappop(self._heap)
            ticket = self._live.get(read_id)
            if ticket is None:
                continue
            self._remove(ticket)
            self._remember(read_id, False)
            out.append(ticket)
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._live):
            self._heap = [(t.deadline, t.read_id) for t in self._live.values()]
            heapq.heapify(self._heap)
        return out

    def reader_of(self, read_id: str) -> str | None:
        """Who took a live ticket (None: unknown, ended or expired)."""
        ticket = self._live.get(read_id)
        return None if ticket is None else ticket.reader

    def was_expired(self, read_id: str) -> bool:
        return self._done.get(read_id) is False

    def _remove(self, ticket: ReadTicket) -> None:
        del self._live[ticket.read_id]
        _discard(self._by_object, ticket.object_id, ticket.read_id)
        _discard(self._by_gen, ticket.gid, ticket.read_id)

    def inflight(self, *, object_id: str | None = None, gid: int | None = None) -> int:
        """Live tickets of an object, of a generation, or all of them (expired ones dropped first)."""
        self.expire()
        if object_id is not None:
            return len(self._by_object.get(object_id, ()))
        if gid is not None:
            return len(self._by_gen.get(gid, ()))
        return len(self._live)

    def objects_reading(self, gid: int) -> set[str]:
        """Objects with a live ticket in generation `gid`."""
        self.expire()
        return {self._live[r].object_id for r in self._by_gen.get(gid, ())}

    def next_deadline(self) -> float | None:
        return min((t.deadline for t in self._live.values()), default=None)

    def live(self) -> list[ReadTicket]:
        self.expire()
        return list(self._live.values())


_Key = TypeVar("_Key", str, int)


def _discard(index: dict[_Key, set[str]], key: _Key, read_id: str) -> None:
    """Drop a ticket from one index, and the key with its last ticket (an index holds no empty sets)."""
    ids = index.get(key)
    if ids is not None:
        ids.discard(read_id)
        if not ids:
            del index[key]
