"""How a free re-checks the object's claims before the bytes go: the plan, and what counts as live.

Why: the ledger decides a free from two watches that may disagree for a moment (the object's
deletion can arrive before a claim made just before it). The invariant: every claim created
before the deletion is seen before anything is freed. Three ways to see them, cheapest first:

- ``LEDGER``: the claims watch, applied to the ledger strictly in the order the API server sent
  it (one stream, in resourceVersion order), has passed the version the decision saw. Every
  claim that existed then is in the ledger (or was deleted since). No request at all.
- ``MARKER``: the same, once a write to the operator's own progress marker claim moved the watch
  past that version (progress_marker.py): what a free pays when no claim event follows the deletion.
- ``EXACT``: read the claims *at exactly* that version. The API server answers from etcd or a
  snapshot at once; a "not older than" read instead waits (40-100 ms) for its watch cache to
  learn, from an etcd progress notification, that it has caught up.
- ``LATEST``: a consistent read (no version known, or the exact one was compacted away).

resourceVersions are etcd revisions: one counter for every kind, so a claims version can be
compared with an object's. One that does not parse as an integer is never trusted as passed.
"""

from __future__ import annotations

import asyncio
import enum
import statistics
from collections import deque
from collections.abc import Iterable

from gpuobj_operator.model import ClaimInfo


class Plan(enum.Enum):
    LEDGER = "ledger"
    MARKER = "marker"  # the watch passed once the operator wrote its progress marker (progress_marker.py)
    EXACT = "exact"
    LATEST = "latest"

    @property
    def counted(self) -> str:
        """The label of gpuobj_claims_checks_total: ledger, marker, or read."""
        return "read" if self in (Plan.EXACT, Plan.LATEST) else self.value


def parse_revision(rv: str | None) -> int | None:
    if not rv:
        return None
    try:
        return int(rv)
    except ValueError:
        return None


class Watermark:
    """The highest resourceVersion up to which one in-order watch has been applied.

    Only a stream whose events are handled one by one, in the order they arrive, may move it
    (our Informer). Never moves back: a restarted watch resumes from a list at a newer version.
    """

    def __init__(self) -> None:
        self.revision: int | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def observe(self, rv: str | None) -> None:
        """Call after the event (or the whole list) at ``rv`` was applied; bookmarks count too."""
        revision = parse_revision(rv)
        if revision is not None and (self.revision is None or revision > self.revision):
            self.revision = revision
            if self._waiters:
                waiting = []
                for at, future in self._waiters:
                    if future.done():
                        continue  # abandoned
                    if at <= revision:
                        future.set_result(None)
                    else:
                        waiting.append((at, future))
                self._waiters = waiting

    def reached(self, rv: str) -> asyncio.Future[None]:
        """A future done once everything up to ``rv`` was applied (cancel it to stop waiting)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        revision = parse_revision(rv)
        if revision is None:
            return future  # never: an unparsable version is never trusted
        if self.revision is not None and self.revision >= revision:
            future.set_result(None)
        else:
            self._waiters.append((revision, future))
        return future

    def passed(self, rv: str | None) -> bool:
        """Whether everything up to and including ``rv`` has been applied."""
        revision = parse_revision(rv)
        return revision is not None and self.revision is not None and self.revision >= revision


class ReadDelay:
    """How long a free waits for the claims watch before it also reads: worth it only while reads are
    slow (an API server with a claims watch cache makes them wait 40-100 ms; the wait then saves a read
    whenever claims change). Once recent reads answer fast (no such cache), reading at once is cheaper."""

    def __init__(self, configured: float, *, fast: float = 0.010, window: int = 16, least: int = 4) -> None:
        self.configured = configured
        self.fast = fast
        self.least = least
        self._reads: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        """A read of claims that completed, and how long it took."""
        self._reads.append(seconds)

    @property
    def seconds(self) -> float:
        if len(self._reads) >= self.least and statistics.median(self._reads) < self.fast:
            return 0.0
        return self.configured


def plan(seen_rv: str | None, claims_watermark: Watermark | None) -> Plan:
    """How to re-check the claims of an object the ledger saw at ``seen_rv`` before freeing it."""
    if parse_revision(seen_rv) is None:
        return Plan.LATEST
    if claims_watermark is not None and claims_watermark.passed(seen_rv):
        return Plan.LEDGER
    return Plan.EXACT


def blocking(read: Iterable[ClaimInfo], object_uid: str, claims_watermark: Watermark | None) -> list[ClaimInfo]:
    """Claims from a read that stop a free: holding the object at a version the in-order claims watch
    has not applied yet. Those it has applied the ledger already weighed (it may know of their deletion
    since, which a read at an older version still shows); the others it will learn of, and decide again.
    The read never feeds the ledger: a claim learned that way and deleted meanwhile would hold forever.
    """
    return [
        c
        for c in holding(read, object_uid)
        if claims_watermark is None or not claims_watermark.passed(c.resource_version)
    ]


def holding(claims: Iterable[ClaimInfo], object_uid: str) -> list[ClaimInfo]:
    """Claims that still hold this incarnation of the object, read conservatively: any claim not
    being deleted and not pinned to another incarnation (the ledger's finer filters, such as who may
    share, decide statuses; they never let a free through)."""
    return [c for c in claims if not c.deleting and (not c.object_uid or c.object_uid == object_uid)]
