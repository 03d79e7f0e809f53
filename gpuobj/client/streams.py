"""Streams (seed 003): a producer emits items in order; a consumer reads, then releases, each.

An item is a GPUObject with spec.stream {name, index} and an ownerReference to its
GPUObjectStream. The consumer advances the stream's read position (status.consumed)
*before* it deletes the item it read, so a report of an item that arrives after the
item was consumed is recognised as late and dropped by the operator, and a consumer
that restarts resumes where it stopped. A write that fails frees its bytes at once;
deleting the stream frees every item, reported or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from gpuobj import names
from gpuobj.client.errors import StreamClosedError
from gpuobj.client.handles import ObjectAddress, TensorLayout
from gpuobj.kube.client import GPUOBJECTS, STREAMS, Conflict, Gone, NotFound, wait_for

if TYPE_CHECKING:
    from gpuobj.client.client import Client

ANNOTATION_END = f"{names.GROUP}/stream-end"


def item_name(stream: str, index: int) -> str:
    return f"{stream}-{index}"


class StreamWriter:
    """The producer's side. Create with ``client.stream_writer(name)``."""

    def __init__(self, client: Client, name: str, uid: str, next_index: int = 0) -> None:
        self.client = client
        self.name = name
        self.uid = uid
        self.next_index = next_index

    @classmethod
    async def acreate(cls, client: Client, name: str) -> StreamWriter:
        body = {
            "metadata": {
                "name": name,
                "finalizers": [names.FINALIZER_FREE],
                # If the producer pod goes, so does the stream (and every item with it).
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": client.pod_name, "uid": client.pod_uid}
                ],
            },
            "spec": {"producer": {"podName": client.pod_name}},
        }
        created = await client._kube.create(STREAMS, body, client.namespace)
        return cls(client, name, created["metadata"]["uid"])

    async def aemit(self, tensors: Any) -> int:
        """Store and report the next item; returns its index. A failed report frees the bytes."""
        index = self.next_index
        self.next_index += 1
        ref = await self.client.aput_inner(
            tensors, name=item_name(self.name, index), stream=(self.name, index, self.uid)
        )
        # The stream owns the item's reference from now on: the producer keeps no handle.
        ref.detach()
        return index

    def emit(self, tensors: Any) -> int:
        return self.client._call(self.aemit(tensors))

    async def aclose(self) -> None:
        """Mark the end: readers stop after the last emitted item."""
        await self.client._kube.patch(
            STREAMS,
            self.name,
            {"metadata": {"annotations": {ANNOTATION_END: str(self.next_index)}}},
            self.client.namespace,
        )

    def close(self) -> None:
        self.client._call(self.aclose())


class StreamReader:
    """The consumer's side: yields each item's tensors in index order, releasing each after reading it."""

    def __init__(self, client: Client, name: str, *, device: str = "cpu", item_timeout: float = 60.0) -> None:
        self.client = client
        self.name = name
        self.device = device
        self.item_timeout = item_timeout
        self.position: int | None = None

    async def _stream(self) -> dict:
        try:
            return await self.client._kube.get(STREAMS, self.name, self.client.namespace)
        except NotFound as exc:
            raise StreamClosedError(f"stream {self.client.namespace}/{self.name} does not exist") from exc

    async def _next_item(self, index: int) -> tuple[dict | None, bool]:
        """Wait for item ``index`` by watching the stream's items; (None, True) at the end of the stream."""
        kube, ns = self.client._kube, self.client.namespace
        selector = f"{names.LABEL_STREAM}={self.name}"
        wanted = item_name(self.name, index)

        async def wait() -> tuple[dict | None, bool]:
            while True:
                stream = await self._stream()
                if stream["metadata"].get("deletionTimestamp"):
                    raise StreamClosedError(f"stream {ns}/{self.name} is being deleted")
                end = (stream["metadata"].get("annotations") or {}).get(ANNOTATION_END)
                listed = await kube.list(GPUOBJECTS, ns, label_selector=selector)
                for item in listed["items"]:
                    if item["metadata"]["name"] == wanted and not item["metadata"].get("deletionTimestamp"):
                        return item, False
                if end is not None and index >= int(end):
                    return None, True
                try:
                    async for kind, obj in kube.watch(
                        GPUOBJECTS,
                        ns,
                        resource_version=listed["metadata"]["resourceVersion"],
                        label_selector=selector,
                        timeout_seconds=10,
                    ):
                        if kind == "ADDED" and obj["metadata"]["name"] == wanted:
                            return obj, False
                except Gone:
                    pass
                # The watch timed out: look at the stream again (it may have ended or been deleted).

        return await asyncio.wait_for(wait(), self.item_timeout)

    async def _advance(self, index: int) -> None:
        await self.client._kube.patch(
            STREAMS, self.name, {"status": {"consumed": index + 1}}, self.client.namespace, subresource="status"
        )

    async def aiter(self) -> AsyncIterator[list]:
        if self.position is None:
            # The producer may not have created the stream yet: wait for it (bounded).
            try:
                stream = await wait_for(
                    self.client._kube,
                    STREAMS,
                    self.name,
                    self.client.namespace,
                    lambda o: o is not None,
                    timeout=self.item_timeout,
                )
            except TimeoutError as exc:
                raise StreamClosedError(
                    f"stream {self.client.namespace}/{self.name} did not appear within {self.item_timeout:.0f}s"
                ) from exc
            self.position = int(((stream or {}).get("status") or {}).get("consumed", 0))
        while True:
            item, ended = await self._next_item(self.position)
            if ended:
                return
            assert item is not None
            address = _address_of(item)
            tensors = await self.client.afetch_inner(address, device=self.device)
            # Read position first, then the release: a late report of this item is then recognisably stale.
            await self._advance(self.position)
            try:
                await self.client._kube.delete(GPUOBJECTS, address.name, address.namespace, uid=address.uid)
            except (NotFound, Conflict):
                pass
            self.position += 1
            yield tensors

    def __iter__(self) -> Iterator[list]:
        agen = self.aiter()
        while True:
            try:
                yield self.client._call(agen.__anext__())
            except StopAsyncIteration:
                return

    def __aiter__(self) -> AsyncIterator[list]:
        return self._aiter_other_loop()

    async def _aiter_other_loop(self) -> AsyncIterator[list]:
        agen = self.aiter()
        while True:
            try:
                yield await self.client._loop.acall(agen.__anext__(), self.item_timeout + 30)
            except StopAsyncIteration:
                return


def _address_of(obj: dict) -> ObjectAddress:
    meta, spec, status = obj["metadata"], obj["spec"], obj.get("status") or {}
    endpoint = (status.get("transport") or {}).get("agentEndpoint") or (meta.get("annotations") or {}).get(
        names.ANNOTATION_SOURCE_ENDPOINT, ""
    )
    return ObjectAddress(
        meta["namespace"],
        meta["name"],
        meta["uid"],
        spec["objectId"],
        spec["source"]["podName"],
        endpoint,
        tuple(TensorLayout.from_spec(t) for t in spec["tensors"]),
    )


async def adelete_stream(client: Client, name: str) -> None:
    try:
        await client._kube.delete(STREAMS, name, client.namespace, propagation="Background")
    except NotFound:
        pass
