"""The informer's rules without a server: watch from the seed's version, relist on 410 and report what
went as DELETED, retry other errors with backoff and fail with the real error once they persist.
(tests/e2e/operator/test_informer.py drives the same against a real API server.)"""

from __future__ import annotations

import asyncio

import pytest

from gpuobj_kube.client import PODS, ApiError, Gone
from gpuobj_kube.informer import Informer, InformerFailed


def pod(name: str, rv: str) -> dict:
    return {"metadata": {"namespace": "ml", "name": name, "uid": f"u-{name}", "resourceVersion": rv}}


class FakeKube:
    """Answers each list and watch from a script; records what was asked."""

    def __init__(self, lists: list, watches: list) -> None:
        self.lists, self.watches = lists, watches
        self.asked: list[tuple[str, str | None]] = []
        self.idle = asyncio.Event()

    async def list(self, res, namespace=None, **_):
        self.asked.append(("list", None))
        return self.lists.pop(0)

    async def watch(self, res, namespace=None, *, resource_version=None, **_):
        self.asked.append(("watch", resource_version))
        if not self.watches:
            self.idle.set()
            await asyncio.Event().wait()  # a quiet watch, until the test stops the informer
        step = self.watches.pop(0)
        if isinstance(step, BaseException):
            raise step
        for event in step:
            yield event


