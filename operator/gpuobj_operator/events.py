"""Kubernetes Events, posted in the background so they never sit on the free path.

Why: Events are what `kubectl describe` users read, but each is one more API write; so they are
kept for what a person must notice (a reclaim, a Lost object, a failure, a free whose agent was
gone) and never for the routine free that ends every lifecycle, and the free never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from typing import Any

from gpuobj_kube.client import EVENTS, ApiError, KubeClient

log = logging.getLogger(__name__)


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

    async def _run(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self.kube.create(EVENTS, event, event["metadata"]["namespace"])
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning("could not post event %s: %s", event["reason"], exc)
            except Exception:  # an event must never kill the recorder
                log.exception("unexpected error posting event")
            finally:
                self._queue.task_done()
