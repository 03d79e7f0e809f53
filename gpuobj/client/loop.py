"""A private asyncio loop on a daemon thread: the client library's I/O never blocks the workload.

Why: workloads are sync (training loops) or async (servers). Running all of gpuobj's
I/O on one loop of our own serves both: sync calls wait on a future with a timeout,
async calls await a wrapped future, and the workload's loop is never blocked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from gpuobj.client import errors

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "gpuobj-client") -> None:
        self._ready = threading.Event()
        self.loop = asyncio.new_event_loop()
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

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run on our loop and wait (from a workload thread), with a deadline."""
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
        """Await from another loop (an async workload), with a deadline."""
        if self.in_loop():
            return await asyncio.wait_for(coro, timeout)
        return await asyncio.wait_for(asyncio.wrap_future(self.submit(coro)), timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return

        async def _shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(_shutdown()).result(timeout=timeout)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.loop.close()


class Runner:
    """The sync/async bridge of the facade: run a core coroutine on the client loop with a deadline,
    and turn whatever goes wrong underneath into a GpuObjError (one choke point for every call)."""

    def __init__(self, loop: LoopThread, timeout: float) -> None:
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


def _translated(exc: BaseException, what: str) -> BaseException:
    return errors.agent_error(exc, what=what)
