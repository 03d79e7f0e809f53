"""Streams: a producer emits items in order; a consumer reads, then releases, each.

An item is a GPUObject with spec.stream {name, index} and an ownerReference to its
GPUObjectStream. The consumer advances the stream's read position (status.consumed)
*before* it deletes the item it read, so a report of an item that arrives after the
item was consumed is recognised as late and dropped by the operator, and a consumer
that restarts resumes where it stopped. A write that fails frees its bytes at once;
deleting the stream frees every item, reported or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from gpuobj.client.errors import StreamClosedError
from gpuobj.client.handles import ObjectAddress
from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_kube.client import GPUOBJECTS, STREAMS
from gpuobj_kube.informer import JSON, Informer, InformerFailed, wait_for

if TYPE_CHECKING:
    import torch

    from gpuobj.client.core import ClientCore
    from gpuobj.client.loop import Runner


# A watch error other than 410 is retried with backoff (the project's one informer, gpuobj_kube.informer);
# errors in a row for this long are the reader's error, raised as themselves.
WATCH_GIVE_UP_SECONDS = 5.0
WATCH_BACKOFF = (0.1, 2.0)


def item_name(stream: str, index: int) -> str:
    return f"{stream}-{index}"


class StreamWriter:
    """The producer's side. Create with ``client.stream_writer(name)``."""

    def __init__(self, core: ClientCore, runner: Runner, name: str, uid: str, next_index: int = 0) -> None:
        self.core = core
        self.runner = runner
        self.name = name
        self.uid = uid
        self.next_index = next_index

    @classmethod
    async def acreate(cls, core: ClientCore, runner: Runner, name: str) -> StreamWriter:
        return cls(core, runner, name, await core.create_stream(name))

    async def aemit(self, tensors: Any) -> int:
        """Store and report the next item; returns its index. A failed report frees the bytes."""
        index = self.next_index
        self.next_index += 1
        ref = await self.core.put(tensors, name=item_name(self.name, index), stream=(self.name, index, self.uid))
        # The stream owns the item's reference from now on: the producer keeps no handle.
        ref.detach()
        return index

    def emit(self, tensors: Any) -> int:
        return self.runner.call(self.aemit(tensors), f"emit to stream {self.name}")

    async def aclose(self) -> None:
        """Mark the end: readers stop after the last emitted item."""
        await self.core.end_stream(self.name, self.next_index)

    def close(self) -> None:
        self.runner.call(self.aclose(), f"close stream {self.name}")


