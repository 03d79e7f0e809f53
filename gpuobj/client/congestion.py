"""How many write families one process sends to the API server at once: fewer while it throttles.

Why: every pod's write-behind sends up to ``ceiling`` families concurrently. A fleet of 200 pods at 16
each keeps 3,200 requests in flight against an API server whose default mutating in-flight limit is
200; it answers 429 (priority and fairness, max in-flight), each pod retries all of them, and the
queue never drains faster. No client can bound the fleet as a whole, but each can back off the way TCP
does (additive increase, multiplicative decrease): halve its own limit when the API server throttles
(a 429, even one the kube client retried after its Retry-After; a timeout; a 5xx), at most once per
``calm`` seconds so that one burst of answers counts once, and grow it back by one per round of
writes that landed unthrottled.

Three more rules make a fleet of many pods back off before the API server refuses (docs/write-behind.md,
"Congestion"):

- **Slow start.** The limit starts at ``initial`` (the write-behind: 1) and grows by one per write that
  landed unthrottled (doubling per round) until the first cut, as TCP does: 1,000 pods starting at once
  begin with 1,000 requests in flight, not 16,000.
- **Latency is a signal.** A write whose answer took longer than ``slow`` seconds counts as throttled:
  the API server's priority-and-fairness queues hold a request before they refuse it, so a rising write
  latency is the refusal that is coming (TCP Vegas' idea; ``slow`` defaults to half of the 1 s mutating
  p99 the API server's SLO allows).
- **Below one in flight.** The limit may fall under one (to ``floor``, 1/32 by default): then one write is
  in flight at a time and the next starts ``gap`` seconds after the last began: the last write's latency
  times (1 / size - 1), at most ``max_gap``, so a pod at size s has a write in flight a fraction s of the
  time. The last latency, not a smoothed one: a paced pod writes seldom, and a smoothed latency would keep
  a burst's seconds long after the queue drained. With 1,000 pods at 1/32 each and an API server that
  writes 100 objects a second, the fleet offers about 1,000 / (32 x latency) a second: it settles where
  latency is ~0.3 s. Each unthrottled write doubles the size (a few answers lift the pacing).

The decisions are pure (``observe``, ``limit``, ``gap``, ``hold``); ``acquire``/``release`` only wait.
A Retry-After the kube client waited out is honoured there, per request; ``hold`` lets a caller who
read one keep every new write of the process back as long.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

SLOW_WRITE_S = 0.5  # a write answered later than this says the API server queues (half its 1 s p99 SLO)


def jittered(delay: float, draw: Callable[[], float] = random.random) -> float:
    """A retry delay spread over [delay/2, delay] ("equal jitter").

    Why: pods that failed together (an API server restart, one 429 burst) would otherwise retry together,
    every doubling step in lockstep, and hit the recovering server as one wave. Half the delay stays
    fixed, so the backoff still grows; the other half is drawn per pod and per retry."""
    return delay * (0.5 + 0.5 * draw())


class InFlightLimit:
    """A semaphore whose size follows the API server's answers, between ``floor`` and ``ceiling``; under
    one it paces the writes (``gap``)."""

    def __init__(
        self,
        ceiling: int,
        *,
        floor: float = 1 / 32,
        max_gap: float = 10.0,
        initial: float | None = None,
        calm: float = 1.0,
        slow: float | None = SLOW_WRITE_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not 0 < floor <= ceiling:
            raise ValueError(f"in-flight limit: need 0 < floor ({floor}) <= ceiling ({ceiling})")
        self.ceiling = ceiling
        self.floor = floor
        self.calm = calm
        self.slow = slow
        self.clock = clock
        self.sleep = sleep
        # grows by one per unthrottled write while slow-starting, then by 1/size: by one per round
        self.size = float(ceiling if initial is None else min(max(initial, floor), ceiling))
        self.slow_start = initial is not None and self.size < ceiling
        self.max_gap = max_gap
        self.latency = 0.0  # the last write's seconds
        self.in_flight = 0
        self.cuts = 0  # how often the API server's throttling halved it (the client's stats)
        self.slow_writes = 0  # answers later than ``slow`` (the client's stats)
        self._cut_at = float("-inf")
        self._next_at = float("-inf")  # no write starts before this (pacing under one, or a hold)
        self._room = asyncio.Event()

    @property
    def limit(self) -> int:
        """Writes allowed in flight at once: never under one (under one, ``gap`` paces them)."""
        return max(1, int(self.size))

    @property
    def gap(self) -> float:
        """Seconds from one write's start to the next's while the size is under one, else 0."""
        if self.size >= 1:
            return 0.0
        return min(self.max_gap, self.latency * (1 / self.size - 1))

    def observe(self, throttled: bool, latency: float | None = None) -> None:
        """One write's answer: throttled (429, timeout, 5xx) or not, and how long it took (seconds)."""
        if latency is not None:
            self.latency = latency
            if self.slow is not None and latency > self.slow and not throttled:
                self.slow_writes += 1
                throttled = True
        if throttled:
            now = self.clock()
            if now - self._cut_at >= self.calm and self.size > self.floor:
                self._cut_at = now
                self.size = max(self.floor, self.size / 2)
                self.slow_start = False
                self.cuts += 1
        elif self.size < self.ceiling:
            if self.size < 1:
                self.size = min(1.0, self.size * 2)
            else:
                self.size = min(float(self.ceiling), self.size + (1 if self.slow_start else 1 / self.size))
            self._wake()

    def hold(self, seconds: float) -> None:
        """Start no write for ``seconds`` (a Retry-After the caller read): every family of this process waits."""
        self._next_at = max(self._next_at, self.clock() + seconds)

    async def acquire(self) -> None:
        while True:
            while self.in_flight >= self.limit:
                self._room.clear()
                await self._room.wait()
            wait = self._next_at - self.clock()
            if wait <= 0:
                break
            await self.sleep(wait)
        self.in_flight += 1
        if self.gap > 0:
            self._next_at = max(self._next_at, self.clock() + self.gap)

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        if self.in_flight < self.limit:
            self._room.set()


