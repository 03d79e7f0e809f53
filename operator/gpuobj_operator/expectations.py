"""What the reconciler did and now expects to see, so that a retry or a late event does not act twice.

Why a module of its own: these are facts about our own writes (a free done on the agent whose finalizer
is not removed yet; a status write held back), not about the cluster, so they live beside the ledger
and not in it, and they are forgotten the moment the watch confirms them (client-go's expectations,
KubeRay's habit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuobj_operator.model import Key


@dataclass
class Expectations:
    freed: set[str] = field(default_factory=set)  # uids freed and awaiting their DELETED event
    # uid -> (the agent's answer, asked at, answered at): freed on the agent, its finalizer not removed
    # yet. A retry goes straight to the finalizer, and counts and reports the free that happened.
    agent_freed: dict[str, tuple[Any, float, float]] = field(default_factory=dict)
    status_due: dict[tuple[str, Key], float] = field(default_factory=dict)  # (kind, key) -> when it may be written
    stream_written_at: dict[Key, float] = field(default_factory=dict)

    def object_gone(self, uid: str, key: Key) -> None:
        """The watch confirmed a GPUObject's deletion: nothing more is expected of it."""
        self.freed.discard(uid)
        self.agent_freed.pop(uid, None)
        self.status_due.pop(("object", key), None)

    def claim_gone(self, key: Key) -> None:
        self.status_due.pop(("claim", key), None)

    def status_wait(self, kind: str, key: Key, urgent: bool, delay: float, now: float) -> float:
        """Seconds a routine status write must still wait (0: write now). The first ask starts the wait;
        an urgent write (Lost, Failed) or no delay goes at once. A held write is decided again when due."""
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
        wait = interval - (now - self.stream_written_at.get(key, float("-inf")))
        if wait > 0:
            return wait
        self.stream_written_at[key] = now
        return 0.0
