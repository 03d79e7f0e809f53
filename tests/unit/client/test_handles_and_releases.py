"""Handle finalizers and the release queue (docs/design.md, "teardown without deserialization"), without a cluster.

A dropped handle hands plain data to a queue and nothing else; the queue releases on the
client loop, holds a claim's release back while a fetch under it runs, and keeps going when
one release fails. The end-to-end tests above (tests/e2e/operator/test_lifecycle.py,
test_client_errors.py) run the same code against the real API server and agents.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import threading

import pytest

from gpuobj.client.handles import ObjectAddress, ObjectRef
from gpuobj.client.releases import ReleaseQueue

ADDRESS = ObjectAddress("ns", "w", "uid-1", "o-1", "src", "10.0.0.1:8470")


def test_a_dropped_owner_handle_queues_plain_data_once() -> None:
    got: list[tuple] = []
    ref = ObjectRef(ADDRESS, "owner", lambda *a: got.append(a))
    assert ref.alive
    del ref
    gc.collect()
    assert got == [("object", "ns", "w", "uid-1", None)]


def test_a_claim_handle_names_its_claim_and_where_its_release_goes() -> None:
    got: list[tuple] = []
    ref = ObjectRef(ADDRESS, "claim", lambda *a: got.append(a), claim_name="c-1", claim_uid="", via="10.0.0.1:8470")
    ref.release()
    ref.release()  # idempotent
    assert not ref.alive
    assert got == [("claim", "ns", "c-1", "", "10.0.0.1:8470")]
    del ref
    gc.collect()
    assert len(got) == 1  # the finalizer already ran: collecting it releases nothing again


def test_a_detached_or_unpickled_handle_releases_nothing() -> None:
    got: list[tuple] = []
    ref = ObjectRef(ADDRESS, "owner", lambda *a: got.append(a))
    ref.detach()
    del ref
    copy = pickle.loads(pickle.dumps(ObjectRef(ADDRESS, "owner", None)))
    assert copy.kind == "address" and copy.address == ADDRESS and not copy.alive
    copy.release()
    gc.collect()
    assert got == []


class Recorder:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.done: list[tuple] = []
        self.fail = fail or set()
        self.changed = asyncio.Event()

    async def __call__(self, kind: str, namespace: str, name: str, uid: str, via: str | None) -> None:
        if name in self.fail:
            raise ConnectionRefusedError("API down")
        self.done.append((kind, name))
        self.changed.set()

    async def wait_for(self, count: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.done) < count:
                self.changed.clear()
                await self.changed.wait()


def test_a_release_from_another_thread_is_processed_on_the_loop_in_order() -> None:
    async def go() -> None:
        rec = Recorder()
        q = ReleaseQueue(asyncio.get_running_loop(), rec)
        worker = asyncio.create_task(q.run())
        thread = threading.Thread(target=lambda: [q.put("object", "ns", f"o{i}", "") for i in range(5)])
        thread.start()
        thread.join()
        await rec.wait_for(5)
        assert rec.done == [("object", f"o{i}") for i in range(5)]
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(go())


def test_a_claim_release_waits_until_every_fetch_under_it_ended() -> None:
    async def go() -> None:
        rec = Recorder()
        q = ReleaseQueue(asyncio.get_running_loop(), rec)
        worker = asyncio.create_task(q.run())
        q.begin_read("c")
        q.begin_read("c")  # two fetches under the same claim
        q.put("claim", "ns", "c", "")
        q.put("object", "ns", "o", "")
        await q.drain()
        assert rec.done == [("object", "o")]  # the claim's release is held back
        q.end_read("c")
        await q.drain()
        assert rec.done == [("object", "o")]  # one fetch still runs
        await asyncio.to_thread(q.end_read, "c")  # the fetch may end on any thread
        await rec.wait_for(2)
        assert rec.done[-1] == ("claim", "c")
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(go())


def test_a_failing_release_is_logged_and_the_rest_still_go(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        rec = Recorder(fail={"bad"})
        q = ReleaseQueue(asyncio.get_running_loop(), rec)
        for name in ("a", "bad", "b"):
            q.put("object", "ns", name, "")
        await q.drain()
        assert rec.done == [("object", "a"), ("object", "b")]

    with caplog.at_level("WARNING", logger="gpuobj.client"):
        asyncio.run(go())
    assert "release of object ns/bad failed: API down" in caplog.text


def test_a_finalizer_after_the_loop_closed_neither_raises_nor_loses_the_release() -> None:
    rec = Recorder()
    loop = asyncio.new_event_loop()
    q = ReleaseQueue(loop, rec)
    loop.close()
    q.put("object", "ns", "late", "")  # interpreter shutdown: close() drains the queue itself
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(q.drain())
    finally:
        loop.close()
    assert rec.done == [("object", "late")]
