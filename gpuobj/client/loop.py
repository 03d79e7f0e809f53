"""The one event loop of a workload process, reached from the workload's threads and loops.

Why one loop: the client core (core.py) and the embedded agent (gpuobj_agent.runtime) used to run
on two loops of their own, so a `put` crossed the workload thread, the client's loop, the agent's
loop and NIXL's control thread, and the store was written from two threads at once. Now the core
runs on the agent's loop (`LoopBridge` over it), and the core's calls into the agent are plain
awaits. An agent with no loop of its own (one that runs wherever it is awaited) gets a loop thread
made here (`LoopThread`), and the core and that agent share it: still one loop.

Workloads are sync (training loops) or async (servers): sync calls wait on a future with a
timeout, async calls await a wrapped future, and the workload's own loop is never blocked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gpuobj.client import errors

T = TypeVar("T")


class LoopBridge:
    """A loop another thread runs (the agent's), and the ways in from the workload's threads and loops."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    @property
    def running(self) -> bool:
        return self.loop.is_running() and not self.loop.is_closed()

    def in_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """From any thread: a workload thread's entry into the loop (hence thread-safe)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run on the loop and wait (from a workload thread), with a deadline."""
        if self.in_loop():
            coro.close()
            raise RuntimeError("sync gpuobj call made on gpuobj's own loop; use the async (a*) variant")
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the operation itself timed out (e.g. gpuobj_kube.client.ApiTimeout): say that, not ours
            future.cancel()
            raise TimeoutError(f"gpuobj operation did not finish within {timeout:.0f}s") from None

    async def acall(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Await from another loop (an async workload) or from this one, with a deadline."""
        if self.in_loop():
            return await asyncio.wait_for(coro, timeout)
        return await asyncio.wait_for(asyncio.wrap_future(self.submit(coro)), timeout)


class LoopThread(LoopBridge):
    """A loop of our own on a daemon thread: for an agent that runs no loop of its own, and for tests."""

    def __init__(self, name: str = "gpuobj-client") -> None:
        self._ready = threading.Event()
        super().__init__(asyncio.new_event_loop())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError("gpuobj client loop did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every task on the loop (it is ours alone), then end the thread."""
        if not self._thread.is_alive():
            return

        async def _shutdown() -> None:
            await cancel_tasks([t for t in asyncio.all_tasks() if t is not asyncio.current_task()], timeout)

        try:
            self.submit(_shutdown()).result(timeout=timeout + 1)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def cancel_tasks(tasks: list[asyncio.Task[Any]], timeout: float) -> None:
    """Cancel `tasks` and wait, at most `timeout`, until they have ended."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


class Runner:
    """The sync/async bridge of the facade: run a core coroutine on the one loop with a deadline,
    and turn whatever goes wrong underneath into a GpuObjError (one choke point for every call)."""

    def __init__(self, loop: LoopBridge, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout

    def call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """From a workload thread."""
        try:
            return self.loop.call(coro, self.timeout)
        except BaseException as exc:
            err = _translated(exc, what)
            if err is exc:
                raise
            raise err from exc

    async def acall(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """From an asyncio workload's loop, without blocking it."""
        try:
            return await self.loop.acall(coro, self.timeout)
        except BaseException as exc:
            err = _translated(exc, what)
            if err is exc:
                raise
            raise err from exc

    def read_state(self, fn: Callable[[], T], what: str) -> T:
        """From a workload thread: run a plain function on the loop (state only the loop touches)."""

        async def on_loop() -> T:
            return fn()

        return self.call(on_loop(), what)


def _translated(exc: BaseException, what: str) -> BaseException:
    return errors.agent_error(exc, what=what)
