"""The object store and fence with real NIXL, two agents in this process (fast, no subprocesses)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from gpuobj_agent.errors import (
    BadRequest,
    Conflict,
    FetchError,
    FreeTimeout,
    KeyNotPublished,
    ObjectGone,
    SourceUnavailable,
)
from gpuobj_agent.layouts import TensorLayout
from gpuobj_contract import agent_api as api
from gpuobj_dev.testing.agent_workload import digest, make_tensors
from gpuobj_dev.testing.waits import wait_until

from .conftest import TOKEN, settle

pytestmark = pytest.mark.nixl


def run(rt, coro):
    """Run a coroutine on an agent's own loop (what the control server's handlers do)."""
    return asyncio.run_coroutine_threadsafe(coro, rt._loop).result(60)


def layouts(*specs):
    return [TensorLayout(tuple(shape), dtype, "cpu") for shape, dtype in specs]


def test_put_then_fetch_returns_equal_bytes_for_every_kind_of_tensor(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    lay = layouts(
        ((1000, 10), "float32"),
        ((), "bfloat16"),
        ((0, 5), "int8"),
        ((17,), "bool"),
        ((3, 3), "complex64"),
        ((8,), "float8_e4m3fn"),
        ((5,), "uint64"),
    )
    tensors = make_tensors(lay, seed=1)
    info = src.put("o-multi", tensors)
    assert info.bytes == sum(t.nbytes for t in tensors) and list(info.tensors) == lay
    got = dst.fetch(src.endpoint, "o-multi", token=TOKEN)
    assert digest(got) == digest(tensors)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in tensors]
    del got  # the fetched tensors return their landing buffer when they die
    assert src.free("o-multi")["freed"]
    settle(src.stats)
    settle(dst.stats)


def test_views_register_exactly_their_bytes(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    base = torch.arange(1000, dtype=torch.int32)
    a, b = base[100:200], base[150:400]  # overlapping views: one region, their union, not the storage
    src.put("o-views", [a, b])
    assert src.stats()["registeredRegions"] == 1
    got = dst.fetch(src.endpoint, "o-views", token=TOKEN)
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    del got
    src.put("o-views-2", [base[:10]])  # another object on the same storage: its own bytes, its own region
    assert src.stats()["registeredRegions"] == 2
    src.free("o-views")
    src.free("o-views-2")
    settle(src.stats)
    settle(dst.stats)


def test_a_non_contiguous_tensor_is_refused_with_a_clear_error_or_copied_on_request(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    with pytest.raises(BadRequest, match="not contiguous"):
        src.put("o-nc", [t])
    assert src.stats()["registrations"] == 0
    src.put("o-nc", [t], copy=True)
    assert torch.equal(dst.fetch(src.endpoint, "o-nc", token=TOKEN)[0], t)
    src.free("o-nc")
    settle(src.stats)


def test_bad_puts_are_refused_and_leave_nothing_behind(make_runtime):
    src = make_runtime("src")
    src.put("o1", [torch.ones(4)])
    with pytest.raises(Conflict):
        src.put("o1", [torch.ones(4)])
    with pytest.raises(BadRequest):
        src.put("bad id!", [torch.ones(4)])
    with pytest.raises(BadRequest):
        src.put("o2", [])
    with pytest.raises(BadRequest):
        src.put("o2", ["not a tensor"])  # type: ignore[list-item]
    src.free("o1")
    settle(src.stats)


def test_free_is_idempotent_and_says_so(make_runtime):
    src = make_runtime("src")
    src.put("o1", [torch.ones(4)])
    first = src.free("o1")
    assert first["freed"] and first["bytes"] == 16
    assert src.free("o1") == {"freed": False, "reason": "unknown object"}
    assert src.free("never-existed") == {"freed": False, "reason": "unknown object"}
    settle(src.stats)


def test_fetch_after_free_fails_cleanly_and_an_unreachable_source_too(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    src.put("o1", [torch.ones(1 << 16)])
    dst.fetch(src.endpoint, "o1", token=TOKEN)
    src.free("o1")
    with pytest.raises(ObjectGone, match="o1 not found"):
        dst.fetch(src.endpoint, "o1", token=TOKEN)
    with pytest.raises(SourceUnavailable, match="unreachable"):
        dst.fetch("127.0.0.1:1", "o1", token=TOKEN, timeout=10)
    settle(src.stats)
    settle(dst.stats)


def test_a_fetch_whose_read_outlives_its_lease_discards_the_bytes(make_runtime):
    src, dst = make_runtime("src", read_lease=0.0, lease_bytes_per_second=1e15), make_runtime("dst")
    src.put("o1", [torch.ones(1 << 16)])
    with pytest.raises(FetchError, match="outlived its"):
        dst.fetch(src.endpoint, "o1", token=TOKEN)  # the ticket expired before the source heard of its end
    src.free("o1")
    settle(src.stats)
    settle(dst.stats)


def test_a_fetch_that_runs_out_of_time_fails_cleanly(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    src.put("o1", [torch.ones(1 << 16)])
    with pytest.raises(FetchError, match="timed out"):
        dst.fetch(src.endpoint, "o1", token=TOKEN, timeout=1e-6)
    assert torch.equal(dst.fetch(src.endpoint, "o1", token=TOKEN)[0], torch.ones(1 << 16))
    src.free("o1")
    settle(src.stats)
    settle(dst.stats)


def test_a_free_waits_for_an_in_flight_read_then_frees(make_runtime):
    src = make_runtime("src")
    src.put("o1", [torch.ones(1024)])
    ticket = run(src, _begin(src, "o1"))
    done = threading.Event()
    result = {}

    def free():
        result.update(src.free("o1"))
        done.set()

    thread = threading.Thread(target=free)
    thread.start()
    wait_until(lambda: src.inventory()["objects"][0]["freeing"], "the free to start waiting")
    assert not done.is_set()  # held back by the ticket
    assert run(src, src.agent.reads.end_read(ticket.read_id)) == api.ReadEndAnswer(
        ended=True, valid=True, expired=False
    )
    thread.join(30)
    assert result["freed"] and result["waitedSeconds"] > 0
    settle(src.stats)


async def _begin(rt, object_id):
    return await rt.agent.reads.begin_read(object_id, "test")


def test_a_free_that_cannot_wait_long_enough_frees_nothing(make_runtime):
    src = make_runtime("src", free_wait_timeout=0.2)
    src.put("o1", [torch.ones(1024)])
    ticket = run(src, _begin(src, "o1"))
    with pytest.raises(FreeTimeout, match="nothing freed"):
        src.free("o1")
    assert src.stats()["objects"] == 1 and not src.inventory()["objects"][0]["freeing"]
    run(src, src.agent.reads.end_read(ticket.read_id))
    assert src.free("o1")["freed"]
    settle(src.stats)


def test_an_abandoned_ticket_holds_a_free_back_only_until_its_lease_ends(make_runtime):
    src = make_runtime("src", read_lease=0.3, lease_bytes_per_second=1e12)
    src.put("o1", [torch.ones(1024)])
    ticket = run(src, _begin(src, "o1"))  # a reader that crashed and never ends it
    assert src.free("o1")["freed"]
    end = run(src, src.agent.reads.end_read(ticket.read_id))
    assert end == api.ReadEndAnswer(ended=False, valid=False, expired=True)  # a late reader learns its bytes are void
    settle(src.stats)


def test_freed_memory_a_reader_saw_is_quarantined_until_its_nixl_agent_is_destroyed(make_runtime):
    src, dst = make_runtime("src", fence_interval=60.0), make_runtime("dst")
    src.put("seen", [torch.ones(1 << 12)])
    src.put("unseen", [torch.ones(1 << 12)])
    dst.fetch(src.endpoint, "seen", token=TOKEN)
    unseen = src.free("unseen")
    assert unseen["fenced"]  # no reader ever had its keys: released at once
    assert src.stats()["quarantinedBytes"] == 0
    seen = src.free("seen")
    assert not seen["fenced"] and src.stats()["quarantinedBytes"] == 16384
    rotations = src.stats()["rotations"]
    assert src.free("seen") == {"freed": False, "reason": "unknown object"}
    run(src, src.agent.nixl.rotate_now())  # what fence_interval (60 s here) would do later
    stats = settle(src.stats)
    assert stats["rotations"] == rotations + 1
    settle(dst.stats)


def test_live_objects_move_to_the_new_nixl_agent_and_stay_readable(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    objs = {f"o{i}": make_tensors(layouts(((64, 3), "float32")), seed=i) for i in range(200)}
    for oid, tensors in objs.items():
        src.put(oid, tensors)
    before = src.agent.info().nixl_agent
    dst.fetch(src.endpoint, "o0", token=TOKEN)  # expose o0
    assert src.free("o0", wait_fence=True)["fenced"]  # waits for the rotation, migration and teardown
    after = src.agent.info()
    assert after.nixl_agent != before and before not in after.nixl_agents  # the old agent is gone
    assert len(after.nixl_agents) == 2  # young (new objects) and tenured (the 199 that moved)
    for oid in ("o1", "o99", "o199"):
        assert digest(dst.fetch(src.endpoint, oid, token=TOKEN)) == digest(objs[oid])
    for oid in list(objs)[1:]:
        assert src.free(oid)["freed"]
    settle(src.stats)
    settle(dst.stats)


def test_a_tensor_put_again_after_an_exposed_free_goes_to_a_newer_nixl_agent(make_runtime):
    src, dst = make_runtime("src", fence_interval=60.0), make_runtime("dst")
    t = torch.arange(4096, dtype=torch.int16)  # the workload keeps it alive across both puts
    src.put("first", [t])
    dst.fetch(src.endpoint, "first", token=TOKEN)
    src.free("first")
    src.put("second", [t])  # same storage: this agent deregistered it after a reader saw it
    assert torch.equal(dst.fetch(src.endpoint, "second", token=TOKEN)[0], t)
    src.free("second", wait_fence=True)
    settle(src.stats)
    settle(dst.stats)


def test_declared_objects_materialize_idempotently_and_bind_published_tensors(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    store = src.agent.store
    lay = layouts(((4, 4), "bfloat16"))
    created, obj = run(src, store.materialize("decl", lay))
    assert created and obj.nbytes == 32
    again, _ = run(src, store.materialize("decl", lay))
    assert not again
    with pytest.raises(Conflict):
        run(src, store.materialize("decl", layouts(((4, 5), "bfloat16"))))
    with pytest.raises(KeyNotPublished):
        run(src, store.materialize("keyed", lay, key="weights"))
    published = make_tensors(lay, seed=9)
    src.publish("weights", published)
    with pytest.raises(Conflict):
        run(src, store.materialize("keyed", layouts(((2,), "int8")), key="weights"))
    run(src, store.materialize("keyed", lay, key="weights"))
    assert digest(dst.fetch(src.endpoint, "keyed", token=TOKEN)) == digest(published)
    assert torch.count_nonzero(dst.fetch(src.endpoint, "decl", token=TOKEN)[0]) == 0
    src.free("decl")
    src.free("keyed")
    assert src.unpublish("weights")
    settle(src.stats)
    settle(dst.stats)


def test_freeing_a_stream_frees_every_item(make_runtime):
    src = make_runtime("src")
    for i in range(5):
        src.put(f"s-{i}", [torch.full((8,), i)], stream="steps", stream_index=i)
    src.put("other", [torch.ones(2)])
    result = run(src, src.agent.store.free_stream("steps"))
    assert sorted(result.freed) == [f"s-{i}" for i in range(5)] and result.bytes == 5 * 64
    assert [o["id"] for o in src.inventory()["objects"]] == ["other"]
    assert run(src, src.agent.store.free_stream("steps")) == api.StreamFreeAnswer(freed=(), bytes=0)
    src.free("other")
    settle(src.stats)


def test_async_workloads_fetch_concurrently_without_blocking_their_loop(make_runtime):
    src, dst = make_runtime("src"), make_runtime("dst")
    objs = {f"o{i}": make_tensors(layouts(((1 << 18,), "float32")), seed=i) for i in range(8)}
    for oid, tensors in objs.items():
        src.put(oid, tensors)

    async def workload():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        got = await asyncio.gather(*(dst.afetch(src.endpoint, oid, token=TOKEN) for oid in objs))
        stop.set()
        await task
        return got, ticks

    got, ticks = asyncio.run(workload())
    assert [digest(g) for g in got] == [digest(t) for t in objs.values()]
    assert ticks > len(objs)  # the workload's loop kept running while the agent fetched
    del got
    for oid in objs:
        src.free(oid)
    settle(src.stats)
    settle(dst.stats)


def test_the_sync_api_refuses_to_block_the_agents_own_loop(make_runtime):
    src = make_runtime("src")

    async def inside():
        with pytest.raises(RuntimeError, match="async"):
            src.inventory()
        return True

    assert run(src, inside())


def test_stopping_with_objects_alive_deregisters_everything(make_runtime, token_file):
    src, dst = make_runtime("src"), make_runtime("dst")
    for i in range(10):
        src.put(f"o{i}", [torch.ones(1 << 10)])
    dst.fetch(src.endpoint, "o3", token=TOKEN)
    src.stop()
    ledger = src.agent.nixl.ledger
    assert ledger.balanced() and ledger.registrations == 10
    assert src.agent.nixl.quarantine.bytes == 0 and not src.agent.store.objects
    settle(dst.stats)


def test_churn_over_long_lived_objects_fences_every_free_and_balances(make_runtime):
    src = make_runtime("src", fence_interval=0.01, tenured_fence_interval=0.05)
    dst = make_runtime("dst")
    for i in range(300):
        src.put(f"long-{i}", [torch.full((256,), i, dtype=torch.int32)])
    for i in range(0, 300, 50):
        dst.fetch(src.endpoint, f"long-{i}", token=TOKEN)  # readers saw some of them
    for i in range(60):
        src.put(f"short-{i}", [torch.full((1024,), i, dtype=torch.float32)])
        assert float(dst.fetch(src.endpoint, f"short-{i}", token=TOKEN)[0][0]) == i
        assert src.free(f"short-{i}")["freed"]
    assert src.free("long-50", wait_fence=True)["fenced"]  # a long-lived object: the tenured agent rotates
    for i in (0, 100, 299):  # the survivors moved, and are still readable where they are now
        assert int(dst.fetch(src.endpoint, f"long-{i}", token=TOKEN)[0][0]) == i
    for i in range(300):
        src.free(f"long-{i}")
    stats = settle(src.stats)
    assert stats["rotations"] >= 2
    settle(dst.stats)
