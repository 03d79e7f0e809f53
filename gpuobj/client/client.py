"""The client library workloads call: put, fetch, borrow, share, adopt, release, publish, streams.

Kubernetes side: `put` records the GPUObject (with the gpuobj.io/free finalizer) before it
returns, so its handle can be referenced at once; claims are GPUObjectClaims owned by the
holder pod. Byte side: the pod's embedded agent (gpuobj_agent.runtime.AgentRuntime)
stores, registers and reads with NIXL.

Every public call has a sync form for ordinary code and an ``a``-prefixed async form for
asyncio workloads; both run the I/O on the client's own loop thread with a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuobj.client.errors import FetchError, ObjectLostError, ObjectNotFoundError
from gpuobj.client.handles import ObjectAddress, ObjectRef, SharedRef, TensorLayout
from gpuobj.client.loop import LoopThread
from gpuobj.client.streams import StreamReader, StreamWriter, adelete_stream
from gpuobj_contract import names
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, Conflict, KubeClient, NotFound
from gpuobj_kube.config import KubeConfig
from gpuobj_kube.config import load as load_kubeconfig

log = logging.getLogger("gpuobj.client")

DEFAULT_TIMEOUT = 60.0
POD_UID_TTL = 30.0


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


def layout_of(tensor: Any) -> TensorLayout:
    return TensorLayout(
        tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch."), str(tensor.device)
    )


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
    ) -> None:
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
        self._pod_uids: dict[tuple[str, str], tuple[str, float]] = {}
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
        pod_name: str,
        namespace: str,
        pod_uid: str,
        token_file: str | Path,
        host: str = "0.0.0.0",
        port: int = names.DEFAULT_AGENT_PORT,
        kubeconfig: str | Path | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Client:
        """Start the embedded agent in this process and connect to the API server.

        With a wildcard ``host`` the agent advertises $GPUOBJ_POD_IP (the downward API's
        status.podIP), so other pods reach it at the pod's address.
        """
        from gpuobj_agent.runtime import AgentRuntime

        agent = AgentRuntime(
            pod_name=pod_name, namespace=namespace, pod_uid=pod_uid, host=host, port=port, token_file=str(token_file)
        )
        agent.start()
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
        except BaseException:
            agent.stop()
            raise

    # ------------------------------------------------------------ sync facade

    def _call(self, coro):
        return self._loop.call(coro, self.timeout)

    def put(
        self,
        tensors: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        shared_with: Sequence[str] = (),
    ) -> ObjectRef:
        """Store and record an object. Pods of this namespace may read it, and of those in `shared_with`."""
        return self._call(self.aput_inner(tensors, name=name, labels=labels, shared_with=shared_with))

    def fetch(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu") -> list:
        return self._call(self.afetch_inner(ref, device=device))

    def borrow(self, ref: ObjectRef | ObjectAddress) -> ObjectRef:
        return self._call(self.aborrow_inner(ref))

    def share(self, ref: ObjectRef | ObjectAddress, pod_name: str, pod_uid: str | None = None) -> SharedRef:
        return self._call(self.ashare_inner(ref, pod_name, pod_uid))

    def adopt(self, shared: SharedRef) -> ObjectRef:
        return self._adopt(shared)

    def release(self, ref: ObjectRef) -> None:
        """Drop a reference and wait until the API has it (deleted claim or GPUObject)."""
        self._call(self.arelease_inner(ref))

    def publish(self, key: str, tensors: Any) -> None:
        """Offer tensors under a key, for a GPUObject declared with kubectl (spec.key) to bind."""
        self.agent.publish(key, list(tensors) if isinstance(tensors, list | tuple) else [tensors])

    def get_object(self, name: str) -> dict:
        return self._call(self._kube.get(GPUOBJECTS, name, self.namespace))

    # ------------------------------------------------------------ async facade (asyncio workloads)

    async def aput(
        self,
        tensors: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        shared_with: Sequence[str] = (),
    ) -> ObjectRef:
        return await self._loop.acall(
            self.aput_inner(tensors, name=name, labels=labels, shared_with=shared_with), self.timeout
        )

    async def afetch(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu") -> list:
        return await self._loop.acall(self.afetch_inner(ref, device=device), self.timeout)

    async def aborrow(self, ref: ObjectRef | ObjectAddress) -> ObjectRef:
        return await self._loop.acall(self.aborrow_inner(ref), self.timeout)

    async def ashare(self, ref: ObjectRef | ObjectAddress, pod_name: str, pod_uid: str | None = None) -> SharedRef:
        return await self._loop.acall(self.ashare_inner(ref, pod_name, pod_uid), self.timeout)

    async def arelease(self, ref: ObjectRef) -> None:
        await self._loop.acall(self.arelease_inner(ref), self.timeout)

    # ------------------------------------------------------------ implementation (runs on the client loop)

    def object_body(
        self,
        name: str,
        object_id: str,
        layouts: Sequence[TensorLayout],
        *,
        labels: dict[str, str] | None = None,
        stream: tuple[str, int, str] | None = None,
        shared_with: Sequence[str] = (),
    ) -> dict:
        meta: dict = {
            "name": name,
            "finalizers": [names.FINALIZER_FREE],
            "labels": {names.LABEL_SOURCE_POD: self.pod_name, **(labels or {})},
            "annotations": {names.ANNOTATION_SOURCE_ENDPOINT: self.agent.endpoint},
        }
        spec: dict = {
            "source": {"podName": self.pod_name, "podUID": self.pod_uid},
            "objectId": object_id,
            "tensors": [t.to_spec() for t in layouts],
        }
        if shared_with:
            spec["sharedWith"] = list(shared_with)
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
        shared_with: Sequence[str] = (),
    ) -> ObjectRef:
        tensors = list(tensors) if isinstance(tensors, list | tuple) else [tensors]
        object_id = f"o-{_short_id()}"
        name = name or f"{self.pod_name}-{object_id[2:12]}"
        layouts = tuple(layout_of(t) for t in tensors)
        stream_kw: dict[str, Any] = {"stream": stream[0], "stream_index": stream[1]} if stream else {}
        if shared_with:
            stream_kw["shared_with"] = tuple(shared_with)
        await self.agent.aput(object_id, tensors, **stream_kw)
        try:
            created = await self._kube.create(
                GPUOBJECTS,
                self.object_body(name, object_id, layouts, labels=labels, stream=stream, shared_with=shared_with),
                self.namespace,
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
        address = ref.address if isinstance(ref, ObjectRef) else ref
        try:
            # The runtime's async API runs on the agent's own loop: no thread is blocked waiting.
            return await self.agent.afetch(
                address.source_endpoint, address.object_id, device=device, token=self._token()
            )
        except Exception as exc:
            # Say why: a Lost object (source gone) reads differently from a freed one.
            try:
                obj = await self._kube.get(GPUOBJECTS, address.name, address.namespace)
            except NotFound:
                raise ObjectNotFoundError(
                    f"GPUObject {address.namespace}/{address.name} no longer exists (freed): {exc}"
                ) from exc
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

    def _token(self) -> str | None:
        return self.token_file.read_text().strip() if self.token_file else None

    async def _create_claim(self, address: ObjectAddress, holder_pod: str, holder_uid: str) -> dict:
        body = {
            "metadata": {
                "name": f"{address.name[:200]}-{holder_pod[:40]}-{_short_id()[:6]}",
                "labels": {names.LABEL_OBJECT: address.name[:63]},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": holder_pod, "uid": holder_uid}],
                # On a receiver's behalf: say who shares, so admission can check it is us (docs/security.md).
                **({"annotations": {names.ANNOTATION_SHARED_BY: self.pod_name}} if holder_pod != self.pod_name else {}),
            },
            "spec": {"objectName": address.name, "objectUID": address.uid, "holder": {"podName": holder_pod}},
        }
        return await self._kube.create(CLAIMS, body, address.namespace)

    async def aborrow_inner(self, ref: ObjectRef | ObjectAddress) -> ObjectRef:
        address = ref.address if isinstance(ref, ObjectRef) else ref
        created = await self._create_claim(address, self.pod_name, self.pod_uid)
        return self._track(
            ObjectRef(
                address,
                "claim",
                self._enqueue_release,
                claim_name=created["metadata"]["name"],
                claim_uid=created["metadata"]["uid"],
            )
        )

    async def ashare_inner(self, ref: ObjectRef | ObjectAddress, pod_name: str, pod_uid: str | None) -> SharedRef:
        address = ref.address if isinstance(ref, ObjectRef) else ref
        if pod_uid is None:
            pod_uid = await self._pod_uid(address.namespace, pod_name)
        created = await self._create_claim(address, pod_name, pod_uid)
        return SharedRef(address, created["metadata"]["name"], created["metadata"]["uid"], pod_name)

    async def _pod_uid(self, namespace: str, pod_name: str) -> str:
        """The receiver's current incarnation, cached briefly: a claim made for an incarnation that has
        since died is garbage-collected with it, which is right, since that receiver can no longer adopt it."""
        now = time.monotonic()
        cached = self._pod_uids.get((namespace, pod_name))
        if cached and now - cached[1] < POD_UID_TTL:
            return cached[0]
        uid = (await self._kube.get(PODS, pod_name, namespace))["metadata"]["uid"]
        self._pod_uids[(namespace, pod_name)] = (uid, now)
        return uid

    def _adopt(self, shared: SharedRef) -> ObjectRef:
        if shared.holder_pod != self.pod_name:
            raise ValueError(f"this reference was shared with pod {shared.holder_pod}, not {self.pod_name}")
        return self._track(
            ObjectRef(
                shared.address, "claim", self._enqueue_release, claim_name=shared.claim_name, claim_uid=shared.claim_uid
            )
        )

    def _track(self, ref: ObjectRef) -> ObjectRef:
        self._live.add(ref)
        return ref

    async def arelease_inner(self, ref: ObjectRef) -> None:
        if not ref.alive:
            return
        ref.detach()
        if ref.kind == "owner":
            await self._delete("object", ref.address.namespace, ref.address.name, ref.address.uid)
        elif ref.kind == "claim":
            await self._delete("claim", ref.address.namespace, ref.claim_name, ref.claim_uid)  # type: ignore[arg-type]

    async def _delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        res = GPUOBJECTS if kind == "object" else CLAIMS
        try:
            await self._kube.delete(res, name, namespace, uid=uid)
        except (NotFound, Conflict):
            pass  # already gone, or a successor of the same name that is not ours

    # ------------------------------------------------------------ streams

    def stream_writer(self, name: str) -> StreamWriter:
        """Create the GPUObjectStream ``name`` with this pod as producer."""
        return self._call(StreamWriter.acreate(self, name))

    async def astream_writer(self, name: str) -> StreamWriter:
        return await self._loop.acall(StreamWriter.acreate(self, name), self.timeout)

    def read_stream(self, name: str, *, device: str = "cpu", item_timeout: float = DEFAULT_TIMEOUT) -> StreamReader:
        """Iterate (``for`` or ``async for``) over the stream's items in order; each is released once read."""
        return StreamReader(self, name, device=device, item_timeout=item_timeout)

    def delete_stream(self, name: str) -> None:
        """Delete the stream: every item in it is freed, reported or not."""
        self._call(adelete_stream(self, name))

    # ------------------------------------------------------------ releases from finalizers

    def _enqueue_release(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Called by a handle's finalizer: queue plain data, never block, never raise."""
        self._releases.put((kind, namespace, name, uid))
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
                kind, namespace, name, uid = self._releases.get_nowait()
            except queue.Empty:
                return
            try:
                await self._delete(kind, namespace, name, uid)
            except Exception as exc:
                log.warning("release of %s %s/%s failed: %s", kind, namespace, name, exc)

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
