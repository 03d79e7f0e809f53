"""The stream reader's list-then-watch (the project's one informer, gpuobj_kube.informer): 410 relists at
once, other errors are retried, then raised as themselves.

A scripted stand-in for the API server (pure logic); tests/e2e/operator/test_client_refusals.py
runs the same loop against the real API server behind a proxy taken down and brought back.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import gpuobj.client.streams as streams
from gpuobj_kube.client import GPUOBJECTS, ApiError, Gone


class ScriptedKube:
    """`list` fails with the scripted errors first, then answers; `watch` yields one event, then ends."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = list(errors)
        self.lists = 0

    async def list(self, res, namespace, **selector):
        self.lists += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"items": [{"metadata": {"name": "s-0", "resourceVersion": "1"}}], "metadata": {"resourceVersion": "1"}}

    async def watch(self, res, namespace, **kwargs):
        yield "ADDED", {"metadata": {"name": "s-1", "resourceVersion": "2"}}
        await asyncio.Event().wait()  # then nothing more, until cancelled


def reader(kube: ScriptedKube) -> streams.StreamReader:
    core = SimpleNamespace(kube=kube, namespace="ns")
    return streams.StreamReader(core, runner=None, name="s")  # type: ignore[arg-type]


def test_errors_other_than_410_are_retried_with_backoff_and_410_relists_at_once(monkeypatch) -> None:
    monkeypatch.setattr(streams, "WATCH_BACKOFF_START", 0.001)

    async def go() -> None:
        kube = ScriptedKube([Gone(410, "Expired", "too old"), ConnectionRefusedError("refused"),
                             ApiError(503, "ServiceUnavailable", "etcd")])  # fmt: skip
        r, seen, second = reader(kube), [], asyncio.Event()

        def on_event(obj: dict, deleted: bool) -> None:
            seen.append(obj["metadata"]["name"])
            if obj["metadata"]["name"] == "s-1":
                second.set()

        informer = r._informer(GPUOBJECTS, on_event)
        r._informers = [informer]
        informer.start()
        async with asyncio.timeout(10):
            await second.wait()
        await informer.stop()
        assert kube.lists == 4 and r.watch_failures == 2 and seen == ["s-0", "s-1"]  # the 410 is not a failure

    asyncio.run(go())


def test_an_error_that_persists_is_raised_as_itself(monkeypatch) -> None:
    monkeypatch.setattr(streams, "WATCH_BACKOFF_START", 0.001)

    async def go() -> None:
        forbidden = ApiError(403, "Forbidden", "cannot list gpuobjects")
        kube = ScriptedKube([forbidden] * 100)  # both of its watches refused, until it gives up
        r = reader(kube)
        r.item_timeout = 10
        r._start_watches()
        with pytest.raises(ApiError) as caught:
            await r._next_item(0)  # what the reader's loop waits on: it raises the watch's own error
        await r._stop_watches()
        assert caught.value is forbidden and kube.lists >= streams.WATCH_ATTEMPTS

    asyncio.run(go())


def item(index: int, rv: str) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": f"s-{index}", "uid": f"u-{index}", "resourceVersion": rv},
        "spec": {
            "source": {"podName": "producer"},
            "tensors": [{"shape": [4], "dtype": "float32"}],
            "stream": {"name": "s", "index": index},
        },
    }


class RelistingKube:
    """Items: lists item 0, the watch expires (410), the relist shows it gone. The stream: listed, quiet."""

    def __init__(self) -> None:
        self.item_lists = [[item(0, "5")], []]
        self.relisted = asyncio.Event()

    async def list(self, res, namespace, **selector):
        if res is not GPUOBJECTS:
            return {"items": [], "metadata": {"resourceVersion": "5"}}
        items = self.item_lists.pop(0) if self.item_lists else []
        if not self.item_lists:
            self.relisted.set()
        return {"items": items, "metadata": {"resourceVersion": "6"}}

    async def watch(self, res, namespace, **kwargs):
        if res is GPUOBJECTS and self.item_lists:
            raise Gone(410, "Expired", "too old")
        await asyncio.Event().wait()
        yield  # pragma: no cover (an async generator that stays quiet)


def test_an_item_gone_while_the_watch_was_expired_leaves_the_reader_by_its_identity() -> None:
    async def go() -> None:
        kube = RelistingKube()
        r = reader(kube)  # type: ignore[arg-type]
        r._start_watches()
        async with asyncio.timeout(10):
            await kube.relisted.wait()
            while 0 in r._items:  # until the relist's DELETED is handled
                r._changed.clear()
                await r._changed.wait()
        failed = [t for t in r._watches if t.done()]
        await r._stop_watches()
        assert r._items == {} and failed == [] and r.watch_failures == 0

    asyncio.run(go())
