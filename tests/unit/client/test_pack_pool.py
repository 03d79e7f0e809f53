"""The pack pool's decisions: when a put waits for a version's free instead of registering a new buffer.

Logic only (the pool on one loop); tests/e2e/operator/test_weight_sync.py runs it with the real
operator's frees, real processes and NIXL.
"""

from __future__ import annotations

import asyncio

import torch

from gpuobj.client.state_dicts import PackPool, plan


def layout() -> object:
    return plan({"w": torch.zeros(8), "b": torch.zeros(2, dtype=torch.bfloat16)})


def test_only_a_version_whose_every_reference_is_released_is_worth_waiting_for() -> None:
    pool, p = PackPool(), layout()
    first = pool.take(p)
    assert not pool.draining(p, lambda tag: True)  # not tagged yet: its put has not returned
    pool.tag(first, ("ns", "policy-v1"))
    released: set[tuple[str, str]] = set()
    assert not pool.draining(p, released.__contains__)  # a reader (or the trainer) still holds it
    released.add(("ns", "policy-v1"))
    assert pool.draining(p, released.__contains__)  # its free is on its way
    pool.give_back(first)
    assert not pool.draining(p, released.__contains__)  # an idle buffer: nothing to wait for
    pool.tag(first, ("ns", "policy-v1"))  # a late tag of a buffer already back changes nothing
    assert pool.take(p) is first
    assert not pool.draining(p, lambda tag: True)  # untagged again (its new version's put is running)


def test_a_put_that_waits_gets_the_buffer_freed_meanwhile_and_registers_nothing_new() -> None:
    pool, p = PackPool(), layout()
    first = pool.take(p)

    async def main() -> object:
        # The agent frees the version on the loop (the one the core runs on) while the put waits.
        timer = asyncio.get_running_loop().call_later(0.05, pool.give_back, first)
        try:
            return await pool.take_waiting(p, timeout=30)
        finally:
            timer.cancel()

    assert asyncio.run(main()) is first
    stats = pool.stats()
    assert (stats["buffers"], stats["reused"], stats["waits"], stats["waitTimeouts"]) == (1, 1, 1, 0)


def test_a_wait_that_runs_out_makes_a_new_buffer() -> None:
    pool, p = PackPool(), layout()
    first = pool.take(p)
    second = asyncio.run(pool.take_waiting(p, timeout=0.01))
    assert second is not first
    stats = pool.stats()
    assert (stats["buffers"], stats["waits"], stats["waitTimeouts"], stats["busyBytes"]) == (2, 1, 1, 2 * p.nbytes)
