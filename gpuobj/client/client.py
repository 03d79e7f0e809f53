"""The client library workloads call: put, fetch, borrow, share, adopt, release, publish, streams.

This is the facade: every public call has a sync form for ordinary code and an ``a``-prefixed
async form for asyncio workloads; both run the client's async core (core.py) on the process's
one event loop, the embedded agent's (loop.py), with a deadline, and translate whatever goes
wrong underneath into the `GpuObjError` hierarchy (errors.py) at one choke point (loop.Runner).

Kubernetes side: GPUObjects and GPUObjectClaims are written behind the caller
(writebehind.py): `put`, `share` and `release` return once the bytes are stored and the
writes queued; `flush()` waits until everything queued has landed (docs/write-behind.md).
Byte side: the pod's embedded agent (gpuobj_agent.runtime.AgentRuntime) stores, registers
and reads with NIXL; a hand-off carries a read grant, so the receiver's fetch makes no
request to the source.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuobj.client import errors, handoff_route
from gpuobj.client.agent_seam import AgentSeam, loop_of
from gpuobj.client.core import ClientCore, describe_ref
from gpuobj.client.handles import ObjectAddress, ObjectRef, SharedRef
from gpuobj.client.loop import LoopBridge, LoopThread, Runner, cancel_tasks
from gpuobj.client.reads import Fetched
from gpuobj.client.shards import Shard
from gpuobj.client.streams import StreamReader, StreamWriter
from gpuobj.client.writebehind import DEFAULT_MAX_PENDING, DEFAULT_WINDOW
from gpuobj_contract import names
from gpuobj_kube.config import KubeConfig
from gpuobj_kube.config import load as load_kubeconfig

log = logging.getLogger("gpuobj.client")

DEFAULT_TIMEOUT = 60.0


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number, not {raw!r}") from None


def _at_shutdown(fn: Callable[[], object]) -> None:
    """Run ``fn`` when the interpreter starts shutting down, before thread pools refuse work.

    Plain atexit handlers run after concurrent.futures has shut its executors down, when
    asyncio's run_in_executor (and so an agent's NIXL calls) can no longer be used. Threading's
    own exit hooks run first, in reverse order of registration, so a hook registered now runs
    before the executors' (registered when concurrent.futures was imported). Falls back to atexit.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
        return
    try:
        register(fn)
    except RuntimeError:  # already shutting down
        atexit.register(fn)


def _pod_environment(**given: Any) -> dict[str, Any]:
    """Arguments given, else the downward-API environment; a clear error naming every variable missing."""
    from gpuobj_agent import config as agent_config  # one home for the variable names

    sources = {
        "pod_name": agent_config.POD_NAME_ENV,
        "namespace": agent_config.POD_NAMESPACE_ENV,
        "pod_uid": agent_config.POD_UID_ENV,
        "token_file": names.TOKEN_ENV,
        "port": agent_config.PORT_ENV,
    }
    values = {key: given[key] if given.get(key) is not None else os.environ.get(var) for key, var in sources.items()}
    port: int | str = values.pop("port") or names.DEFAULT_AGENT_PORT  # given as an int, or $GPUOBJ_AGENT_PORT
    missing = [sources[k] for k, v in values.items() if not v]
    if missing:
        raise errors.ConfigurationError(
            f"Client.connect(): {', '.join(missing)} not set; in a pod set them from the downward API "
            "(see docs/workload-pods.md and deploy/examples/workload-pod.yaml), or pass the arguments"
        )
    try:
        values["port"] = int(port)
    except ValueError:
        raise errors.ConfigurationError(f"{agent_config.PORT_ENV}={port!r} is not a port number") from None
    return values


