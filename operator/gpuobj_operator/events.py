"""Kubernetes Events, posted in the background so they never sit on the free path.

Why: Events are what `kubectl describe` users read, but each is one more API write; so they are
kept for what a person must notice (a reclaim, a Lost object, a failure, a free whose agent was
gone) and never for the routine free that ends every lifecycle, and the free never waits for one.

An event that repeats one already posted (same object, type, reason and message) within WINDOW is not
a new Event: the earlier one's ``count`` and ``lastTimestamp`` are patched, as client-go's
EventCorrelator does (its event logger), so a retried failure shows as one Event with its count,
not as a list of copies. What was posted is remembered in an LRU of CORRELATED entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from gpuobj_kube.client import EVENTS, ApiError, KubeClient, NotFound

log = logging.getLogger(__name__)

CORRELATED = 4096  # events remembered for aggregation (client-go's maxLruCacheEntries)
WINDOW = 600.0  # seconds after its last occurrence that a repeat still counts into an Event


@dataclass
class _Posted:
    name: str  # the Event's metadata.name (the API server generated it)
    count: int
    at: float  # monotonic seconds of its last occurrence


@dataclass(frozen=True)
class Repeat:
    """Patch the Event ``name`` to ``count`` occurrences instead of creating another."""

    name: str
    count: int


class EventCorrelator:
    """Which events repeat one already posted: pure, bounded (an LRU of ``capacity`` entries)."""

    def __init__(self, capacity: int = CORRELATED, window: float = WINDOW) -> None:
        self.capacity = capacity
        self.window = window
        self._posted: OrderedDict[tuple[str, ...], _Posted] = OrderedDict()

    @staticmethod
    def key(event: dict[str, Any]) -> tuple[str, ...]:
        """What makes two events the same one (client-go's getEventKey, less the fields we never vary)."""
        obj = event["involvedObject"]
        return (
            event["source"]["component"],
            obj["kind"],
            obj["namespace"],
            obj["name"],
            obj["uid"],
            event["type"],
            event["reason"],
            event["message"],
        )

    def repeat(self, event: dict[str, Any], now: float) -> Repeat | None:
        """The Event this one repeats, with its count after this occurrence; None: post a new Event."""
        posted = self._posted.get(self.key(event))
        if posted is None or now - posted.at > self.window:
            return None
        return Repeat(posted.name, posted.count + 1)

    def posted(self, event: dict[str, Any], name: str, count: int, now: float) -> None:
        """The API holds Event ``name`` with ``count`` occurrences, the last one ``now``."""
        key = self.key(event)
        self._posted[key] = _Posted(name, count, now)
        self._posted.move_to_end(key)
        while len(self._posted) > self.capacity:
            self._posted.popitem(last=False)

    def forget(self, event: dict[str, Any]) -> None:
        """The Event is gone from the API (events expire): the next occurrence posts a new one."""
        self._posted.pop(self.key(event), None)

    def __len__(self) -> int:
        return len(self._posted)


class EventRecorder:
    def __init__(
        self,
        kube: KubeClient,
        component: str,
        instance: str,
        capacity: int = 10_000,
        rate: float = 20.0,
        burst: int = 100,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last = time.monotonic()
        self.kube = kube
        self.component = component
        self.instance = instance
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=capacity)
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.correlator = EventCorrelator()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-recorder")

    async def stop(self, timeout: float = 5.0) -> None:
        """Flush what is queued (bounded), then stop."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._queue.join()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    def _allowed(self) -> bool:
        """A token bucket, like client-go's event spam filter: bursts pass, a flood is cut to ``rate``/s."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def post(
        self, *, api_version: str, kind: str, namespace: str, name: str, uid: str, type_: str, reason: str, message: str
    ) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        event = {
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": api_version,
                "kind": kind,
                "namespace": namespace,
                "name": name,
                "uid": uid,
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": now[:19] + "Z",
            "lastTimestamp": now[:19] + "Z",
            "count": 1,
        }
        if not self._allowed():
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1

    async def _send(self, event: dict[str, Any]) -> None:
        """Count a repeat into the Event it repeats, else create one. A patch refused (a 404: that Event
        expired; a 403: RBAC older than this operator, without ``patch``) posts the repeat as a new Event:
        never lost, only not counted."""
        namespace, now = event["metadata"]["namespace"], time.monotonic()
        repeat = self.correlator.repeat(event, now)
        if repeat is not None:
            patch = {"count": repeat.count, "lastTimestamp": event["lastTimestamp"]}
            try:
                await self.kube.patch(EVENTS, repeat.name, patch, namespace)
            except ApiError as exc:
                self.correlator.forget(event)
                if not isinstance(exc, NotFound):
                    log.warning("could not count a repeat of event %s into %s: %s", event["reason"], repeat.name, exc)
            else:
                self.correlator.posted(event, repeat.name, repeat.count, now)
                return
        created = await self.kube.create(EVENTS, event, namespace)
        self.correlator.posted(event, created["metadata"]["name"], 1, now)

    async def _run(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self._send(event)
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning("could not post event %s: %s", event["reason"], exc)
            except Exception:  # an event must never kill the recorder
                log.exception("unexpected error posting event")
            finally:
                self._queue.task_done()
