"""How many write families one process sends to the API server at once: fewer while it throttles.

Why: every pod's write-behind sends up to ``ceiling`` families concurrently. A fleet of 200 pods at 16
each keeps 3,200 requests in flight against an API server whose default mutating in-flight limit is
200; it answers 429 (priority and fairness, max in-flight), each pod retries all of them, and the
queue never drains faster. No client can bound the fleet as a whole, but each can back off the way TCP
does (additive increase, multiplicative decrease): halve its own limit when the API server throttles
(a 429, even one the kube client retried after its Retry-After; a timeout; a 5xx), at most once per
``calm`` seconds so that one burst of answers counts once, and grow it back by one per round of
writes that landed unthrottled. The decisions are pure; ``acquire``/``release`` only wait for room.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable


def jittered(delay: float, draw: Callable[[], float] = random.random) -> float:
    """A retry delay spread over [delay/2, delay] ("equal jitter").

    Why: pods that failed together (an API server restart, one 429 burst) would otherwise retry together,
    every doubling step in lockstep, and hit the recovering server as one wave. Half the delay stays
    fixed, so the backoff still grows; the other half is drawn per pod and per retry."""
    return delay * (0.5 + 0.5 * draw())


class InFlightLimit:
    """A semaphore whose size follows the API server's answers, between ``floor`` and ``ceiling``."""

    def __init__(
        self, ceiling: int, *, floor: int = 1, calm: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"in-flight limit: need 1 <= floor ({floor}) <= ceiling ({ceiling})")
        self.ceiling = ceiling
        self.floor = floor
        self.calm = calm
        self.clock = clock
        self.size = float(ceiling)  # grows by 1/size per unthrottled write: by one per round of them
        self.in_flight = 0
        self.cuts = 0  # how often the API server's throttling halved it (the client's stats)
        self._cut_at = float("-inf")
        self._room = asyncio.Event()

    @property
    def limit(self) -> int:
        return max(self.floor, int(self.size))

    def observe(self, throttled: bool) -> None:
        """One write's answer: throttled (429, timeout, 5xx) or not."""
        if throttled:
            now = self.clock()
            if now - self._cut_at >= self.calm and self.size > self.floor:
                self._cut_at = now
                self.size = max(float(self.floor), self.size / 2)
                self.cuts += 1
        elif self.size < self.ceiling:
            self.size = min(float(self.ceiling), self.size + 1 / self.size)
            self._wake()

    async def acquire(self) -> None:
        while self.in_flight >= self.limit:
            self._room.clear()
            await self._room.wait()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        if self.in_flight < self.limit:
            self._room.set()