class Client:
    """One per workload process. Starts (or wraps) the pod's agent and talks to the API server."""

    def __init__(
        self,
        *,
        pod_name: str,
        namespace: str,
        pod_uid: str,
        agent: AgentSeam,
        kube_config: KubeConfig | None = None,
        kubeconfig: str | Path | None = None,
        token_file: str | Path | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        owns_agent: bool = False,
        write_behind: bool | None = None,
        write_window: float | None = None,
        max_pending_writes: int | None = None,
        backpressure_timeout: float | None = None,
    ) -> None:
        """``write_behind`` (default on; $GPUOBJ_WRITE_BEHIND=0 turns it off): API writes leave the
        caller's path; ``write_window`` seconds ($GPUOBJ_WRITE_WINDOW, default 0.1) is how long an
        object may live without ever being recorded; ``max_pending_writes``
        ($GPUOBJ_MAX_PENDING_WRITES) bounds the queue, and a put that finds it full waits up to
        ``backpressure_timeout`` ($GPUOBJ_BACKPRESSURE_TIMEOUT, default the call timeout) and then
        raises WriteBehindFullError.

        The core runs on ``agent``'s own loop when it runs one (the embedded runtime: one loop in the
        process); an agent that runs none gets a loop thread made here, which it then shares."""
        self._owns_agent = owns_agent
        config = kube_config or load_kubeconfig(kubeconfig)
        if write_behind is None:
            write_behind = os.environ.get("GPUOBJ_WRITE_BEHIND", "1") not in ("0", "false", "no")
        wb_options: dict[str, Any] | None = None
        if write_behind:
            if write_window is None:
                write_window = _env_float("GPUOBJ_WRITE_WINDOW", DEFAULT_WINDOW)
            if max_pending_writes is None:
                max_pending_writes = int(_env_float("GPUOBJ_MAX_PENDING_WRITES", DEFAULT_MAX_PENDING))
            if backpressure_timeout is None:
                backpressure_timeout = _env_float("GPUOBJ_BACKPRESSURE_TIMEOUT", timeout)
            record = os.environ.get("GPUOBJ_RECORD", "shared")
            if record not in ("all", "shared"):
                raise ValueError(f"GPUOBJ_RECORD={record!r}: choose 'all' (record every object) or 'shared'")
            wb_options = {
                "record": record,
                "window": write_window,
                "max_pending": int(max_pending_writes),
                "backpressure_timeout": backpressure_timeout,
            }
        host = loop_of(agent)
        self._own_loop: LoopThread | None = None
        if host is None:
            self._own_loop = LoopThread()
            self._loop: LoopBridge = self._own_loop
        else:
            self._loop = LoopBridge(host)
        self.runner = Runner(self._loop, timeout)
        try:
            self.core: ClientCore = self._loop.call(
                ClientCore.create(
                    pod_name=pod_name,
                    namespace=namespace,
                    pod_uid=pod_uid,
                    agent=agent,
                    kube_config=config,
                    token_file=token_file,
                    timeout=timeout,
                    write_behind=wb_options,
                ),
                timeout,
            )
            # The core's one background task on the shared loop; close() cancels it before the agent stops.
            self._tasks: list[asyncio.Task[None]] = [self._loop.call(self._start_releases(), timeout)]
        except BaseException:
            if self._own_loop is not None:
                self._own_loop.stop()
            raise
        self._closed = False
        _at_shutdown(self.close)

    async def _start_releases(self) -> asyncio.Task[None]:
        return asyncio.create_task(self.core.releases.run(), name="gpuobj-releases")

    # ------------------------------------------------------------ identity

    @property
    def pod_name(self) -> str:
        return self.core.pod_name

    @property
    def namespace(self) -> str:
        return self.core.namespace

    @property
    def pod_uid(self) -> str:
        return self.core.pod_uid

    @property
    def agent(self) -> AgentSeam:
        """The pod's agent (the embedded AgentRuntime when made by `connect`)."""
        return self.core.agent

    @property
    def timeout(self) -> float:
        return self.runner.timeout

    @property
    def token_file(self) -> Path | None:
        return self.core.token_file

    @property
    def incarnation(self) -> str:
        """This process's agent incarnation: a sender passes it to ``share`` so the claim dies with us."""
        return self.core.incarnation

    # ------------------------------------------------------------ construction helpers

    @classmethod
    def connect(
        cls,
        *,
        pod_name: str | None = None,
        namespace: str | None = None,
        pod_uid: str | None = None,
        token_file: str | Path | None = None,
        host: str = "0.0.0.0",
        port: int | None = None,
        kubeconfig: str | Path | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Client:
        """Start the embedded agent in this process and connect to the API server.

        In a pod, `Client.connect()` with no arguments reads the documented downward-API
        environment (docs/workload-pods.md): GPUOBJ_POD_NAME, GPUOBJ_POD_NAMESPACE, GPUOBJ_POD_UID,
        GPUOBJ_TOKEN_FILE, and optionally GPUOBJ_POD_IP and GPUOBJ_AGENT_PORT. With a wildcard
        ``host`` the agent advertises $GPUOBJ_POD_IP, so other pods reach it at the pod's address.
        """
        env = _pod_environment(
            pod_name=pod_name, namespace=namespace, pod_uid=pod_uid, token_file=token_file, port=port
        )
        pod_name, namespace, pod_uid, token_file, port = (
            env["pod_name"], env["namespace"], env["pod_uid"], env["token_file"], int(env["port"])
        )  # fmt: skip
        from gpuobj_agent.runtime import AgentRuntime

        agent = AgentRuntime(
            pod_name=pod_name,
            namespace=namespace,
            pod_uid=pod_uid,
            host=host,
            port=port,
            token_file=str(token_file),
            extra_routes=handoff_route.register,  # receivers' hand-off releases are this client's route
        )
        try:
            agent.start()
        except Exception as exc:
            raise errors.agent_error(exc, what=f"start the gpuobj agent on port {port}") from exc
        try:
            return cls(
                pod_name=pod_name,
                namespace=namespace,
                pod_uid=pod_uid,
                agent=agent,
                kubeconfig=kubeconfig,
                token_file=token_file,
                timeout=timeout,
                owns_agent=True,
            )
        except BaseException as exc:
            agent.stop()
            raise errors.agent_error(exc, what="connect to the API server") from exc

    # ------------------------------------------------------------ sync facade

    def put(
        self,
        tensors: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        copy: bool = False,
        shared_with: Sequence[str] = (),
    ) -> ObjectRef:
        """Store tensors (zero-copy unless `copy`) as a GPUObject whose source is this pod. Pods of this
        namespace may read it, and pods of the namespaces in `shared_with` (docs/security.md).

        A mapping of names to tensors (``model.state_dict()``) is one object too: copied into one pooled,
        registered buffer, fetched back as the same mapping (docs/weight-sync.md)."""
        return self.runner.call(
            self.core.put(tensors, name=name, labels=labels, copy=copy, shared_with=shared_with), "put"
        )

    def fetch(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu", select: Shard | None = None) -> Fetched:
        """The object's tensors: a list, or the mapping of names to tensors it was put as.

        `select` (gpuobj.Shard): only some names and/or one slice of each tensor along a dimension, read as
        one transfer of exactly those bytes (docs/weight-sync.md, "Sharded pulls")."""
        if select is None:
            tensors = self.core.fetch_direct(ref, device=device)  # a hand-off with a read grant: no loop hop
            if tensors is not None:
                return tensors
        return self.runner.call(self.core.fetch(ref, device=device, select=select), f"fetch {describe_ref(ref)}")

    def borrow(self, ref: ObjectRef | ObjectAddress, *, ttl: int | None = None) -> ObjectRef:
        """Claim for this process. ``ttl``: seconds after which the operator drops the claim regardless."""
        return self.runner.call(self.core.borrow(ref, ttl=ttl), f"borrow {describe_ref(ref)}")

    def share(
        self,
        ref: ObjectRef | ObjectAddress,
        pod_name: str,
        pod_uid: str | None = None,
        *,
        incarnation: str | None = None,
        ttl: int | None = None,
        read_once: bool = False,
    ) -> SharedRef:
        """Claim on ``pod_name``'s behalf. With the receiver's ``incarnation`` (its ``client.incarnation``) the
        claim dies with the receiver's process; without it, with the receiver's pod. ``ttl``: the operator
        drops the claim that many seconds after it was made, even if the receiver hangs. ``read_once``:
        the receiver's handle releases itself after its first completed fetch (a KV-style hand-off)."""
        return self.runner.call(
            self.core.share(ref, pod_name, pod_uid, incarnation, ttl=ttl, read_once=read_once),
            f"share {describe_ref(ref)} with pod {pod_name}",
        )

    def adopt(self, shared: SharedRef) -> ObjectRef:
        return self.core.adopt(shared)

    def release(self, ref: ObjectRef) -> None:
        """Drop a reference: an elided object is freed before this returns; otherwise its delete is
        queued (`flush` waits for it to land). Releases are never refused and never dropped."""
        self.runner.call(self.core.release(ref), f"release {describe_ref(ref)}")

    def flush(self, timeout: float | None = None) -> None:
        """Send every queued API write now and wait until all have landed."""
        self.runner.call(self.core.flush(timeout), "flush the queued API writes")

    async def aflush(self, timeout: float | None = None) -> None:
        await self._loop.acall(self.core.flush(timeout), self.timeout if timeout is None else timeout + 5)

    def pack_stats(self) -> dict[str, Any]:
        """State dicts' pack buffers (docs/weight-sync.md): made, reused, bytes, peak bytes holding versions."""
        return self.runner.read_state(self.core.packs.stats, "read the pack pool's stats")  # the pool is the loop's

    def write_stats(self) -> dict[str, Any]:
        """The write-behind queue: pending writes, families, sent, elided, retries, last error."""
        return self.runner.call(self.core.write_stats(), "read the write-behind stats")

    def publish(self, key: str, tensors: Any) -> None:
        """Offer tensors under a key, for a GPUObject declared with kubectl (spec.key) to bind."""
        try:
            self.core.publish(key, tensors)
        except Exception as exc:
            raise errors.agent_error(exc, what=f"publish {key!r}") from exc

    def get_object(self, name: str) -> dict[str, Any]:
        return self.runner.call(self.core.get_object(name), f"get GPUObject {name}")

    # ------------------------------------------------------------ async facade (asyncio workloads)

    async def aput(
        self,
        tensors: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        copy: bool = False,
        shared_with: Sequence[str] = (),
    ) -> ObjectRef:
        return await self.runner.acall(
            self.core.put(tensors, name=name, labels=labels, copy=copy, shared_with=shared_with), "put"
        )

    async def afetch(
        self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu", select: Shard | None = None
    ) -> Fetched:
        return await self.runner.acall(self.core.fetch(ref, device=device, select=select), f"fetch {describe_ref(ref)}")

    async def aborrow(self, ref: ObjectRef | ObjectAddress, *, ttl: int | None = None) -> ObjectRef:
        return await self.runner.acall(self.core.borrow(ref, ttl=ttl), f"borrow {describe_ref(ref)}")

    async def ashare(
        self,
        ref: ObjectRef | ObjectAddress,
        pod_name: str,
        pod_uid: str | None = None,
        *,
        incarnation: str | None = None,
        ttl: int | None = None,
        read_once: bool = False,
    ) -> SharedRef:
        return await self.runner.acall(
            self.core.share(ref, pod_name, pod_uid, incarnation, ttl=ttl, read_once=read_once),
            f"share {describe_ref(ref)} with {pod_name}",
        )

    async def arelease(self, ref: ObjectRef) -> None:
        await self.runner.acall(self.core.release(ref), f"release {describe_ref(ref)}")

    # ------------------------------------------------------------ streams

    def stream_writer(self, name: str) -> StreamWriter:
        """Create the GPUObjectStream ``name`` with this pod as producer."""
        return self.runner.call(StreamWriter.acreate(self.core, self.runner, name), f"create stream {name}")

    async def astream_writer(self, name: str) -> StreamWriter:
        return await self._loop.acall(StreamWriter.acreate(self.core, self.runner, name), self.timeout)

    def read_stream(self, name: str, *, device: str = "cpu", item_timeout: float = DEFAULT_TIMEOUT) -> StreamReader:
        """Iterate (``for`` or ``async for``) over the stream's items in order; each is released once read."""
        return StreamReader(self.core, self.runner, name, device=device, item_timeout=item_timeout)

    def delete_stream(self, name: str) -> None:
        """Delete the stream: every item in it is freed, reported or not."""
        self.runner.call(self.core.delete_stream(name), f"delete stream {name}")

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Release what is pending, cancel the core's tasks on the loop and then, if it owns one, stop the
        embedded agent (its loop with it). Every step waits with a bound."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        core = self.core
        # Release every handle still alive (whatever order atexit runs finalizers in), then flush.
        for ref in list(core.live):
            ref.release()
        try:
            if self._loop.running:
                self._loop.call(core.releases.drain(), timeout=min(self.timeout, 30))
                if core.wb is not None:
                    try:
                        self._loop.call(
                            core.wb.flush(min(self.timeout, 30), raise_refused=False), timeout=min(self.timeout, 30) + 5
                        )
                    finally:
                        self._loop.call(core.close_writes(), timeout=5)
                self._loop.call(core.close_connections(), timeout=5)
        except Exception as exc:
            log.warning("gpuobj client shutdown: %s", exc)
        finally:
            with contextlib.suppress(Exception):  # the loop is the agent's: only the core's own tasks go
                if self._loop.running:
                    self._loop.call(self._end_tasks(), timeout=10)
            if self._own_loop is not None:
                self._own_loop.stop()
            if self._owns_agent:
                from gpuobj_agent.runtime import AgentRuntime

                if isinstance(self.agent, AgentRuntime):  # the one `connect` started
                    with contextlib.suppress(Exception):
                        self.agent.stop()

    async def _end_tasks(self) -> None:
        """On the loop: hand-off releases at the agent no longer come here, and the core's tasks end."""
        if self.core.wb is not None:
            handoff_route.unbind(self.core.agent.incarnation, self.core.handoff_sink)
        await cancel_tasks(self._tasks, timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
