"""The write-behind's congestion controller, decision by decision (pure: a fake clock, a recorded sleep).

The write-behind's own tests (test_writebehind.py) drive it through a throttling API server; these pin
the rules that let a fleet back off before the API server refuses: slow start, latency as a signal,
pacing under one write in flight, and a hold."""

from __future__ import annotations

import asyncio

import pytest

from gpuobj.client.congestion import FleetPace, InFlightLimit


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


# ---------------------------------------------------------------- the fleet's budget (FleetPace)


class Draw:
    """The random phase, scripted."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def pace(rate: float | None, *draws: float) -> tuple[FleetPace, Clock, list[float | None]]:
    clock, told = Clock(), [rate]
    return FleetPace(lambda: told[0], clock=clock, draw=Draw(*draws)), clock, told


def test_without_a_told_rate_no_write_waits() -> None:
    for rate in (None, 0.0):
        p, _, _ = pace(rate)
        assert [p.reserve() for _ in range(100)] == [0.0] * 100
        assert p.waits == 0


def test_a_small_share_spaces_every_write_one_interval_apart_from_a_random_first_phase() -> None:
    p, clock, _ = pace(0.2, 0.5)  # 1,000 pods at 200 writes/s: one write per 5 s each, no burst
    assert p.reserve() == 2.5  # the first write waits for its random phase: half of one interval
    assert p.reserve() == 7.5  # the next one interval later, whoever asks
    clock.now = 7.5
    assert p.reserve() == 5.0
    assert p.waits == 3 and p.waited_s == 15.0


def test_pods_let_go_together_spread_their_first_writes_over_one_interval() -> None:
    firsts = []
    for i in range(10):
        p, _, _ = pace(0.2, i / 10)
        firsts.append(p.reserve())
    assert firsts == [pytest.approx(0.5 * i) for i in range(10)]  # 10 pods, 5 s apart / 10


def test_a_large_share_bursts_one_second_of_it_then_paces() -> None:
    p, _, _ = pace(20.0, 0.0)  # 10 pods at 200 writes/s: 20 each
    delays = [p.reserve() for _ in range(22)]
    assert delays[:20] == [0.0] * 20  # one second's worth at once (the first at its phase, 0 here)
    assert delays[20] == pytest.approx(0.05) and delays[21] == pytest.approx(0.10)


def test_an_idle_pod_starts_again_at_a_random_phase() -> None:
    p, clock, _ = pace(0.5, 0.0, 0.4)
    assert p.reserve() == 0.0
    clock.now = 100.0  # long idle: the schedule does not let it send everything it missed at once
    assert p.reserve() == pytest.approx(0.8)  # 0.4 of a 2 s interval
    assert p.reserve() == pytest.approx(2.8)


def test_a_larger_share_told_later_does_not_wait_out_a_slot_planned_at_the_old_rate() -> None:
    p, _, told = pace(0.1, 0.9)  # a 10 s interval: the first slot at 9 s
    assert p.reserve() == 9.0  # slot at 9; the next would be at 19
    told[0] = 10.0  # the fleet shrank: a 0.1 s interval
    assert p.reserve() == pytest.approx(0.0)  # within the new burst tolerance
    told[0] = None
    assert p.reserve() == 0.0


def test_a_write_taken_back_gives_its_slot_back() -> None:
    p, _, _ = pace(0.2, 0.5)
    delay = p.reserve()
    p.give_back(delay)
    assert p.waits == 0 and p.waited_s == 0.0
    assert p.reserve() == 2.5  # the same slot again


def test_a_charged_write_moves_the_schedule_on_without_waiting() -> None:
    p, clock, _ = pace(0.5, 0.0)  # a 2 s interval, the first slot now
    assert p.reserve() == 0.0
    p.charge()  # the family's second write went with its first
    p.charge()  # and its third
    assert p.reserve() == 6.0  # the next family waits for three slots' worth: the share holds on average
    clock.now = 100.0
    p.charge()  # idle, then a charge: counted from now
    assert p._next == 102.0
