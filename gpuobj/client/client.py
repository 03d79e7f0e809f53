"""The client library workloads call: put, fetch, borrow, share, adopt, release, publish, streams.

Kubernetes side: GPUObjects (with the gpuobj.io/free finalizer) and GPUObjectClaims (owned
by the holder pod) are written behind the caller (writebehind.py): `put`, `share` and
`release` return once the bytes are stored and the writes queued; an object whose whole
life fits in the write window is never written at all (docs/write-behind.md).
`flush()` waits until everything queued has landed. Byte side: the pod's embedded agent
(gpuobj_agent.runtime.AgentRuntime) stores, registers and reads with NIXL; a hand-off
carries a read grant, so the receiver's fetch makes no request to the source.

Every public call has a sync form for ordinary code and an ``a``-prefixed async form for
asyncio workloads; both run the I/O on the client's own loop thread with a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuobj.client import errors
from gpuobj.client.errors import FetchError, ObjectLostError, ObjectNotFoundError
from gpuobj.client.handles import ObjectAddress, ObjectRef, SharedRef, TensorLayout
from gpuobj.client.loop import LoopThread
from gpuobj.client.streams import StreamReader, StreamWriter, adelete_stream
from gpuobj.client.writebehind import DEFAULT_MAX_PENDING, DEFAULT_WINDOW, WriteBehind
from gpuobj_agent.layouts import layout_of
from gpuobj_contract import agent_api as api
from gpuobj_contract import names
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, Conflict, KubeClient, NotFound
from gpuobj_kube.config import KubeConfig
from gpuobj_kube.config import load as load_kubeconfig

log = logging.getLogger("gpuobj.client")

DEFAULT_TIMEOUT = 60.0
POD_UID_TTL = 30.0
# A fetch that failed because the source's process is gone waits this long for the operator to say Lost
# (it probes agents every second or so), so the reader gets ObjectLostError, as for a deleted pod.
LOST_WAIT = 5.0
HANDOFF_RELEASE_TIMEOUT = 5.0

Release = tuple[str, str, str, str, "str | None"]  # (kind, namespace, name, uid, via)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number, not {raw!r}") from None


def _short_id() -> str:
    return uuid.uuid4().hex


def _at_shutdown(fn) -> None:
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
    values["port"] = values["port"] or names.DEFAULT_AGENT_PORT
    missing = [sources[k] for k, v in values.items() if not v]
    if missing:
        raise errors.ConfigurationError(
            f"Client.connect(): {', '.join(missing)} not set; in a pod set them from the downward API "
            "(see docs/workload-pods.md and deploy/examples/workload-pod.yaml), or pass the arguments"
        )
    try:
        values["port"] = int(values["port"])
    except ValueError:
        raise errors.ConfigurationError(f"{agent_config.PORT_ENV}={values['port']!r} is not a port number") from None
    return values


def _describe(ref: Any) -> str:
    address = getattr(ref, "address", ref)
    return f"GPUObject {getattr(address, 'namespace', '?')}/{getattr(address, 'name', '?')}"


def _live_address(ref: ObjectRef | ObjectAddress, action: str) -> ObjectAddress:
    """The address of a handle that still holds its reference; a released one refuses (it no longer keeps the bytes)."""
    if isinstance(ref, ObjectRef):
        if ref.kind != "address" and not ref.alive:
            raise errors.ReleasedHandleError(
                f"cannot {action} {_describe(ref)}: this handle was released; borrow or adopt a new reference"
            )
        return ref.address
    if isinstance(ref, ObjectAddress):
        return ref
    raise TypeError(f"cannot {action} {type(ref).__name__}: expected an ObjectRef or ObjectAddress")


def _tensor_list(tensors: Any, *, what: str) -> list:
    """A list of torch tensors from a tensor or a list/tuple of them; anything else is a clear error."""
    import torch

    items = list(tensors) if isinstance(tensors, list | tuple) else [tensors]
    if not items:
        raise errors.InvalidTensorError(f"{what}: no tensors given (pass a tensor or a non-empty list of tensors)")
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise errors.InvalidTensorError(
                f"{what}: item {i} is a {type(t).__name__}, not a torch.Tensor "
                "(pass a tensor or a list/tuple of tensors; convert with torch.as_tensor)"
            )
    return items


def _source_may_be_gone(exc: BaseException) -> bool:
    """The source agent refused us or no longer knows the object: its process may have died (or freed it)."""
    from gpuobj_agent.errors import ObjectGone, SourceUnavailable

    return isinstance(exc, SourceUnavailable | ObjectGone)


class Client:
    """One per workload process. Starts (or wraps) the pod's agent and talks to the API server."""

    def __init__(
        self,
        *,
        pod_name: str,
        namespace: str,
        pod_uid: str,
        agent: Any,
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
        raises WriteBehindFullError."""
        self.pod_name = pod_name
        self.namespace = namespace
        self.pod_uid = pod_uid
        self.agent = agent
        self.timeout = timeout
        self.token_file = Path(token_file) if token_file else None
        self._owns_agent = owns_agent
        self._loop = LoopThread()
        config = kube_config or load_kubeconfig(kubeconfig)
        self._kube: KubeClient = self._loop.call(self._make_kube(config), timeout)
        # Releases queued by handle finalizers (any thread, even during interpreter shutdown).
        self._releases: queue.SimpleQueue[tuple[str, str, str, str]] = queue.SimpleQueue()
        self._release_event = asyncio.Event()
        self._release_lock = asyncio.Lock()
        self._live: weakref.WeakSet[ObjectRef] = weakref.WeakSet()
        self._read_once: weakref.WeakSet[ObjectRef] = weakref.WeakSet()
        self._pod_uids: dict[tuple[str, str], tuple[str, float]] = {}
        self._reading_lock = threading.Lock()
        self._reading: dict[str, int] = {}  # claim name -> fetches in flight under it
        self._deferred: dict[str, list[Release]] = {}  # releases waiting for those fetches
        self._http: Any = None  # aiohttp session for hand-off releases, made on first use
        if write_behind is None:
            write_behind = os.environ.get("GPUOBJ_WRITE_BEHIND", "1") not in ("0", "false", "no")
        self._wb: WriteBehind | None = None
        if write_behind:
            self._wb = WriteBehind(
                self._kube,
                free_local=self._free_local,
                window=write_window if write_window is not None else _env_float("GPUOBJ_WRITE_WINDOW", DEFAULT_WINDOW),
                max_pending=int(
                    max_pending_writes
                    if max_pending_writes is not None
                    else _env_float("GPUOBJ_MAX_PENDING_WRITES", DEFAULT_MAX_PENDING)
                ),
                backpressure_timeout=backpressure_timeout
                if backpressure_timeout is not None
                else _env_float("GPUOBJ_BACKPRESSURE_TIMEOUT", timeout),
            )
            if hasattr(agent, "set_handoff_sink"):
                agent.set_handoff_sink(self._handoff_sink)
        self._release_task = self._loop.submit(self._release_worker())
        self._closed = False
        _at_shutdown(self.close)

    @staticmethod
    async def _make_kube(config: KubeConfig) -> KubeClient:
        return KubeClient(config)

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
            pod_name=pod_name, namespace=namespace, pod_uid=pod_uid, host=host, port=port, token_file=str(token_file)
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

    def _call(self, coro, what: str):
        """Run on the client loop; whatever goes wrong underneath comes out as a GpuObjError."""
        try:
            return self._loop.call(coro, self.timeout)
        except BaseException as exc:
            err = errors.agent_error(exc, what=what)
            if err is exc:
                raise
            raise err from exc

    async def _acall(self, coro, what: str):
        try:
            return await self._loop.acall(coro, self.timeout)
        except BaseException as exc:
            err = errors.agent_error(exc, what=what)
            if err is exc:
                raise
            raise err from exc

    def put(
        self, tensors: Any, *, name: str | None = None, labels: dict[str, str] | None = None, copy: bool = False
    ) -> ObjectRef:
        """Store tensors (zero-copy unless `copy`) as a GPUObject whose source is this pod."""
        return self._call(self.aput_inner(tensors, name=name, labels=labels, copy=copy), "put")

    def fetch(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu") -> list:
        if (
            isinstance(ref, ObjectRef)
            and ref.grant is not None
            and ref.claim_name
            and hasattr(self.agent, "fetch_granted_direct")
        ):
            # A hand-off with a read grant: read in this thread, with no loop hop and no request.
            claim = ref.claim_name
            self._begin_read(claim)
            try:
                if ref.alive:
                    address = ref.address
                    with contextlib.suppress(Exception):  # stale grant or error: the full path says why
                        tensors = self.agent.fetch_granted_direct(
                            address.source_endpoint, address.object_id, ref.grant, device=device, timeout=self.timeout
                        )
                        if ref in self._read_once:
                            ref.release()  # a read-once hand-off: its one read is done (lands after _end_read)
                        return tensors
            finally:
                self._end_read(claim)
        return self._call(self.afetch_inner(ref, device=device), f"fetch {_describe(ref)}")

    def borrow(self, ref: ObjectRef | ObjectAddress, *, ttl: int | None = None) -> ObjectRef:
        """Claim for this process. ``ttl``: seconds after which the operator drops the claim regardless."""
        return self._call(self.aborrow_inner(ref, ttl=ttl), f"borrow {_describe(ref)}")

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
        return self._call(
            self.ashare_inner(ref, pod_name, pod_uid, incarnation, ttl=ttl, read_once=read_once),
            f"share {_describe(ref)} with pod {pod_name}",
        )

    def adopt(self, shared: SharedRef) -> ObjectRef:
        return self._adopt(shared)

    def release(self, ref: ObjectRef) -> None:
        """Drop a reference: an elided object is freed before this returns; otherwise its delete is
        queued (`flush` waits for it to land). Releases are never refused and never dropped."""
        self._call(self.arelease_inner(ref), f"release {_describe(ref)}")

    def flush(self, timeout: float | None = None) -> None:
        """Send every queued API write now and wait until all have landed."""
        self._call(self.aflush_inner(timeout), "flush the queued API writes")

    async def aflush(self, timeout: float | None = None) -> None:
        await self._loop.acall(self.aflush_inner(timeout), self.timeout if timeout is None else timeout + 5)

    async def aflush_inner(self, timeout: float | None = None) -> None:
        await self._drain_releases()
        if self._wb is not None:
            await self._wb.flush(self.timeout if timeout is None else timeout)

    def write_stats(self) -> dict:
        """The write-behind queue: pending writes, families, sent, elided, retries, last error."""
        return self._call(self._astats(), "read the write-behind stats")

    async def _astats(self) -> dict:
        return self._wb.stats() if self._wb is not None else {"pending": 0}

    def publish(self, key: str, tensors: Any) -> None:
        """Offer tensors under a key, for a GPUObject declared with kubectl (spec.key) to bind."""
        try:
            self.agent.publish(key, _tensor_list(tensors, what=f"publish {key!r}"))
        except Exception as exc:
            raise errors.agent_error(exc, what=f"publish {key!r}") from exc

    def get_object(self, name: str) -> dict:
        return self._call(self._kube.get(GPUOBJECTS, name, self.namespace), f"get GPUObject {name}")

    # ------------------------------------------------------------ async facade (asyncio workloads)

    async def aput(
        self, tensors: Any, *, name: str | None = None, labels: dict[str, str] | None = None, copy: bool = False
    ) -> ObjectRef:
        return await self._acall(self.aput_inner(tensors, name=name, labels=labels, copy=copy), "put")

    async def afetch(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu") -> list:
        return await self._acall(self.afetch_inner(ref, device=device), f"fetch {_describe(ref)}")

    async def aborrow(self, ref: ObjectRef | ObjectAddress, *, ttl: int | None = None) -> ObjectRef:
        return await self._acall(self.aborrow_inner(ref, ttl=ttl), f"borrow {_describe(ref)}")

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
        return await self._acall(
            self.ashare_inner(ref, pod_name, pod_uid, incarnation, ttl=ttl, read_once=read_once),
            f"share {_describe(ref)} with {pod_name}",
        )

    async def arelease(self, ref: ObjectRef) -> None:
        await self._acall(self.arelease_inner(ref), f"release {_describe(ref)}")

    # ------------------------------------------------------------ implementation (runs on the client loop)

    def object_body(
        self,
        name: str,
        object_id: str,
        layouts: Sequence[TensorLayout],
        *,
        labels: dict[str, str] | None = None,
        stream: tuple[str, int, str] | None = None,
    ) -> dict:
        meta: dict = {
            "name": name,
            "finalizers": [names.FINALIZER_FREE],
            "labels": {names.LABEL_SOURCE_POD: self.pod_name, **(labels or {})},
            "annotations": {names.ANNOTATION_SOURCE_ENDPOINT: self.agent.endpoint},
        }
        spec: dict = {
            "source": {"podName": self.pod_name, "podUID": self.pod_uid, **self._incarnation_field()},
            "objectId": object_id,
            "tensors": [t.to_json() for t in layouts],
        }
        if stream is not None:
            stream_name, index, stream_uid = stream
            meta["labels"][names.LABEL_STREAM] = stream_name
            meta["ownerReferences"] = [
                {
                    "apiVersion": names.API_VERSION,
                    "kind": names.KIND_STREAM,
                    "name": stream_name,
                    "uid": stream_uid,
                }
            ]
            spec["stream"] = {"name": stream_name, "index": index}
        return {"metadata": meta, "spec": spec}

    async def aput_inner(
        self,
        tensors: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        stream: tuple[str, int, str] | None = None,
        copy: bool = False,
    ) -> ObjectRef:
        tensors = _tensor_list(tensors, what="put")
        object_id = f"o-{_short_id()}"
        name = name or f"{self.pod_name}-{object_id[2:12]}"
        layouts = tuple(layout_of(t) for t in tensors)
        stream_kw = {"stream": stream[0], "stream_index": stream[1]} if stream else {}
        await self.agent.aput(object_id, tensors, copy=copy, **stream_kw)
        if self._wb is not None and stream is None:
            body = self.object_body(name, object_id, layouts, labels=labels)
            try:
                record = await self._wb.create_object(self.namespace, name, body, object_id)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.agent.afree(object_id)
                raise
            address = ObjectAddress(self.namespace, name, "", object_id, self.pod_name, self.agent.endpoint, layouts)
            return self._track(ObjectRef(address, "owner", self._enqueue_release, record=record))
        try:
            created = await self._kube.create(
                GPUOBJECTS, self.object_body(name, object_id, layouts, labels=labels, stream=stream), self.namespace
            )
        except BaseException:
            # The write failed: nothing in the API references these bytes, so free them now (seed 003).
            with contextlib.suppress(Exception):
                await self.agent.afree(object_id)
            raise
        address = ObjectAddress(
            self.namespace, name, created["metadata"]["uid"], object_id, self.pod_name, self.agent.endpoint, layouts
        )
        return self._track(ObjectRef(address, "owner", self._enqueue_release))

    async def afetch_inner(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu") -> list:
        address = _live_address(ref, "fetch")  # a released handle refuses
        granted = isinstance(ref, ObjectRef) and ref.grant is not None and ref.claim_name is not None
        claim = ref.claim_name if granted else None  # type: ignore[union-attr]
        if claim is not None:
            self._begin_read(claim)  # its release waits for this read
        try:
            # The runtime's async API runs on the agent's own loop: no thread is blocked waiting.
            if claim is not None:
                tensors = await self.agent.afetch_granted(
                    address.source_endpoint,
                    address.object_id,
                    ref.grant,
                    device=device,
                    token=self._token(),  # type: ignore[union-attr]
                )
            else:
                tensors = await self.agent.afetch(
                    address.source_endpoint, address.object_id, device=device, token=self._token()
                )
            if isinstance(ref, ObjectRef) and ref in self._read_once:
                await self.arelease_inner(ref)  # a read-once hand-off: its one read is done
            return tensors
        except Exception as exc:
            # Say why: a Lost object (source gone) reads differently from a freed one.
            deadline = time.monotonic() + (LOST_WAIT if _source_may_be_gone(exc) else 0.0)
            while True:
                try:
                    obj = await self._kube.get(GPUOBJECTS, address.name, address.namespace)
                except NotFound:
                    raise ObjectNotFoundError(
                        f"GPUObject {address.namespace}/{address.name} no longer exists (freed): {exc}"
                    ) from exc
                if (obj.get("status") or {}).get("state") == names.STATE_LOST or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.25)
            status = obj.get("status") or {}
            if status.get("state") == names.STATE_LOST:
                reason = next(
                    (
                        c.get("message")
                        for c in status.get("conditions", [])
                        if c.get("type") == names.CONDITION_SOURCE_AVAILABLE
                    ),
                    "source gone",
                )
                raise ObjectLostError(f"GPUObject {address.namespace}/{address.name} is Lost: {reason}") from exc
            raise FetchError(
                f"fetching {address.namespace}/{address.name} from {address.source_endpoint} failed: {exc}"
            ) from exc
        finally:
            if claim is not None:
                self._end_read(claim)

    def _begin_read(self, claim: str) -> None:
        with self._reading_lock:
            self._reading[claim] = self._reading.get(claim, 0) + 1

    def _end_read(self, claim: str) -> None:
        """Any thread: the read under `claim` ended; releases it held back go to the queue now."""
        with self._reading_lock:
            left = self._reading.get(claim, 1) - 1
            if left > 0:
                self._reading[claim] = left
                return
            self._reading.pop(claim, None)
            deferred = self._deferred.pop(claim, [])
        if deferred:
            for release in deferred:
                self._releases.put(release)
            with contextlib.suppress(RuntimeError):
                self._loop.loop.call_soon_threadsafe(self._release_event.set)

    def _token(self) -> str | None:
        return self.token_file.read_text().strip() if self.token_file else None

    @property
    def incarnation(self) -> str | None:
        """This process's agent incarnation: a sender passes it to ``share`` so the claim dies with us."""
        return getattr(self.agent, "incarnation", None)

    def _incarnation_field(self, incarnation: str | None = None) -> dict:
        value = incarnation or self.incarnation
        return {"incarnation": value} if value else {}

    def _claim_body(
        self,
        address: ObjectAddress,
        holder_pod: str,
        holder_uid: str,
        incarnation: str | None = None,
        ttl: int | None = None,
    ) -> dict:
        if ttl is not None and (not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"ttl must be a whole number of seconds >= 1, not {ttl!r}")
        spec: dict = {
            "objectName": address.name,
            # Scoped to a process: ours, or the receiver's when the sender knows it.
            "holder": {"podName": holder_pod, **({"incarnation": incarnation} if incarnation else {})},
            **({"ttlSeconds": ttl} if ttl else {}),
        }
        if address.uid:
            spec["objectUID"] = address.uid  # else the write-behind pins the uid it created
        return {
            "metadata": {
                "name": f"{address.name[:200]}-{holder_pod[:40]}-{_short_id()[:6]}",
                "labels": {names.LABEL_OBJECT: address.name[:63]},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": holder_pod, "uid": holder_uid}],
                # On a receiver's behalf: say who shares, so admission can check it is us (docs/security.md).
                **({"annotations": {names.ANNOTATION_SHARED_BY: self.pod_name}} if holder_pod != self.pod_name else {}),
            },
            "spec": spec,
        }

    async def _create_claim(
        self,
        address: ObjectAddress,
        holder_pod: str,
        holder_uid: str,
        incarnation: str | None = None,
        ttl: int | None = None,
    ) -> dict:
        body = self._claim_body(address, holder_pod, holder_uid, incarnation, ttl)
        return await self._kube.create(CLAIMS, body, address.namespace)

    async def aborrow_inner(self, ref: ObjectRef | ObjectAddress, ttl: int | None = None) -> ObjectRef:
        address = _live_address(ref, "borrow")
        if self._wb is not None:
            body = self._claim_body(address, self.pod_name, self.pod_uid, self.incarnation, ttl)
            name = body["metadata"]["name"]
            record = await self._wb.create_claim(address.namespace, address.name, name, body)
            return self._track(
                ObjectRef(address, "claim", self._enqueue_release, claim_name=name, claim_uid="", record=record)
            )
        created = await self._create_claim(address, self.pod_name, self.pod_uid, self.incarnation, ttl)
        return self._track(
            ObjectRef(
                address,
                "claim",
                self._enqueue_release,
                claim_name=created["metadata"]["name"],
                claim_uid=created["metadata"]["uid"],
            )
        )

    async def ashare_inner(
        self,
        ref: ObjectRef | ObjectAddress,
        pod_name: str,
        pod_uid: str | None,
        incarnation: str | None = None,
        *,
        ttl: int | None = None,
        read_once: bool = False,
    ) -> SharedRef:
        address = _live_address(ref, "share")
        if pod_uid is None:
            pod_uid = await self._pod_uid(address.namespace, pod_name)
        if self._wb is not None:
            body = self._claim_body(address, pod_name, pod_uid, incarnation, ttl)
            name = body["metadata"]["name"]
            await self._wb.create_claim(address.namespace, address.name, name, body)
            grant = None
            if address.source_endpoint == self.agent.endpoint:
                # Our own object: the receiver reads it with no request here (the claim keeps it).
                with contextlib.suppress(Exception):
                    grant = await self.agent.agrant(address.object_id)
            return SharedRef(
                address, name, "", pod_name, read_once=read_once, grant=grant, release_via=self.agent.endpoint
            )
        created = await self._create_claim(address, pod_name, pod_uid, incarnation, ttl)
        return SharedRef(address, created["metadata"]["name"], created["metadata"]["uid"], pod_name, read_once)

    async def _pod_uid(self, namespace: str, pod_name: str) -> str:
        """The receiver's current incarnation, cached briefly: a claim made for an incarnation that has
        since died is garbage-collected with it, which is right, since that receiver can no longer adopt it."""
        now = time.monotonic()
        cached = self._pod_uids.get((namespace, pod_name))
        if cached and now - cached[1] < POD_UID_TTL:
            return cached[0]
        try:
            uid = (await self._kube.get(PODS, pod_name, namespace))["metadata"]["uid"]
        except NotFound:
            raise errors.PodNotFoundError(
                f"pod {namespace}/{pod_name} does not exist: share with a running pod (check its name)"
            ) from None
        self._pod_uids[(namespace, pod_name)] = (uid, now)
        return uid

    def _adopt(self, shared: SharedRef) -> ObjectRef:
        if shared.holder_pod != self.pod_name:
            raise errors.GpuObjError(
                f"this reference was shared with pod {shared.holder_pod}, not {self.pod_name}: "
                f"share it with {self.pod_name} instead"
            )
        ref = self._track(
            ObjectRef(
                shared.address,
                "claim",
                self._enqueue_release,
                claim_name=shared.claim_name,
                claim_uid=shared.claim_uid,
                grant=shared.grant,
                via=shared.release_via,
            )
        )
        if shared.read_once:
            self._read_once.add(ref)
        return ref

    def _track(self, ref: ObjectRef) -> ObjectRef:
        self._live.add(ref)
        return ref

    async def arelease_inner(self, ref: ObjectRef) -> None:
        if not ref.alive:
            return
        ref.release()  # queues it (any thread may release); drain now so an elided free happens before we return
        await self._drain_releases()

    async def _delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        res = GPUOBJECTS if kind == "object" else CLAIMS
        try:
            await self._kube.delete(res, name, namespace, uid=uid)
        except (NotFound, Conflict):
            pass  # already gone, or a successor of the same name that is not ours

    # ------------------------------------------------------------ streams

    def stream_writer(self, name: str) -> StreamWriter:
        """Create the GPUObjectStream ``name`` with this pod as producer."""
        return self._call(StreamWriter.acreate(self, name), f"create stream {name}")

    async def astream_writer(self, name: str) -> StreamWriter:
        return await self._loop.acall(StreamWriter.acreate(self, name), self.timeout)

    def read_stream(self, name: str, *, device: str = "cpu", item_timeout: float = DEFAULT_TIMEOUT) -> StreamReader:
        """Iterate (``for`` or ``async for``) over the stream's items in order; each is released once read."""
        return StreamReader(self, name, device=device, item_timeout=item_timeout)

    def delete_stream(self, name: str) -> None:
        """Delete the stream: every item in it is freed, reported or not."""
        self._call(adelete_stream(self, name), f"delete stream {name}")

    # ------------------------------------------------------------ releases from finalizers

    def _enqueue_release(self, kind: str, namespace: str, name: str, uid: str, via: str | None = None) -> None:
        """Called by a handle's finalizer: queue plain data, never block, never raise."""
        self._releases.put((kind, namespace, name, uid, via))
        try:
            self._loop.loop.call_soon_threadsafe(self._release_event.set)
        except RuntimeError:
            pass  # loop already closed: close() drains the queue itself

    async def _release_worker(self) -> None:
        while True:
            await self._release_event.wait()
            self._release_event.clear()
            await self._drain_releases()

    async def _drain_releases(self) -> None:
        # One drainer at a time: close() must not return while the worker is mid-delete.
        async with self._release_lock:
            await self._drain_unlocked()

    async def _drain_unlocked(self) -> None:
        while True:
            try:
                release = self._releases.get_nowait()
            except queue.Empty:
                return
            kind, namespace, name, uid, via = release
            if kind == "claim":
                with self._reading_lock:
                    if name in self._reading:
                        self._deferred.setdefault(name, []).append(release)  # a fetch under it is in flight
                        continue
            try:
                await self._process_release(kind, namespace, name, uid, via)
            except Exception as exc:
                log.warning("release of %s %s/%s failed: %s", kind, namespace, name, exc)

    async def _process_release(self, kind: str, namespace: str, name: str, uid: str, via: str | None) -> None:
        if self._wb is None:
            await self._delete(kind, namespace, name, uid)
            return
        # A hand-off: the source queued this claim, so the source takes its release (it may never
        # have been recorded). If the source does not know it (restarted) or is gone, delete it here.
        if kind == "claim" and via and via != self.agent.endpoint and await self._release_at_source(via, name):
            return
        outcome = self._wb.release(kind, namespace, name, uid)
        if outcome.free_object_id is not None:
            await self._free_local(outcome.free_object_id)

    async def _free_local(self, object_id: str) -> None:
        """Free an object of our own agent that nothing recorded (elided, or its record was refused)."""
        await self.agent.afree(object_id)

    async def _release_at_source(self, via: str, claim: str) -> bool:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        token = self._token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with self._http.post(
                f"http://{via}{api.RELEASE_HANDOFF.path(claim=claim)}",
                json={},
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=HANDOFF_RELEASE_TIMEOUT),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("hand-off release of %s at %s: %s; deleting it in the API", claim, via, exc)
            return False

    async def _handoff_sink(self, claim: str) -> bool:
        """On the agent's loop: a receiver released a claim we made for it. Handled on our loop."""
        return await asyncio.wrap_future(self._loop.submit(self._handoff_release(claim)))

    async def _handoff_release(self, claim: str) -> bool:
        if self._wb is None:
            return False
        found = self._wb.find("claim", self.namespace, claim)
        if found is None:
            return False
        rec = found[1]
        outcome = self._wb.release("claim", rec.namespace, claim, rec.uid)
        if outcome.free_object_id is not None:
            await self._free_local(outcome.free_object_id)
        return True

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Release what is pending, stop the client loop and, if it owns one, the embedded agent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        # Release every handle still alive (whatever order atexit runs finalizers in), then flush.
        for ref in list(self._live):
            ref.release()
        try:
            if self._loop.running:
                self._loop.call(self._drain_releases(), timeout=min(self.timeout, 30))
                if self._wb is not None:
                    try:
                        self._loop.call(self._wb.flush(min(self.timeout, 30)), timeout=min(self.timeout, 30) + 5)
                    finally:
                        self._loop.call(self._wb.close(), timeout=5)
                if self._http is not None:
                    self._loop.call(self._http.close(), timeout=5)
                self._loop.call(self._kube.close(), timeout=5)
        except Exception as exc:
            log.warning("gpuobj client shutdown: %s", exc)
        finally:
            self._release_task.cancel()
            self._loop.stop()
            if self._owns_agent:
                with contextlib.suppress(Exception):
                    self.agent.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