BURST_S = 1.0  # a pod may send this many seconds of its share at once (one write at least)


class FleetPace:
    """Paces one process's API writes at its share of a cluster-wide budget the operator tells its agent.

    Why: each pod's own back-off (``InFlightLimit``) reacts to answers, and 1,000 pods that start writing
    in the same second send 1,000 writes before any answer comes back; the API server queues them for
    seconds. Only a budget the fleet shares spreads them: the operator divides a cluster budget (writes a
    second, a chart value) by the agents it probes, and tells each its share on every probe
    (docs/write-behind.md, "A budget the fleet shares").

    The schedule is a virtual clock, as the generic cell rate algorithm keeps one: ``_next`` is when the
    next write is due; each write moves it on by ``1 / rate``. A write may run ``tolerance`` early (a
    second's worth of the share, less one write), so a pod with a large share bursts; a pod whose share
    is under one write a second gets no burst at all. A pod that has been idle starts its next write at
    a random phase in one interval: pods that a barrier lets go together (a ramp, a job's next step) come
    back spread over the interval, not at once. A family's first write waits for its slot and the rest
    of it goes at once (``charge``): the family lands as one change. Without a told rate (None or 0)
    nothing waits.
    """

    def __init__(
        self,
        rate: Callable[[], float | None],
        *,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.rate = rate
        self.clock = clock
        self.draw = draw
        self._next = float("-inf")  # when the next write is due (the virtual clock)
        self._interval = 0.0  # 1 / the rate the schedule was made at
        self.waits = 0  # writes that waited for their slot (the client's stats)
        self.waited_s = 0.0  # seconds they waited in all

    def _told(self) -> tuple[float, float] | None:
        """(now, the interval at the share told now), or None without a share. A new share moves a slot
        planned at a slower rate forward: it must not hold the next write at the new one."""
        rate = self.rate()
        if not rate or rate <= 0:
            return None
        now, interval = self.clock(), 1.0 / rate
        if interval != self._interval:
            self._next = min(self._next, now + interval)
            self._interval = interval
        return now, interval

    def reserve(self) -> float:
        """Take the next slot: the seconds until it (0: now). Pure but for the clock and the draw."""
        told = self._told()
        if told is None:
            return 0.0
        now, interval = told
        if self._next < now:  # idle: start again at a random phase within one interval
            self._next = now + self.draw() * interval
        tolerance = max(0.0, BURST_S - interval)
        start = max(now, self._next - tolerance)
        if start - now < 1e-6:  # a rounding error of the virtual clock is no wait
            start = now
        self._next += interval
        if start > now:
            self.waits += 1
            self.waited_s += start - now
        return start - now

    def charge(self) -> None:
        """A write sent without waiting for a slot of its own (the rest of a family whose first write had
        one): the schedule moves on by one interval all the same, so the writes that come next wait for it.
        Why: a family's create, claim and the owner's delete sent one interval apart would each land as
        a change of their own, and the operator would write a status for each; together they settle once."""
        told = self._told()
        if told is not None:
            now, interval = told
            self._next = max(self._next, now) + interval

    def give_back(self, unspent: float) -> None:
        """A write that waited for its slot will not be sent (it was taken back, ``unspent`` seconds before
        its slot): the schedule moves back by one interval. A write that reserved after it keeps its slot,
        so the next one may come within an interval of it: the pod overshoots its share by at most the
        writes it took back, and only while it has a backlog."""
        if self._interval and unspent > 0:
            self._next -= self._interval
            self.waits -= 1
            self.waited_s -= unspent
