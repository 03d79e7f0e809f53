"""A de-duplicating work queue with per-item exclusivity and backoff (client-go's workqueue, in asyncio).

Why: events for one GPUObject arrive from three watches (objects, claims, pods);
a burst must collapse into one reconcile, and two workers must never act on the
same object at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class WorkQueue:
    def __init__(self, base_delay: float = 0.05, max_delay: float = 30.0) -> None:
        self._queue: asyncio.Queue[Hashable] = asyncio.Queue()
        self._queued: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._dirty_while_processing: set[Hashable] = set()
        self._failures: dict[Hashable, int] = {}
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._closed = False

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, item: Hashable) -> None:
        if self._closed:
            return
        if item in self._processing:
            self._dirty_while_processing.add(item)
            return
        if item in self._queued:
            return
        self._queued.add(item)
        self._queue.put_nowait(item)

    def add_after(self, item: Hashable, delay: float) -> None:
        if self._closed or item in self._timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(item, None)
            self.add(item)

        self._timers[item] = loop.call_later(delay, fire)

    def retry(self, item: Hashable) -> float:
        """Requeue with exponential backoff; returns the delay chosen."""
        n = self._failures.get(item, 0)
        self._failures[item] = n + 1
        delay = min(self.base_delay * (2**n), self.max_delay)
        self.add_after(item, delay)
        return delay

    def forget(self, item: Hashable) -> None:
        """The item succeeded: its next failure starts the backoff afresh."""
        self._failures.pop(item, None)

    async def get(self) -> Hashable:
        item = await self._queue.get()
        self._queued.discard(item)
        self._processing.add(item)
        return item

    def done(self, item: Hashable) -> None:
        self._processing.discard(item)
        if item in self._dirty_while_processing:
            self._dirty_while_processing.discard(item)
            self.add(item)

    def close(self) -> None:
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def idle(self) -> bool:
        return not self._queued and not self._processing
