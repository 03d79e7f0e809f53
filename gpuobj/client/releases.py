"""The release queue: references dropped on any thread, released in order on the process's one loop.

Why a queue (docs/design.md, "teardown without deserialization"): a handle's finalizer may run on
any thread, inside the garbage collector, even during interpreter shutdown. It only puts plain
data here and never blocks, raises or does I/O; the loop (the agent's, which the client core runs
on) drains the queue. A claim's release waits while a fetch
under that claim is in flight (its bytes must outlive the read), and goes on once the read
ends. A release that fails is logged and dropped here: the write-behind queue underneath
retries what it owns, and the pod's death or the operator's audit cleans up the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Awaitable, Callable

log = logging.getLogger("gpuobj.client")

# (kind, namespace, name, uid, via): via is a hand-off claim's source agent, (endpoint, pod uid)
Release = tuple[str, str, str, str, "tuple[str, str] | None"]
ProcessFn = Callable[[str, str, str, str, "tuple[str, str] | None"], Awaitable[None]]


class ReleaseQueue:
    """Thread-safe entry (`put`, `begin_read`, `end_read`); draining runs on `loop`.

    Why these stay cross-thread with one loop: `put` is called by finalizers on whatever thread the
    garbage collector runs, and `begin_read`/`end_read` by a sync fetch that reads with a grant in the
    workload's own thread (core.fetch_direct); so the wake-up is `call_soon_threadsafe` and the read
    counts take a lock."""

    def __init__(self, loop: asyncio.AbstractEventLoop, process: ProcessFn) -> None:
        self.loop = loop
        self._process = process
        self._queue: queue.SimpleQueue[Release] = queue.SimpleQueue()
        self._event = asyncio.Event()
        self._lock = asyncio.Lock()
        self._reading_lock = threading.Lock()
        self._reading: dict[str, int] = {}  # claim name -> fetches in flight under it
        self._deferred: dict[str, list[Release]] = {}  # releases waiting for those fetches

    # -- any thread ------------------------------------------------------------------------
    def put(self, kind: str, namespace: str, name: str, uid: str, via: tuple[str, str] | None = None) -> None:
        """Called by a handle's finalizer: queue plain data, never block, never raise."""
        self._queue.put((kind, namespace, name, uid, via))
        self._wake()

    def begin_read(self, claim: str) -> None:
        """A fetch under `claim` starts: its release waits until the fetch ends."""
        with self._reading_lock:
            self._reading[claim] = self._reading.get(claim, 0) + 1

    def end_read(self, claim: str) -> None:
        """The read under `claim` ended; releases it held back go to the queue now."""
        with self._reading_lock:
            left = self._reading.get(claim, 1) - 1
            if left > 0:
                self._reading[claim] = left
                return
            self._reading.pop(claim, None)
            deferred = self._deferred.pop(claim, [])
        if deferred:
            for release in deferred:
                self._queue.put(release)
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._event.set)

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:
            pass  # loop already closed: close() drains the queue itself

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """The worker: drain whenever something was queued (cancelled at close)."""
        while True:
            await self._event.wait()
            self._event.clear()
            await self.drain()

    async def drain(self) -> None:
        """Process everything queued now. One drainer at a time: close() must not return while the
        worker is mid-release."""
        async with self._lock:
            await self._drain_unlocked()

    async def _drain_unlocked(self) -> None:
        while True:
            try:
                release = self._queue.get_nowait()
            except queue.Empty:
                return
            kind, namespace, name, uid, via = release
            if kind == "claim":
                with self._reading_lock:
                    if name in self._reading:
                        self._deferred.setdefault(name, []).append(release)  # a fetch under it is in flight
                        continue
            try:
                await self._process(kind, namespace, name, uid, via)
            except Exception as exc:
                log.warning("release of %s %s/%s failed: %s", kind, namespace, name, exc)
