"""The write-behind's congestion controller, decision by decision (pure: a fake clock, a recorded sleep).

The write-behind's own tests (test_writebehind.py) drive it through a throttling API server; these pin
the rules that let a fleet back off before the API server refuses: slow start, latency as a signal,
pacing under one write in flight, and a hold."""

from __future__ import annotations

import asyncio

from gpuobj.client.congestion import InFlightLimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def limit(ceiling: int = 16, **kw) -> tuple[InFlightLimit, Clock]:
    clock = Clock()
    return InFlightLimit(ceiling, clock=clock, sleep=clock.sleep, **kw), clock


def test_slow_start_doubles_per_round_until_the_first_cut_then_grows_by_one_per_round() -> None:
    lim, _ = limit(initial=2)
    assert lim.limit == 2
    for _ in range(2):
        lim.observe(False, 0.01)
    assert lim.limit == 4
    for _ in range(4):
        lim.observe(False, 0.01)
    assert lim.limit == 8
    lim.observe(True)
    assert lim.limit == 4 and not lim.slow_start
    for _ in range(5):  # a round at 4 (each write adds 1/size): one more
        lim.observe(False, 0.01)
    assert lim.limit == 5


def test_a_slow_answer_cuts_like_a_refusal_before_any_refusal_comes() -> None:
    lim, _ = limit()
    lim.observe(False, 0.4)  # under the 0.5 s threshold: an answer like any other
    assert lim.limit == 16 and lim.slow_writes == 0
    lim.observe(False, 0.8)  # the API server's queues are filling
    assert lim.limit == 8 and lim.cuts == 1 and lim.slow_writes == 1
    lim.observe(False, 0.9)  # the same burst (within calm): one cut
    assert lim.limit == 8
    unaware, _ = limit(slow=None)
    unaware.observe(False, 5.0)
    assert unaware.limit == 16


def test_under_one_the_writes_go_one_at_a_time_with_a_gap_of_latency_times_the_inverse_less_one() -> None:
    lim, clock = limit(ceiling=4)
    lim.observe(False, 0.2)
    for _ in range(4):
        clock.now += 1.0
        lim.observe(True)
    assert lim.size == 0.25 and lim.limit == 1  # 4, 2, 1, 0.5, 0.25
    assert abs(lim.gap - 0.2 * 3) < 1e-9  # the last write took 0.2 s: in flight a quarter of the time
    for _ in range(10):
        clock.now += 1.0
        lim.observe(True)
    assert lim.size == 1 / 32  # the floor
    lim.observe(False, 0.05)  # an unthrottled write doubles it; the gap follows the last latency
    assert lim.size == 1 / 16 and abs(lim.gap - 0.05 * 15) < 1e-9
    for _ in range(4):
        lim.observe(False)
    assert lim.size == 1 and lim.gap == 0.0


def test_the_gap_is_at_most_max_gap() -> None:
    lim, clock = limit(ceiling=2)
    lim.observe(False, 3.0)  # a queued answer: 3 s (and a cut)
    for _ in range(3):
        clock.now += 1.0
        lim.observe(True)
    assert lim.size == 0.125 and lim.gap == 10.0  # 3 s x 7 = 21 s, held to 10


def test_acquire_waits_the_gap_between_starts_and_a_hold_keeps_every_start_back() -> None:
    async def go() -> None:
        lim, clock = limit(ceiling=4)
        lim.observe(False, 0.1)
        for _ in range(3):
            clock.now += 1.0
            lim.observe(True)
        assert lim.size == 0.5 and abs(lim.gap - 0.1) < 1e-9
        await lim.acquire()
        lim.release()
        start = clock.now
        await lim.acquire()  # the second start waits the gap
        assert abs(clock.now - start - 0.1) < 1e-9
        lim.release()
        lim.hold(3.0)
        start = clock.now
        await lim.acquire()
        assert clock.now - start >= 3.0 - 1e-9
        lim.release()

    asyncio.run(go())


def test_the_floor_must_be_positive_and_at_most_the_ceiling() -> None:
    for floor in (0, 17):
        try:
            InFlightLimit(16, floor=floor)
        except ValueError:
            continue
        raise AssertionError(f"floor {floor} accepted")
