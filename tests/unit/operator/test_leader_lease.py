"""A leader acts only while its lease is surely its own: a pause longer than the lease stops it acting."""

from __future__ import annotations

import asyncio

import pytest

from gpuobj_operator import leader as leader_mod
from gpuobj_operator.leader import LeaderElector, LeaseConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(leader_mod.time, "monotonic", c)
    return c


def elector(answers: list[bool]) -> LeaderElector:
    e = LeaderElector(None, LeaseConfig(lease_seconds=3, renew_seconds=1))  # type: ignore[arg-type]

    async def try_acquire() -> bool:
        return answers.pop(0)

    e.try_acquire = try_acquire  # type: ignore[method-assign]
    return e


def test_the_lease_is_held_for_a_lease_duration_from_the_start_of_the_last_renewal(clock: Clock) -> None:
    e = elector([True, False, True])
    asyncio.run(e.acquire())
    assert e.holds_lease()
    clock.now += 2.9
    assert e.holds_lease()
    clock.now += 0.2  # paused past the lease (SIGSTOP): another replica may lead now
    assert not e.holds_lease()
    assert not asyncio.run(e._attempt())  # a failed renewal confirms nothing
    assert not e.holds_lease()
    assert asyncio.run(e._attempt())  # renewed: ours again
    assert e.holds_lease()


def test_a_replica_that_never_led_holds_nothing(clock: Clock) -> None:
    assert not elector([]).holds_lease()
