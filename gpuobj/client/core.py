"""The client's async core: put, fetch, borrow, share, adopt, release, streams' I/O, on the agent's loop.

Why a core under the facade: every operation is written once, as a coroutine that runs on
the process's one loop, the embedded agent's (loop.py), so its calls into the agent are plain
awaits; `gpuobj.Client` (client.py) only bridges sync and async
callers to it, with a deadline and the error translation. Streams (streams.py) use this core
directly, through its public methods, never through the facade's internals. Around it: the
agent seam it holds (agent_seam.py), the bodies it writes (bodies.py), a read's decisions
(reads.py), hand-off releases (handoff.py) and the write-behind queue (writebehind.py).

Kubernetes side: GPUObjects (with the gpuobj.io/free finalizer) and GPUObjectClaims (owned by
the holder pod) are written behind the caller (writebehind.py): put, share and release return
once the bytes are stored and the writes queued; an object whose whole life fits in the write
window is never written at all (docs/write-behind.md). Byte side: the pod's embedded agent
(an `AgentSeam`: gpuobj_agent.runtime.AgentRuntime) stores, registers and reads with NIXL; a hand-off carries
a read grant, so the receiver's fetch makes no request to the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpuobj.client import bodies, errors, handoff, handoff_route, reads, state_dicts
from gpuobj.client.agent_seam import AgentSeam, ReadingAgent, reader_of
from gpuobj.client.bodies import expiry, short_id
from gpuobj.client.handles import ObjectAddress, ObjectRef, SharedRef, TensorLayout
from gpuobj.client.handoff import SourceReleases
from gpuobj.client.reads import Fetched, as_put
from gpuobj.client.releases import ReleaseQueue
from gpuobj.client.shards import Piece, Shard
from gpuobj.client.state_dicts import Entries, PackPool, is_state_dict
from gpuobj.client.writebehind import Record, WriteBehind
from gpuobj_agent.layouts import layout_of
from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_contract.layouts import MAX_TENSORS
from gpuobj_kube.client import CLAIMS, GPUOBJECTS, PODS, STREAMS, Conflict, KubeClient, NotFound
from gpuobj_kube.config import KubeConfig

log = logging.getLogger("gpuobj.client")

POD_UID_TTL = 30.0


def describe_ref(ref: object) -> str:
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


def tensor_list(tensors: Any, *, what: str) -> list[torch.Tensor]:
    """A list of torch tensors from a tensor or a list/tuple of them; anything else is a clear error."""
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


class ClientCore:
    """Everything a client does, as coroutines on one loop; create it on that loop (`create`)."""

    def __init__(
        self,
        *,
        pod_name: str,
        namespace: str,
        pod_uid: str,
        agent: AgentSeam,
        kube: KubeClient,
        token_file: str | Path | None,
        timeout: float,
        write_behind: dict[str, Any] | None,
    ) -> None:
        """``write_behind``: WriteBehind's options (record, window, max_pending, backpressure_timeout), or None
        to write every record and release on the caller's path. With it, hand-off releases come here (handoff_route)."""
        self.pod_name = pod_name
        self.namespace = namespace
        self.pod_uid = pod_uid
        self.agent = agent
        # Asked once: an agent that also reads, publishes and pools (the embedded runtime), or None.
        self.reader = reader_of(agent)
        self.kube = kube
        self.timeout = timeout
        self.token_file = Path(token_file) if token_file else None
        self.loop = asyncio.get_running_loop()
        # Releases queued by handle finalizers (any thread, even during interpreter shutdown).
        self.releases = ReleaseQueue(self.loop, self._process_release)
        self.live: weakref.WeakSet[ObjectRef] = weakref.WeakSet()  # handles to release at close
        self._read_once: weakref.WeakSet[ObjectRef] = weakref.WeakSet()
        self._pod_uids: dict[tuple[str, str], tuple[str, float]] = {}
        self._writes_closed = False
        self.sources = SourceReleases(agent, self.token)  # our releases of hand-offs, posted to their sources
        self.packs = PackPool()  # state dicts' pack buffers, reused version after version (state_dicts.py)
        self.wb: WriteBehind | None = None
        if write_behind is not None:
            options = dict(write_behind)
            # Recording policy (docs/design.md): "shared" holds private objects' records, which our agent
            # marks private for the audit (the default); "all" records every object.
            record = options.pop("record", "shared")
            self.wb = WriteBehind(
                kube,
                free_local=self.free_local,
                on_record_pending=agent.set_record_pending,  # our agent tells the audit
                pod_uid=self._pod_uid,
                on_private=agent.set_private if record == "shared" else None,
                write_rate=agent.told_write_rate,  # the operator tells our agent the pod's share of the budget
                **options,
            )
            handoff_route.bind(agent.incarnation, self.handoff_sink)

    @classmethod
    async def create(cls, kube_config: KubeConfig, *, agent: AgentSeam, **kwargs: Any) -> ClientCore:
        """On the agent's loop: the core and its REST client bind to the loop they are made on."""
        return cls(kube=KubeClient(kube_config), agent=agent, **kwargs)

    # ------------------------------------------------------------ identity

    @property
    def incarnation(self) -> str:
        """This process's agent incarnation: a sender passes it to ``share`` so the claim dies with us."""
        return self.agent.incarnation

    def token(self) -> str | None:
        return self.token_file.read_text().strip() if self.token_file else None

    # ------------------------------------------------------------ objects

    @property
    def source(self) -> bodies.Source:
        """This pod as the records it writes name it."""
        return bodies.Source(self.pod_name, self.namespace, self.pod_uid, self.agent.endpoint, self.incarnation)

    def object_body(self, name: str, object_id: str, layouts: Sequence[TensorLayout], **kw: Any) -> dict[str, Any]:
        """A GPUObject whose source is this pod (bodies.object_body's keywords)."""
        return bodies.object_body(self.source, name, object_id, layouts, **kw)

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
        on_release: Callable[[], None] | None = None,
    ) -> ObjectRef:
        """``entries``/``on_release``: a packed state dict's names, and its pool's callback (put_state_dict)."""
        if is_state_dict(tensors):
            return await self.put_state_dict(tensors, name=name, labels=labels, shared_with=shared_with)
        tensors = tensor_list(tensors, what="put")
        object_id = f"o-{short_id()}"
        private = name is None and not shared_with and not labels and not entries  # recording policy
        name = name or f"{self.pod_name}-{object_id[2:12]}"
        layouts = tuple(layout_of(t) for t in tensors)
        item, index = (stream[0], stream[1]) if stream else (None, None)
        if on_release is not None and self.reader is not None:  # a pooled pack buffer (put_state_dict)
            await self.reader.aput(
                object_id, tensors, copy=copy, stream=item, stream_index=index, shared_with=shared_with,
                on_release=on_release,
            )  # fmt: skip
        else:
            await self.agent.aput(
                object_id, tensors, copy=copy, stream=item, stream_index=index, shared_with=shared_with
            )
        record: Record | None = None
        try:
            body = bodies.object_body(
                self.source, name, object_id, layouts, labels=labels, stream=stream, shared_with=shared_with,
                entries=entries,
            )  # fmt: skip
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
        pooled = self.reader is not None  # it keeps pooled memory registered across frees
        wb = self.wb
        if pooled and wb is not None and self.packs.draining(plan, lambda tag: wb.released(*tag)):
            # Readers kept up: the oldest version's free is on its way through the operator. Waiting for
            # it costs less than a new registration and a version's bytes kept for good.
            pack = await self.packs.take_waiting(plan, state_dicts.DRAIN_WAIT)
        else:
            pack = self.packs.take(plan)
        back = self.packs.returner(pack)
        try:
            await asyncio.to_thread(pack.fill, plan)  # the version's bytes, copied off the loop
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

    def publish(self, key: str, tensors: Any) -> None:
        """Offer tensors under a key, for a GPUObject declared with kubectl (spec.key) to bind (any thread)."""
        self._reading("publish").publish(key, tensor_list(tensors, what=f"publish {key!r}"))

    def _reading(self, action: str) -> ReadingAgent:
        if self.reader is None:
            raise errors.GpuObjError(f"cannot {action}: this pod's agent only stores ({type(self.agent).__name__})")
        return self.reader

    async def get_object(self, name: str) -> dict[str, Any]:
        return await self.kube.get(GPUOBJECTS, name, self.namespace)

    # ------------------------------------------------------------ fetch

    def fetch_direct(self, ref: ObjectRef | ObjectAddress, *, device: str) -> Fetched | None:
        """In the calling thread, with no loop hop and no request: a hand-off that carries a read grant.

        None when this path does not apply or fails (a stale grant, an error): `fetch` then says why."""
        if not (isinstance(ref, ObjectRef) and ref.grant is not None and ref.claim_name and self.reader):
            return None
        claim = ref.claim_name
        self.releases.begin_read(claim)
        try:
            if ref.alive and not ref.expired:  # an expired lease reads nothing: `fetch` says why
                address = ref.address
                with contextlib.suppress(Exception):  # stale grant or error: the full path says why
                    tensors = self.reader.fetch_granted_direct(
                        address.source_endpoint, address.object_id, ref.grant, device=device, timeout=self.timeout
                    )
                    if ref in self._read_once:
                        ref.release()  # a read-once hand-off: its one read is done (lands after end_read)
                    return as_put(address, tensors)
        finally:
            self.releases.end_read(claim)
        return None

    async def fetch(
        self, ref: ObjectRef | ObjectAddress, *, device: str = "cpu", select: Shard | None = None
    ) -> Fetched:
        """`select` (shards.Shard): only these names / this slice of each tensor, as one transfer of those bytes."""
        address = live_address(ref, "fetch")  # a released handle refuses
        reader = self._reading("fetch")
        pieces: list[Piece] | None = None
        named: Entries = ()
        if select is not None:  # a bad selection is refused here, before any request
            pieces, named = reads.select_pieces(address, select)
        grant = ref.grant if isinstance(ref, ObjectRef) and ref.claim_name is not None else None
        claim = ref.claim_name if grant is not None and isinstance(ref, ObjectRef) else None
        if claim is not None:
            self.releases.begin_read(claim)  # its release waits for this read
        endpoint, object_id, token = address.source_endpoint, address.object_id, self.token()
        pod_uid = address.source_pod_uid or None  # when known: a TLS agent will not call an agent without
        try:
            # The runtime's async API runs on the agent's own loop: no thread is blocked waiting.
            if grant is not None:
                tensors = await reader.afetch_granted(
                    endpoint, object_id, grant, device=device, token=token, pod_uid=pod_uid, select=pieces
                )
            else:
                tensors = await reader.afetch(
                    endpoint, object_id, device=device, token=token, pod_uid=pod_uid, select=pieces
                )
            if isinstance(ref, ObjectRef) and ref in self._read_once:
                await self.release(ref)  # a read-once hand-off: its one read is done
            return reads.as_selected(address, named, tensors) if select is not None else as_put(address, tensors)
        except Exception as exc:
            if address.namespace != self.namespace or reads.read_refused(exc):
                # Across namespaces this pod may not read the GPUObject in the API (RBAC): the source
                # agent's answer is all there is to say why, and it is enough.
                raise reads.agent_answer_error(address, exc, f"{self.namespace}/{self.pod_name}") from exc
            # Say why: a Lost object (source gone) reads differently from a freed one.
            raise await reads.failure(self.kube, address, exc) from exc
        finally:
            if claim is not None:
                self.releases.end_read(claim)

    # ------------------------------------------------------------ claims: borrow, share, adopt

    async def _create_claim(
        self,
        address: ObjectAddress,
        holder_pod: str,
        holder_uid: str,
        incarnation: str | None = None,
        ttl: int | None = None,
    ) -> dict[str, Any]:
        body = bodies.claim_body(self.pod_name, address, holder_pod, holder_uid, incarnation, ttl)
        created: dict[str, Any] = await self.kube.create(CLAIMS, body, address.namespace)
        return created

    async def borrow(self, ref: ObjectRef | ObjectAddress, ttl: int | None = None) -> ObjectRef:
        address = live_address(ref, "borrow")
        if self.wb is not None:
            body = bodies.claim_body(self.pod_name, address, self.pod_name, self.pod_uid, self.incarnation, ttl)
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
                    expires_at=expiry(ttl),
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
                expires_at=expiry(ttl),
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
        expires = expiry(ttl)  # from now: the claim is made no earlier, so the operator drops it no earlier
        if self.wb is not None:
            # No API read on the caller's path: an unknown receiver uid is read by the queue, just
            # before the claim's create (so a share during an API outage is queued like a put).
            if pod_uid is None:
                pod_uid = self._cached_pod_uid(address.namespace, pod_name)
            body = bodies.claim_body(self.pod_name, address, pod_name, pod_uid or "", incarnation, ttl)
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
            uid = str((await self.kube.get(PODS, pod_name, namespace))["metadata"]["uid"])
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
        await self.sources.settle(min(self.timeout / 2, handoff.PATIENCE))  # a hand-off's goes on past this

    async def written(self, ref: ObjectRef, timeout: float) -> bool:
        """Wait until every API write about this reference has landed (its record; after a release, its
        delete): False if one still waits after ``timeout`` s. Under a fleet write budget a record may wait
        seconds for its slot (docs/write-behind.md)."""
        record = ref._record
        if record is None or not record.pending:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await record.landed.wait()
        return not record.pending

    async def flush(self, timeout: float | None = None) -> None:
        """Send every queued release and API write now and wait until all have landed (or their sources took them)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        await self.releases.drain()
        waiting = await self.sources.settle(timeout)
        if self.wb is not None:
            await self.wb.flush(max(deadline - time.monotonic(), 0.0))
        if waiting and self.sources.in_flight:
            raise TimeoutError(f"{self.sources.in_flight} hand-off releases wait for their sources after {timeout:g}s")

    async def write_stats(self) -> dict[str, Any]:
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
        if kind == "claim" and via and via[0] != self.agent.endpoint:
            # A hand-off: the source's queue made it, so the source deletes it (or cancels its create); we
            # delete it only once the source says no queue of it holds it (handoff.py).
            self.sources.start(via, name, lambda: self._delete_claim(namespace, name, uid))
            return
        if self.wb is None:
            await self._delete(kind, namespace, name, uid)
            return
        outcome = self.wb.release(kind, namespace, name, uid)
        if outcome.free_object_id is not None:
            await self.free_local(outcome.free_object_id)

    async def _delete_claim(self, namespace: str, name: str, uid: str) -> None:
        """A hand-off claim its source disowned: deleted as our own release (queued, unless closing)."""
        if self.wb is None or self._writes_closed:
            await self._delete("claim", namespace, name, uid)
        else:
            self.wb.release("claim", namespace, name, uid)

    async def free_local(self, object_id: str) -> None:
        """Free an object of our own agent that nothing recorded (elided, or its record was refused)."""
        await self.agent.afree(object_id)

    async def handoff_sink(self, claim: str, pod: str) -> bool:
        """Awaited by the hand-off route on the agent's loop (ours): pod `pod` released a claim we made for it."""
        if self.wb is None or self._writes_closed:
            return False  # no queue of ours will create it any more: the receiver deletes what landed
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
        created = await self.kube.create(STREAMS, bodies.stream_body(self.source, name), self.namespace)
        return str(created["metadata"]["uid"])

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
        """The queue stops; from then a receiver's release of a hand-off we made is its own (handoff_sink)."""
        if self.wb is not None:
            await self.wb.close()
            handoff_route.unbind(self.agent.incarnation, self.handoff_sink)  # after: as below
        self._writes_closed = True  # after: no create of ours is being sent when a receiver is told 404

    async def close_connections(self) -> None:
        """Our hand-off releases in flight get a bounded moment (a disowned claim is deleted at once)."""
        await self.sources.close(handoff.CLOSE_WAIT)
        await self.kube.close()
