"""One held object's record, its NIXL description, and the checks of the names it goes by.

Why apart from the store: three parts touch these records. The store writes them (put, free), the read
side (reads.py) reads them to issue tickets and grants, and the fencer has them moved between NIXL agents
(by nixl_state.py, the one writer of placement).
With the record here, reads.py and fencing.py depend on it and not on the store's internals, and the
store owns its read side without an import cycle.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpuobj_agent.errors import BadRequest
from gpuobj_agent.layouts import TensorLayout
from gpuobj_agent.nixl_transport import NixlAgent, Span
from gpuobj_agent.registrations import RegionKey
from gpuobj_contract import agent_api as api
from gpuobj_contract import patterns


def check_id(object_id: object, what: str = "object id") -> str:
    if not patterns.OBJECT_ID.matches(object_id):
        raise BadRequest(f"{what} {object_id!r} is not valid: {api.OBJECT_ID_RULE}")
    return str(object_id)


def check_stream(stream: object) -> str:
    if not patterns.STREAM_NAME.matches(stream):
        raise BadRequest(f"stream {stream!r} is not valid: {api.STREAM_NAME_RULE}")
    return str(stream)


def iso_time(ts: float) -> str:
    """RFC 3339 UTC with milliseconds, as the API shows times."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


class Description(NamedTuple):
    """What a reader needs from the NIXL agent that holds an object (base64, as tickets carry it)."""

    metadata: str | None  # NIXL partial metadata of the object's regions
    descriptors: str | None  # NIXL's serialized descriptors of its spans
    whole: bool  # the metadata is NIXL's full metadata: it names every region of the agent


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def describe_in(agent: NixlAgent, keys: Sequence[RegionKey], spans: Sequence[Span | None]) -> Description:
    """On the control thread: the metadata and descriptors a reader of these regions needs."""
    md = agent.partial_metadata(list(keys))
    descs = agent.serialized_descriptors([s for s in spans if s is not None])
    whole = len({k.mem for k in keys}) > 1  # DRAM and VRAM: NIXL's full metadata, every region in it
    return Description(_b64(md), _b64(descs), whole)


def register_in(
    agent: NixlAgent,
    new_keys: Sequence[RegionKey],
    objects: Sequence[tuple[Sequence[RegionKey], Sequence[Span | None]]],
) -> list[Description]:
    """On the control thread: register new regions, then describe each object (one thread hop)."""
    if new_keys:
        agent.register(list(new_keys))
    try:
        return [describe_in(agent, keys, spans) for keys, spans in objects]
    except Exception:
        if new_keys:
            agent.deregister(list(new_keys))
        raise


class NewObject(NamedTuple):
    """What a put knows of an object before a NIXL agent takes it (store.py and pooled.py place it)."""

    layouts: list[TensorLayout]
    spans: list[Span | None]
    keys: list[RegionKey]
    stream: str | None
    stream_index: int | None
    key: str | None
    shared_with: frozenset[str]
    on_release: Callable[[], None] | None


@dataclass
class StoredObject:
    object_id: str
    tensors: list[torch.Tensor]
    layouts: list[TensorLayout]
    spans: list[Span | None]
    keys: list[RegionKey]
    nbytes: int
    created_wall: float
    created_mono: float
    gid: int
    stream: str | None = None
    stream_index: int | None = None
    key: str | None = None
    # What a reader of it needs from generation `described_gid`; computed lazily after a move.
    description: Description | None = None
    described_gid: int | None = None
    freeing: asyncio.Future[None] | None = None
    # Namespaces besides the source's own whose pods may read it (GPUObject spec.sharedWith).
    shared_with: frozenset[str] = frozenset()
    # Pooled memory (a client's pack buffer, gpuobj/client/state_dicts.py): the owner keeps the bytes and
    # reuses them, so a free parks the region registered and hands the memory back (store.py, `_release`).
    on_release: Callable[[], None] | None = None

    @property
    def devices(self) -> list[str]:
        return sorted({layout.device for layout in self.layouts})

    def answer(self) -> api.ObjectDescription:
        return api.ObjectDescription(
            id=self.object_id,
            bytes=self.nbytes,
            tensors=tuple(self.layouts),
            created_at=iso_time(self.created_wall),
            stream=self.stream,
            stream_index=self.stream_index,
        )
