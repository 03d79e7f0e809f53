"""The client's async core: put, fetch, borrow, share, adopt, release, streams' I/O, on the client loop.

Why a core under the facade: every operation is written once, as a coroutine that runs on
the client's own loop (loop.py); `gpuobj.Client` (client.py) only bridges sync and async
callers to it, with a deadline and the error translation. Streams (streams.py) use this core
directly, through its public methods, never through the facade's internals.

Kubernetes side: GPUObjects (with the gpuobj.io/free finalizer) and GPUObjectClaims (owned by
the holder pod) are written behind the caller (writebehind.py): put, share and release return
once the bytes are stored and the writes queued; an object whose whole life fits in the write
window is never written at all (docs/write-behind.md). Byte side: the pod's embedded agent
(gpuobj_agent.runtime.AgentRuntime) stores, registers and reads with NIXL; a hand-off carries
a read grant, so the receiver's fetch makes no request to the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuobj.client import errors, handoff, shards, state_dicts
from gpuobj.client.errors import FetchError, ObjectLostError, ObjectNotFoundError
from gpuobj.client.handles import ObjectAddress, ObjectRef, SharedRef, TensorLayout
from gpuobj.client.releases import ReleaseQueue
from gpuobj.client.shards import Shard
from gpuobj.client.state_dicts import Entries, PackPool, is_state_dict, unpack
from gpuobj.client.writebehind import Record, WriteBehind
from gpuobj_agent.layouts import layout_of
from gpuobj_contract import agent_api as api
from gpuobj_contract import agent_tls, names
from gpuobj_contract import resources as crd
from gpuobj_contract.layouts import MAX_TENSORS
from gpuobj_contract.shard_buckets import bucket_labels
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, Conflict, KubeClient, NotFound
from gpuobj_kube.config import KubeConfig

log = logging.getLogger("gpuobj.client")

POD_UID_TTL = 30.0
# A fetch that failed because the source's process is gone waits this long for the operator to say Lost
# (it probes agents every second or so), so the reader gets ObjectLostError, as for a deleted pod.
LOST_WAIT = 5.0


def _short_id() -> str:
    return uuid.uuid4().hex


def describe_ref(ref: Any) -> str:
    address = getattr(ref, "address", ref)
    return f"GPUObject {getattr(address, 'namespace', '?')}/{getattr(address, 'name', '?')}"


def live_address(ref: ObjectRef | ObjectAddress, action: str) -> ObjectAddress:
    """The address of a handle that still holds its reference; a released one refuses (it no longer keeps the bytes)."""
    if isinstance(ref, ObjectRef):
        if ref.kind != "address" and not ref.alive:
            raise errors.ReleasedHandleError(
                f"cannot {action} {describe_ref(ref)}: this handle was released; borrow or adopt a new reference"
            )
        if ref.expired:
            ref.release()  # the operator drops the claim at its ttl anyway; the handle ends with it
            raise errors.LeaseExpiredError(
                f"cannot {action} {describe_ref(ref)}: its claim's ttl passed (the operator drops it); "
                "borrow or adopt a new reference"
            )
        return ref.address
    if isinstance(ref, ObjectAddress):
        return ref
    raise TypeError(f"cannot {action} {type(ref).__name__}: expected an ObjectRef or ObjectAddress")


def _expiry(ttl: int | None) -> float | None:
    """When a claim made now with `ttl` ends for its handle (wall clock: it travels to another pod).

    The operator drops it at its creationTimestamp plus ttl, and that timestamp is whole seconds, no
    earlier than now truncated: so the handle ends no later than the operator drops the claim."""
    if not isinstance(ttl, int) or ttl < 1:
        return None  # a bad ttl: _claim_body says why
    return math.floor(time.time()) + ttl


def tensor_list(tensors: Any, *, what: str) -> list:
    """A list of torch tensors from a tensor or a list/tuple of them; anything else is a clear error."""
    import torch

    items = list(tensors) if isinstance(tensors, list | tuple) else [tensors]
    if not items:
        raise errors.InvalidTensorError(f"{what}: no tensors given (pass a tensor or a non-empty list of tensors)")
    if len(items) > MAX_TENSORS:
        raise errors.InvalidTensorError(
            f"{what}: {len(items)} tensors given; an object holds at most {MAX_TENSORS} (spec.tensors' limit)"
        )
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise errors.InvalidTensorError(
                f"{what}: item {i} is a {type(t).__name__}, not a torch.Tensor "
                "(pass a tensor or a list/tuple of tensors; convert with torch.as_tensor)"
            )
    return items


def as_put(address: ObjectAddress, tensors: list) -> list | dict:
    """What `fetch` returns: the list, or for a state dict the mapping it was put as."""
    return unpack(address.entries, tensors) if address.entries else tensors


def _source_may_be_gone(exc: BaseException) -> bool:
    """The source agent refused us or no longer knows the object: its process may have died (or freed it)."""
    from gpuobj_agent.errors import ObjectGone, SourceUnavailable

    return isinstance(exc, SourceUnavailable | ObjectGone)


def _read_refused(exc: BaseException) -> bool:
    """The source agent refused this reader (403): a question of spec.sharedWith, not of RBAC."""
    from gpuobj_agent.errors import ReadRefused

    return isinstance(exc, ReadRefused)


class ClientCore:
    """Everything a client does, as coroutines on one loop; create it on that loop (`create`)."""

    def __init__(
        self,
        *,
        pod_name: str,
        namespace: str,
        pod_uid: str,
        agent: Any,
        kube: KubeClient,
        token_file: str | Path | None,
        timeout: float,
        write_behind: dict[str, Any] | None,
    ) -> None:
        """``write_behind``: WriteBehind's options (window, max_pending, backpressure_timeout), or None
        to write every record and release on the caller's path."""
        self.pod_name = pod_name
        self.namespace = namespace
        self.pod_uid = pod_uid
        self.agent = agent
        self.kube = kube
        self.timeout = timeout
        self.token_file = Path(token_file) if token_file else None
        self.loop = asyncio.get_running_loop()
        # Releases queued by handle finalizers (any thread, even during interpreter shutdown).
        self.releases = ReleaseQueue(self.loop, self._process_release)
        self.live: weakref.WeakSet[ObjectRef] = weakref.WeakSet()  # handles to release at close
        self._read_once: weakref.WeakSet[ObjectRef] = weakref.WeakSet()
        self._pod_uids: dict[tuple[str, str], tuple[str, float]] = {}
        self._http: Any = None  # aiohttp session for hand-off releases, made on first use
        self.packs = PackPool()  # state dicts' pack buffers, reused version after version (state_dicts.py)
        self.wb: WriteBehind | None = None
        if write_behind is not None:
            pending = getattr(agent, "set_record_pending", None)  # our own in-process agent tells the audit
            options = dict(write_behind)
            # Recording policy (docs/design.md): "shared" holds private objects' records, only where our own
            # in-process agent can mark them private for the audit (the default); "all" records every object.
            record = options.pop("record", "shared")
            private = getattr(agent, "set_private", None) if record == "shared" else None
            self.wb = WriteBehind(
                kube,
                free_local=self.free_local,
                on_record_pending=pending,
                pod_uid=self._pod_uid,
                on_private=private,
                **options,
            )

    @classmethod
    async def create(cls, kube_config: KubeConfig, **kwargs: Any) -> ClientCore:
        """On the client loop: the core and its REST client bind to the loop they are made on."""
        return cls(kube=KubeClient(kube_config), **kwargs)

    # ------------------------------------------------------------ identity

    @property
    def incarnation(self) -> str | None:
        """This process's agent incarnation: a sender passes it to ``share`` so the claim dies with us."""
        return getattr(self.agent, "incarnation", None)

    def token(self) -> str | None:
        return self.token_file.read_text().strip() if self.token_file else None

    # ------------------------------------------------------------ objects

    def object_body(
        self,
        name: str,
        object_id: str,
        layouts: Sequence[TensorLayout],
        *,
        labels: dict[str, str] | None = None,
        stream: tuple[str, int, str] | None = None,
        shared_with: Sequence[str] = (),
        entries: Entries = (),
    ) -> dict:
        meta: dict = {
            "name": name,
            "finalizers": [names.FINALIZER_FREE],
            "labels": {names.LABEL_SOURCE_POD: self.pod_name, **(labels or {}), **bucket_labels(self.namespace)},
            "annotations": {names.ANNOTATION_SOURCE_ENDPOINT: self.agent.endpoint},
        }
        item: crd.StreamItem | None = None
        if stream is not None:
            stream_name, index, stream_uid = stream
            item = crd.StreamItem(stream_name, index)
            meta["labels"][names.LABEL_STREAM] = stream_name
            meta["ownerReferences"] = [
                {
                    "apiVersion": names.API_VERSION,
                    "kind": names.KIND_STREAM,
                    "name": stream_name,
                    "uid": stream_uid,
                }
            ]
        spec = crd.GPUObjectSpec(
            source=crd.ObjectSource(self.pod_name, pod_uid=self.pod_uid, incarnation=self.incarnation or None),
            tensors=_named_tensor_specs(layouts, entries),
            object_id=object_id,
            shared_with=tuple(shared_with),
            stream=item,
        )
        return {"metadata": meta, "spec": spec.to_json()}

    async def put(
        self,
        tensors: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        stream: tuple[str, int, str] | None = None,
        copy: bool = False,
        shared_with: Sequence[str] = (),
        entries: Entries = (),
        on_release: Any = None,
    ) -> ObjectRef:
        """``entries``/``on_release``: a packed state dict's names, and its pool's callback (put_state_dict)."""
        if is_state_dict(tensors):
            return await self.put_state_dict(tensors, name=name, labels=labels, shared_with=shared_with)
        tensors = tensor_list(tensors, what="put")
        object_id = f"o-{_short_id()}"
        private = name is None and not shared_with and not labels and not entries  # recording policy
        name = name or f"{self.pod_name}-{object_id[2:12]}"
        layouts = tuple(layout_of(t) for t in tensors)
        stream_kw: dict[str, Any] = {"stream": stream[0], "stream_index": stream[1]} if stream else {}
        if shared_with:
            stream_kw["shared_with"] = tuple(shared_with)
        if on_release is not None:
            stream_kw["on_release"] = on_release
        await self.agent.aput(object_id, tensors, copy=copy, **stream_kw)
        record: Record | None = None
        try:
            body = self.object_body(
                name, object_id, layouts, labels=labels, stream=stream, shared_with=shared_with, entries=entries
            )
            if self.wb is not None and stream is None:  # a stream item is written at once, never queued
                record = await self.wb.create_object(self.namespace, name, body, object_id, private=private)
                uid = ""  # known once the write-behind's create lands (the record has it)
            else:
                uid = (await self.kube.create(GPUOBJECTS, body, self.namespace))["metadata"]["uid"]
        except BaseException:
            # The write failed or was refused: nothing in the API references these bytes, so free them now
            # (docs/design.md, "streamed-item leak").
            with contextlib.suppress(Exception):
                await self.agent.afree(object_id)
            raise
        address = ObjectAddress(
            self.namespace,
            name,
            uid,
            object_id,
            self.pod_name,
            self.agent.endpoint,
            layouts,
            entries,
            source_pod_uid=self.pod_uid,
        )
        return self.track(ObjectRef(address, "owner", self.releases.put, record=record))

    # ------------------------------------------------------------ state dicts (state_dicts.py)

    async def put_state_dict(
        self,
        state_dict: Any,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        shared_with: Sequence[str] = (),
    ) -> ObjectRef:
        """One object for a whole state dict: copied into a pooled pack buffer (one NIXL region; none new
        once a buffer of these shapes was freed), names kept, tied tensors stored once."""
        plan = state_dicts.plan(state_dict)
        pooled = self._agent_pools()
        wb = self.wb
        if pooled and wb is not None and self.packs.draining(plan, lambda tag: wb.released(*tag)):
            # Readers kept up: the oldest version's free is on its way through the operator. Waiting for
            # it costs less than a new registration and a version's bytes kept for good.
            pack = await self.packs.take_waiting(plan, state_dicts.DRAIN_WAIT)
        else:
            pack = self.packs.take(plan)
        back = self.packs.returner(pack)
        try:
            await asyncio.to_thread(pack.fill, plan)  # the version's bytes, copied off the client loop
            ref = await self.put(
                pack.views,
                name=name,
                labels=labels,
                shared_with=shared_with,
                entries=plan.entries,
                on_release=back if pooled else None,
            )
        except BaseException:
            back()  # never stored (or already freed by the failed put): the buffer is free again
            raise
        self.packs.tag(pack, (ref.address.namespace, ref.address.name))
        return ref

    def _agent_pools(self) -> bool:
        """Whether our agent keeps pooled memory registered across frees (the embedded AgentRuntime does)."""
        import inspect

        aput = getattr(self.agent, "aput", None)
        return aput is not None and "on_release" in inspect.signature(aput).parameters

    def publish(self, key: str, tensors: Any) -> None:
        """Offer tensors under a key, for a GPUObject declared with kubectl (spec.key) to bind (any thread)."""
        self.agent.publish(key, tensor_list(tensors, what=f"publish {key!r}"))

    async def get_object(self, name: str) -> dict:
        return await self.kube.get(GPUOBJECTS, name, self.namespace)

    # ------------------------------------------------------------ fetch

    def fetch_direct(self, ref: ObjectRef | ObjectAddress, *, device: str) -> list | None:
        """In the calling thread, with no loop hop and no request: a hand-off that carries a read grant.

        None when this path does not apply or fails (a stale grant, an error): `fetch` then says why."""
        if not (
            isinstance(ref, ObjectRef)
            and ref.grant is not None
            and ref.claim_name
            and hasattr(self.agent, "fetch_granted_direct")
        ):
            return None
        claim = ref.claim_name
        self.releases.begin_read(claim)
        try:
            if ref.alive and not ref.expired:  # an expired lease reads nothing: `fetch` says why
                address = ref.address
                with contextlib.suppress(Exception):  # stale grant or error: the full path says why
                    tensors = self.agent.fetch_granted_direct(
                        address.source_endpoint, address.object_id, ref.grant, device=device, timeout=self.timeout
                    )
                    if ref in self._read_once:
                        ref.release()  # a read-once hand-off: its one read is done (lands after end_read)
                    return as_put(address, tensors)
        finally:
            self.releases.end_read(claim)
        return None

    @staticmethod
    def _select(address: ObjectAddress, select: Shard) -> tuple[list[shards.Piece], Entries]:
        """The agent's `select` pieces for a Shard and the result's names; InvalidRequestError if it does not fit."""
        if not isinstance(select, Shard):
            raise errors.InvalidRequestError(f"fetch: select must be a gpuobj.Shard, not {type(select).__name__}")
        if not address.layouts:
            raise errors.InvalidRequestError(
                f"fetch: {address.namespace}/{address.name}'s address carries no tensor layouts to select from "
                "(use the handle put, adopt or borrow returned)"
            )
        pieces, entries = shards.pieces(address.layouts, address.entries, select)
        return pieces, tuple(entries)

    def _source_uid(self, address: ObjectAddress) -> dict[str, str]:
        """The source pod's uid for the agent's fetch, when known (a TLS agent will not call an agent without)."""
        return {"pod_uid": address.source_pod_uid} if address.source_pod_uid else {}

    async def fetch(self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu", select: Shard | None = None) -> list:
        """`select` (shards.Shard): only these names / this slice of each tensor, as one transfer of those bytes."""
        address = live_address(ref, "fetch")  # a released handle refuses
        picked: dict[str, Any] = {}
        named: Entries = ()
        if select is not None:  # a bad selection is refused here, before any request
            pieces, named = self._select(address, select)
            picked["select"] = pieces
        granted = isinstance(ref, ObjectRef) and ref.grant is not None and ref.claim_name is not None
        claim = ref.claim_name if granted else None  # type: ignore[union-attr]
        if claim is not None:
            self.releases.begin_read(claim)  # its release waits for this read
        try:
            # The runtime's async API runs on the agent's own loop: no thread is blocked waiting.
            if claim is not None:
                tensors = await self.agent.afetch_granted(
                    address.source_endpoint,
                    address.object_id,
                    ref.grant,  # type: ignore[union-attr]
                    device=device,
                    token=self.token(),
                    **self._source_uid(address),
                    **picked,
                )
            else:
                tensors = await self.agent.afetch(
                    address.source_endpoint,
                    address.object_id,
                    device=device,
                    token=self.token(),
                    **self._source_uid(address),
                    **picked,
                )
            if isinstance(ref, ObjectRef) and ref in self._read_once:
                await self.release(ref)  # a read-once hand-off: its one read is done
            if select is not None:  # the selected names (a list object: the selected tensors, in order)
                return unpack(named, tensors) if address.entries else [tensors[i] for _, i in named]
            return as_put(address, tensors)
        except Exception as exc:
            if address.namespace != self.namespace or _read_refused(exc):
                # Across namespaces this pod may not read the GPUObject in the API (RBAC): the source
                # agent's answer is all there is to say why, and it is enough.
                raise self._agent_answer_error(address, exc) from exc
            # Say why: a Lost object (source gone) reads differently from a freed one.
            deadline = time.monotonic() + (LOST_WAIT if _source_may_be_gone(exc) else 0.0)
            while True:
                try:
                    obj = await self.kube.get(GPUOBJECTS, address.name, address.namespace)
                except NotFound:
                    raise ObjectNotFoundError(
                        f"GPUObject {address.namespace}/{address.name} no longer exists (freed): {exc}"
                    ) from exc
                status = crd.GPUObjectStatus.from_json(obj.get("status"))
                if status.state in (names.STATE_LOST, names.STATE_FAILED) or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.25)
            refused = status.condition(names.CONDITION_READY) if status.state == names.STATE_FAILED else None
            if refused is not None and refused.reason == names.REASON_QUOTA_EXCEEDED:
                raise errors.QuotaExceededError(
                    f"GPUObject {address.namespace}/{address.name} was refused and its bytes freed: {refused.message}"
                ) from exc
            if status.state == names.STATE_LOST:
                condition = status.condition(names.CONDITION_SOURCE_AVAILABLE)
                reason = condition.message if condition is not None else "source gone"
                raise ObjectLostError(f"GPUObject {address.namespace}/{address.name} is Lost: {reason}") from exc
            raise FetchError(
                f"fetching {address.namespace}/{address.name} from {address.source_endpoint} failed: {exc}"
            ) from exc
        finally:
            if claim is not None:
                self.releases.end_read(claim)

    def _agent_answer_error(self, address: ObjectAddress, exc: BaseException) -> errors.GpuObjError:
        """The GpuObjError for a failed read, from the source agent's answer alone (no API read)."""
        from gpuobj_agent.errors import ObjectGone, SourceUnavailable

        what = f"GPUObject {address.namespace}/{address.name}"
        if _read_refused(exc):
            return errors.PermissionDeniedError(
                f"fetch {what}: the source agent refused pod {self.namespace}/{self.pod_name} ({exc}). A GPUObject is"
                f" readable from its own namespace and from the namespaces its spec.sharedWith names: the owner"
                f" puts it with shared_with=[{self.namespace!r}] (docs/workload-pods.md)"
            )
        if isinstance(exc, ObjectGone):
            return ObjectNotFoundError(
                f"{what} no longer exists at its source (freed, or lost with its process): {exc}"
            )
        if isinstance(exc, SourceUnavailable):
            return ObjectLostError(f"{what} is Lost: its source agent {address.source_endpoint} is gone ({exc})")
        return FetchError(f"fetching {what} from {address.source_endpoint} failed: {exc}")

    # ------------------------------------------------------------ claims: borrow, share, adopt

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
        spec = crd.GPUObjectClaimSpec(
            object_name=address.name,
            object_uid=address.uid or None,  # else the write-behind pins the uid it created
            ttl_seconds=ttl or None,
            # Scoped to a process: ours, or the receiver's when the sender knows it.
            holder=crd.ClaimHolder(holder_pod, incarnation or None),
        )
        return {
            "metadata": {
                "name": f"{address.name[:200]}-{holder_pod[:40]}-{_short_id()[:6]}",
                "labels": {names.LABEL_OBJECT: address.name[:63], **bucket_labels(address.namespace)},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": holder_pod, "uid": holder_uid}],
                # On a receiver's behalf: say who shares, so admission can check it is us (docs/security.md).
                **({"annotations": {names.ANNOTATION_SHARED_BY: self.pod_name}} if holder_pod != self.pod_name else {}),
            },
            "spec": spec.to_json(),
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
        return await self.kube.create(CLAIMS, body, address.namespace)

    async def borrow(self, ref: ObjectRef | ObjectAddress, ttl: int | None = None) -> ObjectRef:
        address = live_address(ref, "borrow")
        if self.wb is not None:
            body = self._claim_body(address, self.pod_name, self.pod_uid, self.incarnation, ttl)
            name = body["metadata"]["name"]
            record = await self.wb.create_claim(address.namespace, address.name, name, body)
            return self.track(
                ObjectRef(
                    address,
                    "claim",
                    self.releases.put,
                    claim_name=name,
                    claim_uid="",
                    record=record,
                    expires_at=_expiry(ttl),
                )
            )
        created = await self._create_claim(address, self.pod_name, self.pod_uid, self.incarnation, ttl)
        return self.track(
            ObjectRef(
                address,
                "claim",
                self.releases.put,
                claim_name=created["metadata"]["name"],
                claim_uid=created["metadata"]["uid"],
                expires_at=_expiry(ttl),
            )
        )

    async def share(
        self,
        ref: ObjectRef | ObjectAddress,
        pod_name: str,
        pod_uid: str | None,
        incarnation: str | None = None,
        *,
        ttl: int | None = None,
        read_once: bool = False,
    ) -> SharedRef:
        address = live_address(ref, "share")
        expires = _expiry(ttl)  # from now: the claim is made no earlier, so the operator drops it no earlier
        if self.wb is not None:
            # No API read on the caller's path: an unknown receiver uid is read by the queue, just
            # before the claim's create (so a share during an API outage is queued like a put).
            if pod_uid is None:
                pod_uid = self._cached_pod_uid(address.namespace, pod_name)
            body = self._claim_body(address, pod_name, pod_uid or "", incarnation, ttl)
            name = body["metadata"]["name"]
            record = await self.wb.create_claim(
                address.namespace, address.name, name, body, owner_pod=None if pod_uid else pod_name
            )
            record.holder = pod_name  # only the receiver releases it here (docs/security.md)
            grant = None
            if address.source_endpoint == self.agent.endpoint:
                # Our own object: the receiver reads it with no request here (the claim keeps it).
                with contextlib.suppress(Exception):
                    grant = await self.agent.agrant(address.object_id)
            return SharedRef(
                address,
                name,
                "",
                pod_name,
                read_once=read_once,
                grant=grant,
                release_via=self.agent.endpoint,
                expires_at=expires,
            )
        if pod_uid is None:
            pod_uid = await self._pod_uid(address.namespace, pod_name)
        created = await self._create_claim(address, pod_name, pod_uid, incarnation, ttl)
        name, uid = created["metadata"]["name"], created["metadata"]["uid"]
        return SharedRef(address, name, uid, pod_name, read_once, expires_at=expires)

    def _cached_pod_uid(self, namespace: str, pod_name: str) -> str | None:
        cached = self._pod_uids.get((namespace, pod_name))
        return cached[0] if cached and time.monotonic() - cached[1] < POD_UID_TTL else None

    async def _pod_uid(self, namespace: str, pod_name: str) -> str:
        """The receiver's current incarnation, cached briefly: a claim made for an incarnation that has
        since died is garbage-collected with it, which is right, since that receiver can no longer adopt it."""
        now = time.monotonic()
        cached = self._cached_pod_uid(namespace, pod_name)
        if cached:
            return cached
        try:
            uid = (await self.kube.get(PODS, pod_name, namespace))["metadata"]["uid"]
        except NotFound:
            raise errors.PodNotFoundError(
                f"pod {namespace}/{pod_name} does not exist: share with a running pod (check its name)"
            ) from None
        self._pod_uids[(namespace, pod_name)] = (uid, now)
        return uid

    def adopt(self, shared: SharedRef) -> ObjectRef:
        """Take over a claim another pod made for this one (any thread, no I/O)."""
        if shared.holder_pod != self.pod_name:
            raise errors.GpuObjError(
                f"this reference was shared with pod {shared.holder_pod}, not {self.pod_name}: "
                f"share it with {self.pod_name} instead"
            )
        ref = self.track(
            ObjectRef(
                shared.address,
                "claim",
                self.releases.put,
                claim_name=shared.claim_name,
                claim_uid=shared.claim_uid,
                grant=shared.grant,
                via=(shared.release_via, shared.address.source_pod_uid) if shared.release_via else None,
                expires_at=shared.expires_at,
            )
        )
        if shared.read_once:
            self._read_once.add(ref)
        return ref

    def track(self, ref: ObjectRef) -> ObjectRef:
        self.live.add(ref)
        return ref

    # ------------------------------------------------------------ releases

    async def release(self, ref: ObjectRef) -> None:
        if not ref.alive:
            return
        ref.release()  # queues it (any thread may release); drain now so an elided free happens before we return
        await self.releases.drain()

    async def flush(self, timeout: float | None = None) -> None:
        """Send every queued release and API write now and wait until all have landed."""
        await self.releases.drain()
        if self.wb is not None:
            await self.wb.flush(self.timeout if timeout is None else timeout)

    async def write_stats(self) -> dict:
        return self.wb.stats() if self.wb is not None else {"pending": 0}

    async def _delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        res = GPUOBJECTS if kind == "object" else CLAIMS
        try:
            await self.kube.delete(res, name, namespace, uid=uid)
        except (NotFound, Conflict):
            pass  # already gone, or a successor of the same name that is not ours

    async def _process_release(
        self, kind: str, namespace: str, name: str, uid: str, via: tuple[str, str] | None
    ) -> None:
        if self.wb is None:
            await self._delete(kind, namespace, name, uid)
            return
        # A hand-off: the source queued this claim, so the source takes its release (it may never
        # have been recorded). If the source does not know it (restarted) or is gone, delete it here.
        if kind == "claim" and via and via[0] != self.agent.endpoint and await self._release_at_source(via, name):
            return
        outcome = self.wb.release(kind, namespace, name, uid)
        if outcome.free_object_id is not None:
            await self.free_local(outcome.free_object_id)

    async def free_local(self, object_id: str) -> None:
        """Free an object of our own agent that nothing recorded (elided, or its record was refused)."""
        await self.agent.afree(object_id)

    async def _release_at_source(self, via: tuple[str, str], claim: str) -> bool:
        """Send a hand-off claim's release to the source agent that queued it (it may never have been
        recorded: the source drops it unwritten). Over TLS the source is verified as the pod it means, and
        this pod presents its own certificate with its token. False: delete it in the API instead, which
        handoff.py answers only when the source will never create the claim."""
        import aiohttp

        endpoint, pod_uid = via
        tls = None
        if getattr(self.agent, "serves_tls", False):
            tls = self.agent.client_tls()
            if tls is None or not pod_uid:
                return False  # never send a token to a listener we cannot hold to a pod
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        token = self.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if pod_uid:
            headers[names.HEADER_POD_UID] = pod_uid
        verify: dict[str, Any] = {"ssl": tls, "server_hostname": agent_tls.pod_dns_name(pod_uid)} if tls else {}
        url = f"{'https' if tls else 'http'}://{endpoint}{api.RELEASE_HANDOFF.path(claim=claim)}"
        return await handoff.release_at_source(self._http, url, headers, verify)

    async def handoff_sink(self, claim: str, pod: str) -> bool:
        """On the agent's loop: pod `pod` released a claim we made for it. Handled on our loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._handoff_release(claim, pod), self.loop))

    async def _handoff_release(self, claim: str, pod: str) -> bool:
        if self.wb is None:
            return False
        found = self.wb.find("claim", self.namespace, claim)
        if found is None or found[1].holder != pod:
            return False  # unknown, or not the receiver's to release: the same answer
        rec = found[1]
        outcome = self.wb.release("claim", rec.namespace, claim, rec.uid)
        if outcome.free_object_id is not None:
            await self.free_local(outcome.free_object_id)
        return True

    # ------------------------------------------------------------ streams (streams.py)

    async def create_stream(self, name: str) -> str:
        """Create the GPUObjectStream `name` with this pod as producer; returns its uid."""
        body = {
            "metadata": {
                "name": name,
                "finalizers": [names.FINALIZER_FREE],
                "labels": bucket_labels(self.namespace),
                # If the producer pod goes, so does the stream (and every item with it).
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.pod_uid}],
            },
            "spec": crd.GPUObjectStreamSpec(crd.StreamProducer(self.pod_name)).to_json(),
        }
        created = await self.kube.create(STREAMS, body, self.namespace)
        return created["metadata"]["uid"]

    async def end_stream(self, name: str, end: int) -> None:
        """Mark the end: readers stop after item `end - 1`."""
        await self.kube.patch(
            STREAMS, name, {"metadata": {"annotations": {names.ANNOTATION_STREAM_END: str(end)}}}, self.namespace
        )

    async def advance_stream(self, name: str, consumed: int) -> None:
        """Record the read position (status.consumed): a late report of an item before it is recognisably stale."""
        status = crd.GPUObjectStreamStatus(consumed=consumed).to_json()
        await self.kube.patch(STREAMS, name, {"status": status}, self.namespace, subresource="status")

    async def delete_item(self, address: ObjectAddress) -> None:
        """Drop a consumed stream item (its GPUObject)."""
        try:
            await self.kube.delete(GPUOBJECTS, address.name, address.namespace, uid=address.uid)
        except (NotFound, Conflict):
            pass

    async def delete_stream(self, name: str) -> None:
        """Delete the stream: every item in it is freed, reported or not."""
        try:
            await self.kube.delete(STREAMS, name, self.namespace, propagation="Background")
        except NotFound:
            pass

    # ------------------------------------------------------------ shutdown

    async def close_writes(self) -> None:
        if self.wb is not None:
            await self.wb.close()

    async def close_connections(self) -> None:
        if self._http is not None:
            await self._http.close()
        await self.kube.close()


def _named_tensor_specs(layouts: Sequence[TensorLayout], entries: Entries) -> tuple[crd.TensorSpec, ...]:
    """spec.tensors; a state dict's tensors carry their (first) name, for people reading the object."""
    names_by_index: dict[int, str] = {}
    for tensor_name, index in reversed(entries):
        if len(tensor_name) <= 253:
            names_by_index[index] = tensor_name
    return tuple(crd.TensorSpec(t.shape, t.dtype, t.device, names_by_index.get(i)) for i, t in enumerate(layouts))
