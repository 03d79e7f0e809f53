"""Read tickets: in-flight accounting and lease expiry, driven by a fake clock."""

from __future__ import annotations

from gpuobj_agent.registrations import RegionKey
from gpuobj_agent.tickets import EndResult, ReadTickets

K = (RegionKey("DRAM", 0, 0x1000, 64),)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_counts_as_in_flight_until_ended_and_ending_twice_is_a_noop():
    clock = Clock()
    tickets = ReadTickets(clock)
    t = tickets.issue("o1", 1, K, 64, "reader", lease=10)
    assert tickets.inflight(object_id="o1") == 1 and tickets.inflight(gid=1) == 1
    first = tickets.end(t.read_id)
    assert first.ended and first.valid
    second = tickets.end(t.read_id)
    assert not second.ended and second.valid  # it did end within its lease
    assert tickets.end("r-unknown") == EndResult(False, False)
    assert tickets.inflight() == 0


def test_an_expired_ticket_no_longer_holds_a_free_and_ends_as_invalid():
    clock = Clock()
    tickets = ReadTickets(clock)
    t = tickets.issue("o1", 1, K, 64, "reader", lease=10)
    clock.now += 9.9
    assert tickets.inflight(object_id="o1") == 1
    clock.now += 0.2
    assert tickets.inflight(object_id="o1") == 0
    result = tickets.end(t.read_id)
    assert not result.ended and not result.valid and tickets.was_expired(t.read_id)


def test_tickets_are_indexed_by_object_and_generation():
    clock = Clock()
    tickets = ReadTickets(clock)
    a = tickets.issue("o1", 1, K, 64, "r", lease=10)
    tickets.issue("o2", 1, K, 64, "r", lease=20)
    tickets.issue("o1", 2, K, 64, "r", lease=30)
    assert tickets.inflight(object_id="o1") == 2
    assert tickets.objects_reading(1) == {"o1", "o2"}
    assert tickets.next_deadline() == a.deadline
    tickets.end(a.read_id)
    assert tickets.objects_reading(1) == {"o2"} and tickets.objects_reading(2) == {"o1"}
    clock.now += 25
    assert tickets.inflight() == 1 and tickets.objects_reading(1) == set()


def test_the_tombstones_of_expired_tickets_are_bounded():
    clock = Clock()
    tickets = ReadTickets(clock, tombstones=3)
    ids = [tickets.issue(f"o{i}", 1, K, 1, "r", lease=1).read_id for i in range(10)]
    clock.now += 2
    assert tickets.expire() and tickets.inflight() == 0
    assert sum(tickets.was_expired(i) for i in ids) == 3
