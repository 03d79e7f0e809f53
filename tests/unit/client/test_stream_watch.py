"""The stream reader's watches (the project's one informer): 410 relists at once, other errors are retried,
then the real one is raised.

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
    monkeypatch.setattr(streams, "WATCH_BACKOFF", (0.001, 0.002))

    async def go() -> None:
        kube = ScriptedKube([Gone(410, "Expired", "too old"), ConnectionRefusedError("refused"),
                             ApiError(503, "ServiceUnavailable", "etcd")])  # fmt: skip
        r, seen, second = reader(kube), [], asyncio.Event()

        def on_event(obj: dict, deleted: bool) -> None:
            seen.append(obj["metadata"]["name"])
            if obj["metadata"]["name"] == "s-1":
                second.set()

        r._informers = [r._informer(on_event, resource=GPUOBJECTS)]
        r._informers[0].start()
        async with asyncio.timeout(10):
            await second.wait()
        await r._informers[0].stop()
        assert kube.lists == 4 and r.watch_failures == 2 and seen == ["s-0", "s-1"]  # the 410 is not a failure

    asyncio.run(go())


def test_an_error_that_persists_is_raised_as_itself(monkeypatch) -> None:
    monkeypatch.setattr(streams, "WATCH_BACKOFF", (0.001, 0.002))
    monkeypatch.setattr(streams, "WATCH_GIVE_UP_SECONDS", 0.05)

    async def go() -> None:
        forbidden = ApiError(403, "Forbidden", "cannot list gpuobjects")
        kube = ScriptedKube([forbidden] * 10_000)
        r = reader(kube)
        r.item_timeout = 10
        r._start_watches()
        with pytest.raises(ApiError) as caught:
            await r._next_item(0)  # what the reader's loop waits on: it raises the informer's real error
        await r._stop_watches()
        assert caught.value is forbidden and r.watch_failures >= 2

    asyncio.run(go())
