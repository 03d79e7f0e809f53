"""What the reconciler did and now expects to see, so that a retry or a late event does not act twice.

Why a module of its own: these are facts about our own writes (a free done on the agent whose finalizer
is not removed yet; a status write held back), not about the cluster, so they live beside the ledger
and not in it, and they are forgotten the moment the watch confirms them (client-go's expectations,
KubeRay's habit).

A worker may still be acting on a record the watch has just reported gone, and note a write for it after
it was forgotten; so each table also forgets by age what can no longer matter (a stream's last write once
its interval is over, a held status write long past its due time): nothing of a gone record stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuobj_operator.model import Key

# Seconds past its due time after which a held status write that nobody asked for again is forgotten: its
# record went meanwhile (a held write is asked again when due, within the work queue's lag). Were the
# record still there, its next ask only waits one status delay more.
STALE_DUE = 30.0


@dataclass
class Expectations:
    freed: set[str] = field(default_factory=set)  # uids freed and awaiting their DELETED event
    # uid -> (the agent's answer, asked at, answered at): freed on the agent, its finalizer not removed
    # yet. A retry goes straight to the finalizer, and counts and reports the free that happened.
    agent_freed: dict[str, tuple[Any, float, float]] = field(default_factory=dict)
    # (kind, key) -> when it may be written; in the order asked, so by due time (one delay for all)
    status_due: dict[tuple[str, Key], float] = field(default_factory=dict)
    stream_written_at: dict[Key, float] = field(default_factory=dict)  # in the order written

    def object_gone(self, uid: str, key: Key) -> None:
        """The watch confirmed a GPUObject's deletion: nothing more is expected of it."""
        self.freed.discard(uid)
        self.agent_freed.pop(uid, None)
        self.status_due.pop(("object", key), None)

    def claim_gone(self, key: Key) -> None:
        self.status_due.pop(("claim", key), None)

    def stream_gone(self, key: Key) -> None:
        """The watch confirmed a stream's deletion: its counters are written no more."""
        self.stream_written_at.pop(key, None)

    def status_wait(self, kind: str, key: Key, urgent: bool, delay: float, now: float) -> float:
        """Seconds a routine status write must still wait (0: write now). The first ask starts the wait;
        an urgent write (Lost, Failed) or no delay goes at once. A held write is decided again when due."""
        _forget_before(self.status_due, now - STALE_DUE)
        if urgent or delay <= 0:
            self.status_due.pop((kind, key), None)
            return 0.0
        due = self.status_due.setdefault((kind, key), now + delay)
        if now < due:
            return due - now
        del self.status_due[(kind, key)]
        return 0.0

    def stream_wait(self, key: Key, interval: float, now: float) -> float:
        """Seconds before a stream's counters may be written again (0: now, and noted as written)."""
        _forget_before(self.stream_written_at, now - interval)
        wait = interval - (now - self.stream_written_at.get(key, float("-inf")))
        if wait > 0:
            return wait
        self.stream_written_at.pop(key, None)  # to the end: the table stays in the order written
        self.stream_written_at[key] = now
        return 0.0


def _forget_before(table: dict[Any, float], before: float) -> None:
    """Drop the entries from the front of a table kept in time order while they are older than ``before``:
    amortised O(1) per call, however many records went."""
    while table:
        first = next(iter(table))
        if table[first] > before:
            return
        del table[first]
