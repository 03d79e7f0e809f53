"""Quarantine: freed tensors whose keys a reader may still hold, kept until their fence is up.

Why: with NIXL over UCX a read of memory that was freed kills the source process (tcp)
or breaks the reader's connection (cma), and a read of memory that was reused returns
someone else's bytes. A freed object whose regions were handed to a reader therefore
keeps its memory until every NIXL agent that exposed them is destroyed; from then on a
stale read fails cleanly. The hold is bounded (fencing.py rotates agents on a timer and
tickets expire), and its bytes and durations are exported as metrics.
Objects no reader ever saw skip quarantine entirely. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuarantineEntry:
    object_id: str
    nbytes: int
    refs: list[Any]  # the tensors: holding them is what keeps the memory from being reused
    since: float
    waiting: set[int] = field(default_factory=set)  # generations that must retire first


class Quarantine:
    """Entries by generation they wait on."""

    def __init__(self) -> None:
        self._by_gen: dict[int, list[QuarantineEntry]] = {}
        self.bytes = 0
        self.count = 0

    def add(self, object_id: str, nbytes: int, refs: list[Any], gens: set[int], now: float) -> QuarantineEntry:
        entry = QuarantineEntry(object_id, nbytes, refs, now, set(gens))
        for gid in gens:
            self._by_gen.setdefault(gid, []).append(entry)
        self.bytes += nbytes
        self.count += 1
        return entry

    def waiting_on(self, gid: int) -> list[QuarantineEntry]:
        return list(self._by_gen.get(gid, ()))

    def oldest(self, gid: int) -> float | None:
        return min((e.since for e in self._by_gen.get(gid, ())), default=None)

    def bytes_waiting_on(self, gid: int) -> int:
        return sum(e.nbytes for e in self._by_gen.get(gid, ()))

    def generation_retired(self, gid: int) -> list[QuarantineEntry]:
        """`gid` is fenced: return the entries that wait for nothing else (their memory may go)."""
        released = []
        for entry in self._by_gen.pop(gid, []):
            entry.waiting.discard(gid)
            if not entry.waiting:
                self.bytes -= entry.nbytes
                self.count -= 1
                released.append(entry)
        return released

    def drain(self) -> list[QuarantineEntry]:
        """Everything, at shutdown (after every agent is destroyed)."""
        out: dict[int, QuarantineEntry] = {}
        for entries in self._by_gen.values():
            for e in entries:
                out[id(e)] = e
        self._by_gen.clear()
        self.bytes = 0
        self.count = 0
        return list(out.values())
