"""The embedded agent: started and stopped inside a workload's own process.

Why a private thread with its own event loop: the workload may be a plain script, a
threaded server or an asyncio program; none of them should have to lend the agent its
loop, and nothing the agent does (serving the operator, fencing, transfers) may stall
the workload. That loop is the process's one loop: the embedding client's core
(gpuobj.client) runs on it too (`event_loop`), so the client's calls into the agent are
plain awaits and the store is only ever touched there. Sync methods hand work to the
loop and wait for it; the `a`-prefixed methods await it from the caller's loop without
blocking that loop (directly, when the caller is on it). The tensors a workload puts are
held as they are (zero-copy): do not modify them until freed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from aiohttp import web

from gpuobj_agent.agent import Agent
from gpuobj_agent.auth import ServiceAccountAuth
from gpuobj_agent.config import AgentConfig
from gpuobj_agent.fetch import Piece
from gpuobj_agent.layouts import TensorLayout
from gpuobj_agent.objects import StoredObject
from gpuobj_agent.objects import iso_time as _iso

T = TypeVar("T")

STOP_GRACE = 5.0  # seconds the tasks still on the loop at stop get to end once cancelled


@dataclass(frozen=True)
class ObjectInfo:
    """What `put` returns: the object as the agent describes it."""

    id: str
    bytes: int
    tensors: tuple[TensorLayout, ...]
    created_at: str
    stream: str | None
    stream_index: int | None

    @classmethod
    def of(cls, obj: StoredObject) -> ObjectInfo:
        return cls(obj.object_id, obj.nbytes, tuple(obj.layouts), _iso(obj.created_wall), obj.stream, obj.stream_index)


class AgentRuntime:
    """An agent on a background thread. `start()`, use, `stop()` (or use it as a context manager)."""

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        tokens: ServiceAccountAuth | None = None,
        extra_routes: Callable[[web.Application], None] | None = None,
        **overrides: Any,
    ) -> None:
        self.config = replace(config or AgentConfig(), **overrides)
        self._tokens = tokens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._agent: Agent | None = None
        self._stop_requested: asyncio.Event | None = None
        self._extra_routes = extra_routes

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> AgentRuntime:
        """Start the agent thread and wait until the control server listens and NIXL is up."""
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(started,), name="gpuobj-agent", daemon=True)
        self._thread.start()
        try:
            started.result(timeout)
        except BaseException:
            self._join(timeout)
            raise
        return self

    async def astart(self, timeout: float = 120.0) -> AgentRuntime:
        """`start` for asyncio workloads: waits without blocking the caller's loop."""
        return await asyncio.to_thread(self.start, timeout)

    def _main(self, started: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(started))
        finally:
            # Tasks a guest left on this loop (a client core never closed): cancelled, given a bound to end.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=STOP_GRACE))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self, started: concurrent.futures.Future[None]) -> None:
        self._stop_requested = asyncio.Event()
        try:
            self._agent = Agent(self.config, tokens=self._tokens, extra_routes=self._extra_routes)
            await self._agent.start()
        except BaseException as exc:
            if self._agent is not None:
                await self._agent.stop()
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            await self._stop_requested.wait()
        finally:
            await self._agent.stop()

    def stop(self, timeout: float = 60.0) -> None:
        """Free everything this agent holds, deregister it all, and end the thread."""
        if self._loop is not None and self._stop_requested is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_requested.set)
        self._join(timeout)

    async def astop(self, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.stop, timeout)

    def _join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the gpuobj agent thread did not stop within {timeout:g}s")
            self._thread = None

    def __enter__(self) -> AgentRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def agent(self) -> Agent:
        if self._agent is None or self._loop is None:
            raise RuntimeError("the agent is not started")
        return self._agent

    @property
    def endpoint(self) -> str:
        """host:port of the control server."""
        return self.agent.endpoint

    @property
    def serves_tls(self) -> bool:
        """This agent serves (and calls other agents over) TLS: GPUOBJ_AGENT_TLS=csr."""
        return self.agent.certificate is not None

    def client_tls(self) -> ssl.SSLContext | None:
        """What this pod presents when it calls another agent: the agent CA to trust and its own certificate
        (None when it serves plain HTTP)."""
        fetcher = self.agent.fetcher
        return fetcher.tls() if fetcher is not None else None

    @property
    def incarnation(self) -> str:
        """This agent process's random id: records made for it die with it (docs/agent-api.md)."""
        return self.agent.incarnation

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this agent serves on, lent to the embedding client's core (gpuobj.client.agent_seam)."""
        if self._loop is None or self._agent is None:
            raise RuntimeError("the agent is not started")
        return self._loop

    def _on_loop(self, what: str) -> None:
        """The store is this loop's alone: a caller on another thread is a bug, not a race to paper over."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is None or running is not self._loop:
            raise RuntimeError(f"{what} must be called on the agent's loop (the embedding client's core runs there)")

    # -- bridging ----------------------------------------------------------------------
    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        loop = self._loop
        if loop is None or self._agent is None:
            coro.close()
            raise RuntimeError("the agent is not started")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is self._loop:
            coro.close()
            raise RuntimeError("blocking call from the agent's own loop; use the async method")
        return self._submit(coro).result(timeout)

    async def _acall(self, coro: Coroutine[Any, Any, T]) -> T:
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(self._submit(coro))

    async def _put(
        self,
        object_id: str,
        tensors: Sequence[torch.Tensor],
        stream: str | None,
        stream_index: int | None,
        copy: bool,
        shared_with: Sequence[str] = (),
        on_release: Callable[[], None] | None = None,
    ) -> ObjectInfo:
        obj = await self.agent.store.put(
            object_id,
            list(tensors),
            stream=stream,
            stream_index=stream_index,
            copy=copy,
            shared_with=shared_with,
            on_release=on_release,
        )
        return ObjectInfo.of(obj)

    async def _publish(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        self.agent.store.publish(key, list(tensors))

    async def _unpublish(self, key: str) -> bool:
        return self.agent.store.unpublish(key)

    async def _fetch(
        self,
        endpoint: str,
        object_id: str,
        device: str,
        token: str | None,
        timeout: float | None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        assert self.agent.fetcher is not None
        return await self.agent.fetcher.fetch(
            endpoint, object_id, device=device, token=token, timeout=timeout, pod_uid=pod_uid, select=select
        )

    async def _free(self, object_id: str, wait_fence: bool) -> dict[str, Any]:
        return (await self.agent.store.free(object_id, wait_fence=wait_fence)).to_json()

    async def _grant(self, object_id: str) -> dict[str, Any]:
        return (await self.agent.reads.grant(object_id)).to_json()

    async def _inventory(self) -> dict[str, Any]:
        return self.agent.inventory().to_json()

    async def _stats(self) -> dict[str, Any]:
        return self.agent.stats()

    # -- the workload's API --------------------------------------------------------------
    def put(
        self,
        object_id: str,
        tensors: Sequence[torch.Tensor] | torch.Tensor,
        *,
        stream: str | None = None,
        stream_index: int | None = None,
        copy: bool = False,
        timeout: float | None = 60.0,
        shared_with: Sequence[str] = (),
        on_release: Callable[[], None] | None = None,
    ) -> ObjectInfo:
        """Hold tensors under `object_id` (zero-copy; `copy=True` stores a contiguous copy of
        non-contiguous tensors instead of refusing them) and register them for remote reads.
        Pods of this namespace may read it, and those of the namespaces in `shared_with`."""
        seq = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        return self._call(self._put(object_id, seq, stream, stream_index, copy, shared_with, on_release), timeout)

    async def aput(
        self,
        object_id: str,
        tensors: Sequence[torch.Tensor] | torch.Tensor,
        *,
        stream: str | None = None,
        stream_index: int | None = None,
        copy: bool = False,
        shared_with: Sequence[str] = (),
        on_release: Callable[[], None] | None = None,
    ) -> ObjectInfo:
        """``on_release``: the tensors are pooled memory the caller reuses (a weight-sync pack buffer): the
        region stays registered when the object is freed, and this runs then, on the agent's loop."""
        seq = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        return await self._acall(self._put(object_id, seq, stream, stream_index, copy, shared_with, on_release))

    def publish(self, key: str, tensors: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Offer tensors under `key` for a GPUObject declared with `kubectl apply` to bind."""
        seq = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        self._call(self._publish(key, seq), 30)

    def unpublish(self, key: str) -> bool:
        return self._call(self._unpublish(key), 30)

    def free(self, object_id: str, *, wait_fence: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Free an object held here (idempotent); what the operator does over HTTP."""
        return self._call(self._free(object_id, wait_fence), timeout)

    def set_record_pending(self, object_id: str, pending: bool) -> None:
        """From the embedding client's write-behind, on this loop: whether the object's GPUObject is still
        unrecorded."""
        self._on_loop("set_record_pending")
        self.agent.store.set_record_pending(object_id, pending)

    def set_private(self, object_id: str, private: bool) -> None:
        """From the embedding client's write-behind, on this loop: the object is private, held and never
        recorded."""
        self._on_loop("set_private")
        self.agent.store.set_private(object_id, private)

    def told_write_rate(self) -> float | None:
        """For the embedding client's write-behind, on this loop (the control server sets it there too)."""
        return self.agent.write_rate

    async def afree(self, object_id: str, *, wait_fence: bool = False) -> dict[str, Any]:
        return await self._acall(self._free(object_id, wait_fence))

    def fetch(
        self,
        endpoint: str,
        object_id: str,
        *,
        device: str = "cpu",
        token: str | None = None,
        timeout: float | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """Read an object from the agent at `endpoint` into new tensors on `device` (`select`: only these pieces)."""
        bound = None if timeout is None else timeout + 5
        return self._call(self._fetch(endpoint, object_id, device, token, timeout, None, select), bound)

    async def afetch(
        self,
        endpoint: str,
        object_id: str,
        *,
        device: str = "cpu",
        token: str | None = None,
        timeout: float | None = None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """`select`: read only these pieces of the object (fetch.Piece; gpuobj.client.shards makes them)."""
        return await self._acall(self._fetch(endpoint, object_id, device, token, timeout, pod_uid, select))

    async def agrant(self, object_id: str) -> dict[str, Any]:
        """A read grant for an object held here (reads.Reads.grant), to embed in a hand-off (as JSON: it travels)."""
        return await self._acall(self._grant(object_id))

    async def afetch_granted(
        self,
        endpoint: str,
        object_id: str,
        grant: dict[str, Any],
        *,
        device: str = "cpu",
        token: str | None = None,
        timeout: float | None = None,
        pod_uid: str | None = None,
        select: Sequence[Piece] | None = None,
    ) -> list[torch.Tensor]:
        """Read with a grant (no request to the source; a ticket only if the grant went stale)."""
        assert self.agent.fetcher is not None
        return await self._acall(
            self.agent.fetcher.fetch_granted(
                endpoint, object_id, grant, device=device, token=token, timeout=timeout, pod_uid=pod_uid, select=select
            )
        )

    def fetch_granted_direct(
        self,
        endpoint: str,
        object_id: str,
        grant: dict[str, Any],
        *,
        device: str = "cpu",
        timeout: float | None = None,
    ) -> list[torch.Tensor]:
        """Read with a grant in the calling thread (no loop, no request); raises if the grant went stale."""
        fetcher = self.agent.fetcher
        assert fetcher is not None
        return fetcher.fetch_granted_direct(endpoint, object_id, grant, device=device, timeout=timeout)

    def inventory(self) -> dict[str, Any]:
        return self._call(self._inventory(), 30)

    def stats(self) -> dict[str, Any]:
        """Counts for tests: objects, bytes, registrations, in-flight reads, quarantine."""
        return self._call(self._stats(), 30)

    async def astats(self) -> dict[str, Any]:
        return await self._acall(self._stats())
