"""The operator's work queue: de-duplication, and the urgent lane that frees take."""

from __future__ import annotations

import asyncio

from gpuobj_operator.workqueue import WorkQueue


def test_urgent_items_are_taken_first_and_an_item_is_queued_once() -> None:
    async def go() -> list:
        q = WorkQueue()
        for i in range(3):
            q.add(("object", i))
        q.add(("object", 1))  # already queued: once
        q.add(("claim", "c"), urgent=True)
        q.add(("object", 2), urgent=True)  # promoted to the urgent lane
        order = []
        while len(q):
            item = await q.get()
            order.append(item)
            q.done(item)
        return order

    assert asyncio.run(go()) == [("claim", "c"), ("object", 2), ("object", 0), ("object", 1)]


def test_an_urgent_add_while_processing_comes_back_urgent() -> None:
    async def go() -> list:
        q = WorkQueue()
        q.add("busy")
        item = await q.get()
        q.add("other")
        q.add("busy", urgent=True)  # dirty while processing
        q.done(item)
        return [await q.get(), await q.get()]

    assert asyncio.run(go()) == ["busy", "other"]


def test_a_second_add_after_keeps_the_sooner_time() -> None:
    """client-go's delaying queue keeps the earlier ready time: a retry must not wait behind a TTL requeue."""

    async def go() -> tuple:
        q: WorkQueue = WorkQueue()
        q.add_after(("claim", "c"), 3600.0)  # a TTL requeue, far away
        q.add_after(("claim", "c"), 0.01)  # a conflict retry: sooner, so it wins
        q.add_after(("claim", "c"), 7200.0)  # later again: ignored
        item = await asyncio.wait_for(q.get(), timeout=10)
        q.done(item)
        pending = len(q._timers)
        q.close()
        return item, pending

    assert asyncio.run(go()) == (("claim", "c"), 0)
