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


T0 = leader_mod.dt.datetime(2026, 1, 1, tzinfo=leader_mod.dt.UTC)


def lease_spec(holder: str, renewed_ago: float, *, transitions: int = 2, duration: int = 15) -> dict:
    return {
        "holderIdentity": holder,
        "leaseDurationSeconds": duration,
        "acquireTime": leader_mod._fmt(T0 - leader_mod.dt.timedelta(hours=1)),
        "renewTime": leader_mod._fmt(T0 - leader_mod.dt.timedelta(seconds=renewed_ago)),
        "leaseTransitions": transitions,
    }


def test_after_an_outage_longer_than_the_lease_our_own_lease_is_renewed_at_once() -> None:
    # Nobody wrote the Lease meanwhile (it still names us): leading again needs no wait, and it is the
    # same term (acquireTime and transitions kept).
    acquire, transitions = leader_mod.may_take(lease_spec("op-a", renewed_ago=60), "op-a", T0, 15)
    assert acquire == T0 - leader_mod.dt.timedelta(hours=1) and transitions == 2


def test_another_replicas_running_lease_is_never_taken_and_an_expired_one_is() -> None:
    assert leader_mod.may_take(lease_spec("op-b", renewed_ago=10), "op-a", T0, 15) is None
    assert leader_mod.may_take(lease_spec("op-b", renewed_ago=16), "op-a", T0, 15) == (None, 3)
    assert leader_mod.may_take(lease_spec("", renewed_ago=1), "op-a", T0, 15) == (None, 3)  # handed over


def test_retries_back_off_to_a_bound_and_start_over_after_a_term() -> None:
    b = leader_mod.Backoff(start=0.5, cap=4.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    b.reset()
    assert b.next() == 0.5


def test_a_cancel_that_arrives_as_a_renewal_completes_stops_the_renewal_loop() -> None:
    """Shutdown cancels `hold` while a renewal may be finishing. Python 3.11's asyncio.wait_for returned
    the finished renewal's result and swallowed that cancel, so the loop renewed on and the term ended
    as stuck ("did not stop: lease renewal"); the renewal's timeout must let the cancel through."""
    e = LeaderElector(None, LeaseConfig(lease_seconds=30, renew_seconds=0.01))  # type: ignore[arg-type]
    e.is_leader = True
    renewals = 0

    async def main() -> None:
        task: asyncio.Task[None] | None = None

        async def try_acquire() -> bool:
            nonlocal renewals
            renewals += 1
            assert task is not None
            task.cancel()  # the cancel arrives while the renewal is in flight, and the renewal then succeeds
            return True

        e.try_acquire = try_acquire  # type: ignore[method-assign]
        task = asyncio.create_task(e.hold())
        done, _ = await asyncio.wait({task}, timeout=2)
        if not done:
            task.cancel()
        assert done, f"hold() still renewing after the cancel ({renewals} renewals)"
        assert task.cancelled()

    asyncio.run(main())
    assert renewals == 1
