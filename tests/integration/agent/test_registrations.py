"""The registrations ledger: NIXL's sharp edges are avoided by construction."""

from __future__ import annotations

import pytest

from gpuobj_agent.registrations import LedgerError, RegionKey, RegionReused, RegistrationLedger

A = RegionKey("DRAM", 0, 0x1000, 4096)
B = RegionKey("DRAM", 0, 0x9000, 64)
V = RegionKey("VRAM", 1, 0x7F00, 1 << 20)


def ledger(*gids: int) -> RegistrationLedger:
    led = RegistrationLedger()
    for gid in gids:
        led.add_generation(gid)
    return led


def test_a_region_shared_by_two_objects_is_registered_once_and_deregistered_after_the_last():
    led = ledger(1)
    assert led.acquire(1, [A, B], "o1") == [A, B]
    assert led.acquire(1, [A, V], "o2") == [V]  # A is already registered: never twice
    first = led.release(1, "o1")
    assert first.deregister == [B]
    led.deregistered(1, first.deregister)
    second = led.release(1, "o2")
    assert sorted(second.deregister) == sorted([A, V])
    led.deregistered(1, second.deregister)
    assert led.registrations == led.deregistrations == 3
    assert led.balanced() and led.registered_bytes == 0


def test_duplicate_keys_in_one_object_are_registered_once():
    led = ledger(1)
    assert led.acquire(1, [A, A, B, A], "o1") == [A, B]
    released = led.release(1, "o1")
    assert released.deregister == sorted([A, B])  # each named once: a double entry would crash NIXL
    led.deregistered(1, released.deregister)
    assert led.balanced()


def test_an_exposed_region_is_never_registered_again_in_the_same_agent():
    led = ledger(1, 2)
    led.acquire(1, [A], "o1")
    led.expose(1, [A])
    released = led.release(1, "o1")
    assert released.exposed
    led.deregistered(1, released.deregister)
    with pytest.raises(RegionReused):
        led.acquire(1, [A], "o2")
    assert led.acquire(2, [A], "o2") == [A]  # a newer agent takes it
    led.deregistered(2, led.release(2, "o2").deregister)
    assert led.balanced()


def test_a_freed_exposed_region_stays_parked_and_serves_the_next_put_of_the_same_memory_until_the_fence():
    led = ledger(1)
    led.acquire(1, [A, B], "o1")
    led.expose(1, [A])
    released = led.release(1, "o1", park_exposed=True)
    assert released.exposed and released.deregister == [B]  # the unexposed one goes now
    led.deregistered(1, released.deregister)
    assert led.parked(1) == [A] and led.registered_bytes == A.nbytes
    assert led.acquire(1, [A], "o2") == []  # the same key again: no new registration, no newer agent needed
    assert led.parked(1) == []
    again = led.release(1, "o2", park_exposed=True)
    assert again.exposed and again.deregister == [] and led.parked(1) == [A]
    led.deregistered(1, led.parked(1))  # the fence deregisters what is parked
    with pytest.raises(RegionReused):
        led.acquire(1, [A], "o3")
    assert led.balanced()


def test_an_unexposed_region_may_be_registered_again():
    led = ledger(1)
    led.acquire(1, [A], "o1")
    led.deregistered(1, led.release(1, "o1").deregister)
    assert led.acquire(1, [A], "o2") == [A]
    led.deregistered(1, led.release(1, "o2").deregister)
    assert led.registrations == 2 and led.balanced()


def test_release_of_a_region_still_in_use_is_not_exposed_to_the_caller():
    led = ledger(1)
    led.acquire(1, [A], "o1")
    led.acquire(1, [A], "o2")
    led.expose(1, [A])
    released = led.release(1, "o1")
    assert released.deregister == [] and not released.exposed  # o2 keeps the memory alive
    final = led.release(1, "o2")
    assert final.deregister == [A] and final.exposed
    led.deregistered(1, final.deregister)
    assert led.balanced()


def test_rollback_undoes_an_acquire_whose_nixl_call_failed():
    led = ledger(1)
    led.acquire(1, [A], "o1")
    new = led.acquire(1, [A, B], "o2")
    assert new == [B]
    led.rollback(1, new, "o2")
    assert led.registrations == 1 and led.owners(1) == {"o1"}
    led.deregistered(1, led.release(1, "o1").deregister)
    assert led.balanced()


def test_deregistering_what_is_not_releasable_is_refused():
    led = ledger(1)
    led.acquire(1, [A], "o1")
    with pytest.raises(LedgerError):
        led.deregistered(1, [A])  # o1 still owns it
    with pytest.raises(LedgerError):
        led.drop_generation(1)  # still holds a registration
    led.deregistered(1, led.release(1, "o1").deregister)
    with pytest.raises(LedgerError):
        led.deregistered(1, [A])  # a second deregister: NIXL would say NOT_FOUND
    led.drop_generation(1)
    assert led.generations() == [] and led.balanced()


def test_an_owner_in_two_generations_is_released_per_generation():
    led = ledger(1, 2)
    led.acquire(1, [A], "o1")
    led.acquire(2, [A], "o1")  # migrated: the same memory in the next agent
    assert sorted(led.owner_generations("o1")) == [1, 2]
    led.deregistered(1, led.release(1, "o1").deregister)
    assert led.owner_generations("o1") == [2]
    led.deregistered(2, led.release(2, "o1").deregister)
    assert led.owner_generations("o1") == [] and led.balanced()