def run(kube: FakeKube, seed: tuple | None = None, **kw) -> tuple[list, list]:
    events: list = []
    progress: list = []

    async def go() -> None:
        informer = Informer(
            kube, PODS, lambda t, o: events.append((t, o["metadata"]["name"])), on_progress=progress.append, **kw
        )  # type: ignore[arg-type]
        if seed:
            informer.seed(*seed)
        informer.start()
        idle = asyncio.ensure_future(kube.idle.wait())
        await asyncio.wait({idle, informer.task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)  # type: ignore[arg-type]
        idle.cancel()
        if informer.task.done():  # type: ignore[union-attr]
            informer.task.result()  # type: ignore[union-attr]
        await informer.stop()

    asyncio.run(go())
    return events, progress


def test_seeded_from_a_list_it_watches_from_that_version_and_misses_nothing() -> None:
    kube = FakeKube([], [[("DELETED", pod("a", "12"))]])
    events, progress = run(kube, seed=([pod("a", "5")], "10"))
    assert kube.asked[:2] == [("watch", "10"), ("watch", "12")]  # no list of its own
    assert events == [("DELETED", "a")] and progress == ["10", "12"]


def test_a_pod_that_went_before_a_relist_is_reported_deleted() -> None:
    kube = FakeKube([{"metadata": {"resourceVersion": "20"}, "items": [pod("b", "19")]}], [Gone(410, "Gone", "")])
    events, _ = run(kube, seed=([pod("a", "5")], "10"))
    assert events == [(None, "b"), ("DELETED", "a")]
    assert kube.asked[:3] == [("watch", "10"), ("list", None), ("watch", "20")]


def test_an_unseeded_informer_lists_first_and_reports_deletions_against_the_seed() -> None:
    kube = FakeKube([{"metadata": {"resourceVersion": "7"}, "items": []}], [])
    events, _ = run(kube, seed=([pod("gone", "3")], None))
    assert events == [("DELETED", "gone")]


def test_other_errors_are_retried_with_backoff_and_recover() -> None:
    forbidden = ApiError(403, "Forbidden", "pods is forbidden")
    kube = FakeKube([], [forbidden, OSError("reset"), [("ADDED", pod("c", "11"))]])
    events, _ = run(kube, seed=([], "10"), backoff=(0.001, 0.002))
    assert events == [("ADDED", "c")]
    assert [a for a in kube.asked if a[0] == "watch"][:3] == [("watch", "10")] * 3  # same version: nothing skipped


def test_an_error_that_persists_ends_the_informer_with_the_real_error() -> None:
    forbidden = ApiError(403, "Forbidden", "pods is forbidden: missing RBAC")
    kube = FakeKube([], [forbidden] * 50)
    with pytest.raises(InformerFailed, match="missing RBAC") as failed:
        run(kube, seed=([], "10"), backoff=(0.001, 0.002), give_up_after=0.02)
    assert failed.value.__cause__ is not None and "Forbidden" in str(failed.value.__cause__)


def test_the_handler_runs_on_the_event_loop_thread() -> None:
    import threading

    threads: list[int] = []
    kube = FakeKube([], [[("ADDED", pod("a", "11")), ("MODIFIED", pod("a", "12"))]])

    async def go() -> None:
        loop_thread = threading.get_ident()
        informer = Informer(kube, PODS, lambda t, o: threads.append(threading.get_ident()))  # type: ignore[arg-type]
        informer.seed([], "10")
        informer.start()
        await asyncio.wait_for(kube.idle.wait(), 10)
        await informer.stop()
        assert threads == [loop_thread, loop_thread]

    asyncio.run(go())


def test_a_coroutine_handler_is_refused() -> None:
    async def handler(kind, obj) -> None:  # would never run: nothing awaits what it returns
        pass

    with pytest.raises(TypeError, match="plain function"):
        Informer(FakeKube([], []), PODS, handler)  # type: ignore[arg-type]


def test_it_remembers_identities_only_and_reports_a_relist_deletion_with_one() -> None:
    big = pod("a", "5") | {"spec": {"tensors": ["x" * 1000]}, "status": {"state": "Ready"}}
    deleted: list = []
    kube = FakeKube([{"metadata": {"resourceVersion": "20"}, "items": []}], [[("ADDED", big)], Gone(410, "Gone", "")])

    async def go() -> None:
        informer = Informer(kube, PODS, lambda t, o: deleted.append(o) if t == "DELETED" else None)  # type: ignore[arg-type]
        informer.seed([], "4")
        informer.start()
        await asyncio.wait_for(kube.idle.wait(), 10)
        await informer.stop()

    asyncio.run(go())
    assert deleted == [{"metadata": {"namespace": "ml", "name": "a", "uid": "u-a"}}]


class OneObject:
    """``get`` answers from a script (an error, or the object's state); ``watch`` stays quiet."""

    def __init__(self, gets: list) -> None:
        self.gets = gets

    async def get(self, res, name, namespace=None):
        step = self.gets.pop(0) if len(self.gets) > 1 else self.gets[0]
        if isinstance(step, BaseException):
            raise step
        return step

    async def watch(self, res, namespace=None, **_):
        await asyncio.Event().wait()
        yield  # pragma: no cover


def wait(gets: list, timeout: float = 5.0):
    from gpuobj_kube.informer import wait_for

    ready = lambda o: o is not None and o.get("ready")  # noqa: E731
    return asyncio.run(wait_for(OneObject(gets), PODS, "a", "ml", ready, timeout=timeout, backoff=(0.001, 0.002)))  # type: ignore[arg-type]


def test_wait_for_retries_errors_that_may_pass() -> None:
    unavailable = ApiError(503, "ServiceUnavailable", "etcd")
    assert wait([unavailable, OSError("refused"), {"ready": True}]) == {"ready": True}


def test_wait_for_raises_an_error_that_lasts_to_the_deadline_as_itself() -> None:
    unavailable = ApiError(503, "ServiceUnavailable", "etcd is down")
    with pytest.raises(ApiError, match="etcd is down"):
        wait([unavailable], timeout=0.2)


def test_wait_for_raises_a_refusal_at_once_and_times_out_plainly_when_the_api_answers() -> None:
    forbidden = ApiError(403, "Forbidden", "cannot get pods")
    with pytest.raises(ApiError, match="cannot get pods"):
        wait([forbidden], timeout=30)
    with pytest.raises(TimeoutError) as plain:
        wait([{"ready": False, "metadata": {"resourceVersion": "3"}}], timeout=0.2)
    assert not isinstance(plain.value, ApiError)


def test_an_event_the_handler_cannot_take_fails_the_informer_though_each_relist_works() -> None:
    """A failure only on the watch path: a working relist must not reset the run, or it loops unseen forever."""
    listed = {"items": [], "metadata": {"resourceVersion": "10"}}
    kube = FakeKube([listed] * 400, [[("ADDED", pod("bad", "11"))]] * 400)

    def handler(kind, obj) -> None:
        if obj["metadata"]["name"] == "bad":
            raise ValueError("cannot take pod bad")

    async def go() -> None:
        informer = Informer(kube, PODS, handler, backoff=(0.001, 0.002), give_up_after=0.05)  # type: ignore[arg-type]
        informer.seed([], "10")
        informer.start()
        idle = asyncio.ensure_future(kube.idle.wait())
        await asyncio.wait({idle, informer.task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)  # type: ignore[arg-type]
        idle.cancel()
        try:
            informer.task.result()  # type: ignore[union-attr]
        finally:
            await informer.stop()

    with pytest.raises(InformerFailed, match="cannot take pod bad"):
        asyncio.run(go())