class StreamReader:
    """The consumer's side: yields each item's tensors in index order, releasing each after reading it."""

    def __init__(
        self, core: ClientCore, runner: Runner, name: str, *, device: str = "cpu", item_timeout: float = 60.0
    ) -> None:
        self.core = core
        self.runner = runner
        self.name = name
        self.device = device
        self.item_timeout = item_timeout
        self.position: int | None = None
        self._informers: list[Informer] = []

    @property
    def watch_failures(self) -> int:
        """Watch errors other than 410 seen so far (each retried), for observability."""
        return sum(i.errors for i in self._informers)

    def _informer(self, on_event: Callable[[JSON, bool], None], **watch: Any) -> Informer:
        """List then watch, feeding ``on_event(obj, deleted)``: the informer relists at once on 410, retries
        other errors with backoff and ends with the real one once they persist (WATCH_GIVE_UP_SECONDS)."""
        return Informer(
            self.core.kube,
            namespace=self.core.namespace,
            handler=lambda kind, obj: on_event(obj, kind == "DELETED"),
            identity=lambda obj: obj,  # a stream's few items, whole: a relist's DELETED carries the spec
            watch_timeout=60,
            backoff=WATCH_BACKOFF,
            give_up_after=WATCH_GIVE_UP_SECONDS,
            **watch,
        )

    def _start_watches(self) -> None:
        """One watch on the stream's items and one on the stream, for the whole read: no request per item."""
        self._items: dict[int, JSON] = {}
        self._end: int | None = None
        self._gone: str | None = None
        self._changed = asyncio.Event()

        def on_item(obj: JSON, deleted: bool) -> None:
            item = crd.GPUObjectSpec.from_json(obj.get("spec")).stream
            index = item.index if item is not None else -1
            if deleted or obj["metadata"].get("deletionTimestamp"):
                self._items.pop(index, None)
            else:
                self._items[index] = obj
            self._changed.set()

        def on_stream(obj: JSON, deleted: bool) -> None:
            if deleted or obj["metadata"].get("deletionTimestamp"):
                self._gone = f"stream {self.core.namespace}/{self.name} was deleted"
            end = (obj["metadata"].get("annotations") or {}).get(names.ANNOTATION_STREAM_END)
            self._end = int(end) if end is not None else None
            self._changed.set()

        self._informers = [
            self._informer(on_item, resource=GPUOBJECTS, label_selector=f"{names.LABEL_STREAM}={self.name}"),
            self._informer(on_stream, resource=STREAMS, field_selector=f"metadata.name={self.name}"),
        ]
        for informer in self._informers:
            informer.start()
            assert informer.task is not None
            informer.task.add_done_callback(lambda _: self._changed.set())  # a watch that gave up wakes the reader

    async def _stop_watches(self) -> None:
        for informer in self._informers:
            await informer.stop()

    async def _next_item(self, index: int) -> tuple[JSON | None, bool]:
        """Wait for item ``index``; (None, True) at the end of the stream. Bounded by ``item_timeout``."""

        async def wait() -> tuple[JSON | None, bool]:
            while True:
                for task in (i.task for i in self._informers):
                    if (
                        task is not None
                        and task.done()
                        and not task.cancelled()
                        and (error := task.exception()) is not None
                    ):
                        # The real error (a 403, the API server unreachable), not the informer's summary.
                        raise error.__cause__ if isinstance(error, InformerFailed) and error.__cause__ else error
                if index in self._items:
                    return self._items.pop(index), False
                if self._gone:
                    raise StreamClosedError(self._gone)
                if self._end is not None and index >= self._end:
                    return None, True
                self._changed.clear()
                await self._changed.wait()

        try:
            return await asyncio.wait_for(wait(), self.item_timeout)
        except TimeoutError as exc:
            raise StreamClosedError(
                f"item {index} of stream {self.core.namespace}/{self.name}"
                f" did not arrive within {self.item_timeout:.0f}s"
            ) from exc

    async def _advance(self, index: int) -> None:
        await self.core.advance_stream(self.name, index + 1)

    async def aiter(self) -> AsyncGenerator[list[torch.Tensor], None]:
        if self.position is None:
            # The producer may not have created the stream yet: wait for it (bounded).
            try:
                stream = await wait_for(
                    self.core.kube,
                    STREAMS,
                    self.name,
                    self.core.namespace,
                    lambda o: o is not None,
                    timeout=self.item_timeout,
                )
            except TimeoutError as exc:
                raise StreamClosedError(
                    f"stream {self.core.namespace}/{self.name} did not appear within {self.item_timeout:.0f}s"
                ) from exc
            self.position = crd.GPUObjectStreamStatus.from_json((stream or {}).get("status")).consumed or 0
        self._start_watches()
        try:
            while True:
                item, ended = await self._next_item(self.position)
                if ended:
                    return
                assert item is not None
                address = _address_of(item)
                tensors = await self.core.fetch(address, device=self.device)
                assert isinstance(tensors, list)  # an item is a list object (put with no state dict's names)
                # Read position first, then the release: a late report of this item is then recognisably stale.
                await self._advance(self.position)
                await self.core.delete_item(address)
                self.position += 1
                yield tensors
        finally:
            await self._stop_watches()

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        agen = self.aiter()
        while True:
            try:
                yield self.runner.call(agen.__anext__(), f"read stream {self.name}")
            except StopAsyncIteration:
                return

    def __aiter__(self) -> AsyncIterator[list[torch.Tensor]]:
        return self._aiter_other_loop()

    async def _aiter_other_loop(self) -> AsyncIterator[list[torch.Tensor]]:
        agen = self.aiter()
        while True:
            try:
                yield await self.runner.loop.acall(agen.__anext__(), self.item_timeout + 30)
            except StopAsyncIteration:
                return


def _address_of(obj: JSON) -> ObjectAddress:
    meta = obj["metadata"]
    spec = crd.GPUObjectSpec.from_json(obj["spec"])
    transport = crd.GPUObjectStatus.from_json(obj.get("status")).transport
    endpoint = (transport.agent_endpoint if transport else None) or (meta.get("annotations") or {}).get(
        names.ANNOTATION_SOURCE_ENDPOINT, ""
    )
    return ObjectAddress(
        meta["namespace"],
        meta["name"],
        meta["uid"],
        spec.object_id or "",
        spec.source.pod_name,
        endpoint,
        spec.layouts(),
        source_pod_uid=spec.source.pod_uid or "",
    )
