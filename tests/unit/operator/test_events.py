"""Events that repeat are counted into one Event, as client-go's EventCorrelator does (events.py).

The correlator is pure; the recorder runs with a fake API of Events (create with generateName, merge
patch, 404 for one that expired). tests/e2e/operator/test_events.py posts against a real API server.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from gpuobj_kube.client import ApiError, NotFound
from gpuobj_operator.events import EventCorrelator, EventRecorder, Repeat

NS = "ml"


def event(message: str = "agent refused: 403", reason: str = "FreeFailed", name: str = "w") -> dict[str, Any]:
    return {
        "metadata": {"generateName": f"{name}.", "namespace": NS},
        "involvedObject": {
            "apiVersion": "gpuobj.io/v1alpha1",
            "kind": "GPUObject",
            "namespace": NS,
            "name": name,
            "uid": f"uid-{name}",
        },
        "type": "Warning",
        "reason": reason,
        "message": message,
        "source": {"component": "gpuobj-operator"},
        "lastTimestamp": "2026-12-06T02:00:00Z",
    }


def test_a_repeat_of_a_posted_event_counts_into_it() -> None:
    c = EventCorrelator()
    assert c.repeat(event(), now=0.0) is None
    c.posted(event(), "w.1", 1, now=0.0)
    assert c.repeat(event(), now=1.0) == Repeat("w.1", 2)
    c.posted(event(), "w.1", 2, now=1.0)
    assert c.repeat(event(), now=2.0) == Repeat("w.1", 3)


def test_only_the_same_object_type_reason_and_message_is_a_repeat() -> None:
    c = EventCorrelator()
    c.posted(event(), "w.1", 1, now=0.0)
    assert c.repeat(event(message="agent refused: 500"), now=1.0) is None
    assert c.repeat(event(reason="Lost"), now=1.0) is None
    assert c.repeat(event(name="v"), now=1.0) is None
    assert c.repeat({**event(), "type": "Normal"}, now=1.0) is None


def test_a_repeat_after_the_window_or_after_the_event_expired_is_a_new_event() -> None:
    c = EventCorrelator(window=600.0)
    c.posted(event(), "w.1", 1, now=0.0)
    assert c.repeat(event(), now=601.0) is None
    c.forget(event())
    assert c.repeat(event(), now=1.0) is None and len(c) == 0


def test_what_is_remembered_is_bounded_least_recently_posted_first_out() -> None:
    c = EventCorrelator(capacity=2)
    c.posted(event(name="a"), "a.1", 1, now=0.0)
    c.posted(event(name="b"), "b.1", 1, now=1.0)
    c.posted(event(name="a"), "a.1", 2, now=2.0)  # a is now the most recent
    c.posted(event(name="c"), "c.1", 1, now=3.0)
    assert len(c) == 2
    assert c.repeat(event(name="b"), now=4.0) is None
    assert c.repeat(event(name="a"), now=4.0) == Repeat("a.1", 3)


class FakeEvents:
    """Events in a dict, as the API server keeps them: a generated name on create, merge patches, 404s."""

    def __init__(self) -> None:
        self.store: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self._names = itertools.count(1)

    async def create(self, res: Any, body: dict[str, Any], namespace: str | None = None, **_: Any) -> dict[str, Any]:
        self.calls.append("create")
        name = f"{body['metadata']['generateName']}{next(self._names)}"
        self.store[name] = {**body, "metadata": {**body["metadata"], "name": name}}
        return self.store[name]

    async def patch(
        self, res: Any, name: str, body: dict[str, Any], namespace: str | None = None, **_: Any
    ) -> dict[str, Any]:
        self.calls.append("patch")
        if name not in self.store:
            raise NotFound(404, "NotFound", name)
        self.store[name].update(body)
        return self.store[name]


def _post(recorder: EventRecorder, message: str = "agent refused: 403") -> None:
    recorder.post(
        api_version="gpuobj.io/v1alpha1",
        kind="GPUObject",
        namespace=NS,
        name="w",
        uid="uid-w",
        type_="Warning",
        reason="FreeFailed",
        message=message,
    )


def test_the_recorder_posts_a_repeated_event_once_and_counts_the_rest_into_it() -> None:
    """Before, every occurrence was a new Event with count 1 (it failed so: three creates)."""

    async def go() -> None:
        api = FakeEvents()
        recorder = EventRecorder(api, "gpuobj-operator", "op-1")  # type: ignore[arg-type]
        recorder.start()
        for _ in range(3):
            _post(recorder)
        _post(recorder, message="agent refused: 500")
        await recorder.stop()
        assert api.calls == ["create", "patch", "patch", "create"]
        counts = sorted((e["message"], e["count"]) for e in api.store.values())
        assert counts == [("agent refused: 403", 3), ("agent refused: 500", 1)]

    asyncio.run(go())


def test_a_repeat_of_an_event_that_expired_posts_a_new_one() -> None:
    async def go() -> None:
        api = FakeEvents()
        recorder = EventRecorder(api, "gpuobj-operator", "op-1")  # type: ignore[arg-type]
        recorder.start()
        _post(recorder)
        await recorder.stop()
        api.store.clear()  # the API server's event TTL
        recorder.start()
        _post(recorder)
        await recorder.stop()
        assert api.calls == ["create", "patch", "create"]
        [again] = api.store.values()
        assert again["count"] == 1

    asyncio.run(go())


def test_a_repeat_the_api_refuses_to_count_is_posted_as_a_new_event() -> None:
    """RBAC older than the operator (no ``patch`` on events): the repeat is not lost, only not counted."""

    async def go() -> None:
        api = FakeEvents()

        async def forbidden(*_: Any, **__: Any) -> dict[str, Any]:
            api.calls.append("patch")
            raise ApiError(403, "Forbidden", "cannot patch resource events")

        api.patch = forbidden  # type: ignore[method-assign]
        recorder = EventRecorder(api, "gpuobj-operator", "op-1")  # type: ignore[arg-type]
        recorder.start()
        _post(recorder)
        _post(recorder)
        await recorder.stop()
        assert api.calls == ["create", "patch", "create"] and len(api.store) == 2

    asyncio.run(go())
