"""A de-duplicating work queue with per-item exclusivity and backoff (client-go's workqueue, in asyncio).

Why: events for one GPUObject arrive from three watches (objects, claims, pods);
a burst must collapse into one reconcile, and two workers must never act on the
same object at once. Items added `urgent` (a reference went: most likely a free) are
taken before the others, so frees never wait behind a backlog of status work.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)  # an item: a key to reconcile


class WorkQueue(Generic[T]):
    def __init__(self, base_delay: float = 0.05, max_delay: float = 30.0) -> None:
        self._tokens: asyncio.Queue[None] = asyncio.Queue()  # one per queued item, in either lane
        self._lanes: tuple[deque[T], deque[T]] = (deque(), deque())  # (urgent, normal)
        self._queued: set[T] = set()
        self._dirty_urgent: set[T] = set()
        self._processing: set[T] = set()
        self._dirty_while_processing: set[T] = set()
        self._failures: dict[T, int] = {}
        self._timers: dict[T, asyncio.TimerHandle] = {}
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._closed = False

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, item: T, urgent: bool = False) -> None:
        if self._closed:
            return
        if item in self._processing:
            self._dirty_while_processing.add(item)
            if urgent:
                self._dirty_urgent.add(item)
            return
        if item in self._queued:
            if urgent and item in self._lanes[1]:
                self._lanes[1].remove(item)  # promote: same token, the other lane
                self._lanes[0].append(item)
            return
        self._queued.add(item)
        self._lanes[0 if urgent else 1].append(item)
        self._tokens.put_nowait(None)

    def add_after(self, item: T, delay: float) -> None:
        """Add ``item`` after ``delay``; one already waiting keeps the sooner time (client-go's ``insert``)."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        waiting = self._timers.get(item)
        if waiting is not None:
            if waiting.when() <= loop.time() + delay:
                return  # the earlier timer stands: a later one must not delay a retry
            waiting.cancel()

        def fire() -> None:
            self._timers.pop(item, None)
            self.add(item)

        self._timers[item] = loop.call_later(delay, fire)

    def retry(self, item: T) -> float:
        """Requeue with exponential backoff; returns the delay chosen."""
        n = self._failures.get(item, 0)
        self._failures[item] = n + 1
        delay = min(self.base_delay * (2.0**n), self.max_delay)
        self.add_after(item, delay)
        return delay

    def forget(self, item: T) -> None:
        """The item succeeded: its next failure starts the backoff afresh."""
        self._failures.pop(item, None)

    async def get(self) -> T:
        await self._tokens.get()
        urgent, normal = self._lanes
        item = urgent.popleft() if urgent else normal.popleft()
        self._queued.discard(item)
        self._processing.add(item)
        return item

    def done(self, item: T) -> None:
        self._processing.discard(item)
        if item in self._dirty_while_processing:
            self._dirty_while_processing.discard(item)
            urgent = item in self._dirty_urgent
            self._dirty_urgent.discard(item)
            self.add(item, urgent)

    def close(self) -> None:
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def idle(self) -> bool:
        return not self._queued and not self._processing
