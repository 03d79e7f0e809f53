"""A fetch's arguments and its failures: what a selection reads, and which error says why a read failed.

Why apart from core.py: the core's fetch is the one path that moves bytes; everything around it is
deciding (is the Shard valid, how does the result look, is a failed read Lost, freed, refused or
over quota). Those decisions read the source agent's answer and, in the object's own namespace,
the GPUObject's status; they share no state with the core, so they live here as functions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from gpuobj.client import errors, shards
from gpuobj.client.errors import FetchError, ObjectLostError, ObjectNotFoundError
from gpuobj.client.handles import ObjectAddress
from gpuobj.client.shards import Shard
from gpuobj.client.state_dicts import Entries, unpack
from gpuobj_contract import names
from gpuobj_contract import resources as crd
from gpuobj_kube.client import GPUOBJECTS, KubeClient, NotFound

# A fetch that failed because the source's process is gone waits this long for the operator to say Lost
# (it probes agents every second or so), so the reader gets ObjectLostError, as for a deleted pod.
LOST_WAIT = 5.0

Fetched = list[torch.Tensor] | dict[str, torch.Tensor]


def as_put(address: ObjectAddress, tensors: list[torch.Tensor]) -> Fetched:
    """What `fetch` returns: the list, or for a state dict the mapping it was put as."""
    return unpack(address.entries, tensors) if address.entries else tensors


def as_selected(address: ObjectAddress, named: Entries, tensors: list[torch.Tensor]) -> Fetched:
    """A selection's result: the selected names (for a list object, the selected tensors in order)."""
    return unpack(named, tensors) if address.entries else [tensors[i] for _, i in named]


def select_pieces(address: ObjectAddress, select: Shard) -> tuple[list[shards.Piece], Entries]:
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


def source_may_be_gone(exc: BaseException) -> bool:
    """The source agent refused us or no longer knows the object: its process may have died (or freed it)."""
    from gpuobj_agent.errors import ObjectGone, SourceUnavailable

    return isinstance(exc, SourceUnavailable | ObjectGone)


def read_refused(exc: BaseException) -> bool:
    """The source agent refused this reader (403): a question of spec.sharedWith, not of RBAC."""
    from gpuobj_agent.errors import ReadRefused

    return isinstance(exc, ReadRefused)


def agent_answer_error(address: ObjectAddress, exc: BaseException, reader: str) -> errors.GpuObjError:
    """The GpuObjError for a failed read, from the source agent's answer alone (no API read).

    ``reader``: this pod as namespace/name; its namespace is the one the owner must share with."""
    from gpuobj_agent.errors import ObjectGone, SourceUnavailable

    what = f"GPUObject {address.namespace}/{address.name}"
    if read_refused(exc):
        namespace = reader.split("/", 1)[0]
        return errors.PermissionDeniedError(
            f"fetch {what}: the source agent refused pod {reader} ({exc}). A GPUObject is"
            f" readable from its own namespace and from the namespaces its spec.sharedWith names: the owner"
            f" puts it with shared_with=[{namespace!r}] (docs/workload-pods.md)"
        )
    if isinstance(exc, ObjectGone):
        return ObjectNotFoundError(f"{what} no longer exists at its source (freed, or lost with its process): {exc}")
    if isinstance(exc, SourceUnavailable):
        return ObjectLostError(f"{what} is Lost: its source agent {address.source_endpoint} is gone ({exc})")
    return FetchError(f"fetching {what} from {address.source_endpoint} failed: {exc}")


async def failure(kube: KubeClient, address: ObjectAddress, exc: Exception) -> errors.GpuObjError:
    """Why a read in our own namespace failed, as the GPUObject says: freed, Lost (waiting up to LOST_WAIT
    for the operator to say so when the source may be gone), refused over quota, or the agent's error."""
    deadline = time.monotonic() + (LOST_WAIT if source_may_be_gone(exc) else 0.0)
    while True:
        try:
            obj: dict[str, Any] = await kube.get(GPUOBJECTS, address.name, address.namespace)
        except NotFound:
            return ObjectNotFoundError(f"GPUObject {address.namespace}/{address.name} no longer exists (freed): {exc}")
        status = crd.GPUObjectStatus.from_json(obj.get("status"))
        if status.state in (names.STATE_LOST, names.STATE_FAILED) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.25)
    refused = status.condition(names.CONDITION_READY) if status.state == names.STATE_FAILED else None
    if refused is not None and refused.reason == names.REASON_QUOTA_EXCEEDED:
        return errors.QuotaExceededError(
            f"GPUObject {address.namespace}/{address.name} was refused and its bytes freed: {refused.message}"
        )
    if status.state == names.STATE_LOST:
        condition = status.condition(names.CONDITION_SOURCE_AVAILABLE)
        reason = condition.message if condition is not None else "source gone"
        return ObjectLostError(f"GPUObject {address.namespace}/{address.name} is Lost: {reason}")
    return FetchError(f"fetching {address.namespace}/{address.name} from {address.source_endpoint} failed: {exc}")
