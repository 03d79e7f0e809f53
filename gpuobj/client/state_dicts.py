"""State dicts as objects: a mapping of names to tensors packed into one registered region, pooled by shape.

Why packing: a model's parameters are hundreds of separate allocations, and NIXL registers each
allocation on its own (Ray's tuning guide: 1,000 x 2 MB views take 1.4 s to register, one 2 GB
region 10.6 ms). So `put` of a mapping copies every tensor into one buffer, back to back (largest
element size first, so each tensor starts on a multiple of its own element size and the spans
touch), and the agent registers that buffer as one region; a reader reads it with one transfer
(one descriptor list) into one landing buffer of its own.

Why pooling: a trainer publishes the same shapes every step. A pack buffer goes back to this
client's pool when the agent has freed the version in it (the operator tells it once the last
reader released it), and the next version of the same shapes is copied into it: the region is
still registered in the agent's NIXL agent (parked, registrations.py), so publishing makes no new
registration. A version whose every reference this process knows of is released (the readers kept
up) but whose free has not landed yet (the operator frees recorded versions) is waited for, at most
DRAIN_WAIT: without that wait a trainer publishing faster than the frees land grows its pool by one
buffer (one registration, one version's bytes) per publish. A version still held by a lagging
reader keeps its buffer; the next publish takes another one (registered once) rather than waiting.
Idle buffers stay in the pool for the client's life (they are what makes the next version free to
publish); the pool holds at most as many buffers per shape as versions were alive at once.

Tied weights (two names for one tensor, e.g. embeddings tied to the output layer) are stored once
and come back as one tensor under both names; two names for different but overlapping views of
one storage are refused (the copy would untie them silently). Plain data and torch only; the
agent calls are the caller's (core.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuobj.client.errors import InvalidTensorError
from gpuobj_contract.layouts import MAX_TENSORS

if TYPE_CHECKING:
    import torch

# (name, index of the stored tensor): several names may share one index (tied weights).
Entries = tuple[tuple[str, int], ...]
# Each stored tensor's (shape, dtype), then the device: equal signatures, the same buffer layout.
Signature = tuple[tuple[tuple[int, ...], str] | str, ...]
# A view's identity: ((device, storage pointer), storage offset, shape, stride, dtype).
ViewIdentity = tuple[tuple[str, int], "int | torch.SymInt", tuple[int, ...], tuple[int, ...], "torch.dtype"]


@dataclass(frozen=True)
class PackPlan:
    """Where each distinct tensor of a state dict goes in one pack buffer."""

    entries: Entries  # every name, in the mapping's order, with the stored tensor it names
    sources: tuple[Any, ...]  # the distinct tensors, in stored (packed) order
    offsets: tuple[int, ...]  # byte offset of each stored tensor in the buffer
    nbytes: int  # the buffer's size: the stored tensors back to back
    device: str
    signature: Signature  # same signature, same buffer layout: what the pool keys on


def is_state_dict(obj: Any) -> bool:
    """A mapping (a model's state_dict(), a dict of tensors): what `put` packs into one region."""
    return isinstance(obj, Mapping)


def _extent(t: Any) -> tuple[int, int]:
    """The byte range of a tensor's view within its storage (first byte, one past the last)."""
    if t.numel() == 0:
        return (t.storage_offset() * t.element_size(),) * 2
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.storage_offset() * t.element_size()
    return start, start + (last + 1) * t.element_size()


# A state dict's layout key: per entry (name, data pointer, storage offset, shape, stride, dtype, device), every
# input `_plan` reads (the storage's pointer is the data pointer less the offset).
PlanKey = tuple[tuple[Any, ...], ...]
PLANS_KEPT = 8  # layouts remembered (a trainer publishes one or a few state dicts, version after version)


@dataclass(frozen=True)
class _Laid:
    """A plan without its tensors: what a cached layout keeps (holding no tensor, it keeps no memory alive)."""

    entries: Entries
    firsts: tuple[int, ...]  # per stored tensor, the position (in the mapping's order) of a name for it
    offsets: tuple[int, ...]
    nbytes: int
    device: str
    signature: Signature


_plans: OrderedDict[PlanKey, _Laid] = OrderedDict()
_plans_lock = threading.Lock()  # plan() is called on the client's loop and, by tools, from other threads


def plan(state_dict: Mapping[Any, Any]) -> PackPlan:
    """Check a state dict and lay it out; InvalidTensorError says what is wrong and what to do.

    Why a cache: checking and laying out took 11-14 ms for 2,000 tensors (46 ms under load), every version,
    for the same layout. A trainer's `state_dict()` is new tensor objects each call over the same storage,
    so the key is what the layout is computed from (`PlanKey`, ~1 us a tensor): an equal key, the layout
    computed before, with this call's tensors as the sources."""
    import torch

    items = list(state_dict.items())
    key: PlanKey | None = None
    if items and all(isinstance(t, torch.Tensor) for _, t in items):
        try:
            key = tuple((n, t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device) for n, t in items)
        except (RuntimeError, TypeError):  # a tensor without plain storage (sparse, meta): `_plan` says why
            return _plan(state_dict)
        with _plans_lock:
            laid = _plans.get(key)
            if laid is not None:
                _plans.move_to_end(key)
        if laid is not None:
            return PackPlan(
                laid.entries,
                tuple(items[i][1] for i in laid.firsts),
                laid.offsets,
                laid.nbytes,
                laid.device,
                laid.signature,
            )
    p = _plan(state_dict)
    if key is not None:
        position = {id(t): i for i, (_, t) in reversed(list(enumerate(items)))}
        laid = _Laid(p.entries, tuple(position[id(t)] for t in p.sources), p.offsets, p.nbytes, p.device, p.signature)
        with _plans_lock:
            _plans[key] = laid
            while len(_plans) > PLANS_KEPT:
                _plans.popitem(last=False)
    return p


def _plan(state_dict: Mapping[Any, Any]) -> PackPlan:
    """`plan` without the cache."""
    import torch

    from gpuobj_agent.layouts import layout_of

    if not state_dict:
        raise InvalidTensorError("put: the state dict is empty (pass a mapping of names to tensors)")
    seen: dict[ViewIdentity, int] = {}  # a view's identity -> index among the distinct tensors
    distinct: list[Any] = []
    named: list[tuple[str, int]] = []
    by_storage: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    devices: set[str] = set()
    for name, t in state_dict.items():
        if not isinstance(name, str) or not name:
            raise InvalidTensorError(f"put: state dict key {name!r} is not a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise InvalidTensorError(
                f"put: state dict entry {name!r} is a {type(t).__name__}, not a torch.Tensor "
                "(a model's state_dict() holds tensors only; drop or convert the others)"
            )
        try:
            layout = layout_of(t)
        except Exception as exc:  # the agent's BadRequest: an unsupported dtype or device
            raise InvalidTensorError(f"put: state dict entry {name!r}: {exc}") from None
        devices.add(layout.device)
        storage = (layout.device, t.untyped_storage().data_ptr())
        ident = (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        index = seen.get(ident)
        if index is None:
            start, end = _extent(t)
            for other_start, other_end, other in by_storage.get(storage, ()):
                if start < other_end and other_start < end and t.numel():
                    raise InvalidTensorError(
                        f"put: state dict entries {other!r} and {name!r} are different views of overlapping "
                        "memory; storing them apart would untie them. Tie them exactly (the same tensor under "
                        "both names) or clone one of them"
                    )
            by_storage.setdefault(storage, []).append((start, end, name))
            index = seen[ident] = len(distinct)
            distinct.append(t)
        named.append((name, index))
    if len(devices) > 1:
        raise InvalidTensorError(
            f"put: the state dict's tensors are on {sorted(devices)}; one object lives on one device: "
            "move them to one device first, or put one state dict per device"
        )
    if len(distinct) > MAX_TENSORS:
        raise InvalidTensorError(
            f"put: the state dict holds {len(distinct)} distinct tensors; an object holds at most {MAX_TENSORS} "
            "(spec.tensors' limit): put it as several state dicts"
        )
    # Largest element size first: every offset is then a multiple of its tensor's element size, and
    # the spans touch, so the agent sees one region.
    order = sorted(range(len(distinct)), key=lambda i: -distinct[i].element_size())
    remap = {old: new for new, old in enumerate(order)}
    sources = tuple(distinct[i] for i in order)
    offsets, total = [], 0
    for t in sources:
        offsets.append(total)
        total += t.numel() * t.element_size()
    device = devices.pop()
    signature: Signature = (*((tuple(t.shape), str(t.dtype)) for t in sources), device)
    return PackPlan(
        entries=tuple((name, remap[i]) for name, i in named),
        sources=sources,
        offsets=tuple(offsets),
        nbytes=total,
        device=device,
        signature=signature,
    )


class Pack:
    """One pack buffer: a byte tensor and the typed views of it, one per stored tensor."""

    def __init__(self, p: PackPlan) -> None:
        import torch

        self.signature = p.signature
        self.nbytes = p.nbytes
        self.buffer = torch.empty(max(p.nbytes, 1), dtype=torch.uint8, device=p.device)
        self.views = []
        for t, off in zip(p.sources, p.offsets, strict=True):
            raw = self.buffer[off : off + t.numel() * t.element_size()]
            self.views.append(raw.view(t.dtype).view(t.shape))

    def fill(self, p: PackPlan) -> None:
        """Copy the state dict's current values in (the version this buffer will hold)."""
        import torch

        with torch.no_grad():
            for view, t in zip(self.views, p.sources, strict=True):
                view.copy_(t)


# How long a put waits for a version whose every known reference is gone but whose free has not
# landed yet (the operator frees recorded versions, p50 ~0.1 s): a reused buffer costs no registration,
# while a fresh one costs a registration and a version's bytes for the rest of the process's life. A
# version a reader still holds is never waited for (see PackPool.draining).
DRAIN_WAIT = 2.0

Tag = tuple[str, str]  # (namespace, name) of the object a busy buffer holds


class PackPool:
    """Idle pack buffers by signature, and counts a test or a benchmark asserts on.

    Used on one loop only, the process's one (gpuobj.client.loop): the core takes buffers there, and
    the agent gives them back there (its free runs `returner`'s callback on its loop, which is the
    core's). So no lock and no cross-thread wake-up; a workload thread reads `stats` through the loop."""

    def __init__(self) -> None:
        self._idle: dict[Signature, list[Pack]] = {}
        self._busy: dict[int, tuple[Signature, Tag | None]] = {}  # id(pack) -> (signature, the object in it)
        self._waiters: list[tuple[Signature, asyncio.Future[None]]] = []
        self.allocated = 0  # buffers made (each is one NIXL registration on its first put)
        self.reused = 0
        self.bytes = 0  # bytes of every buffer the pool made (idle or holding a version)
        self.peak_busy_bytes = 0  # the most bytes holding versions at once
        self._busy_bytes = 0
        self.waits = 0  # takes that waited for a draining version's free
        self.wait_seconds = 0.0
        self.wait_timeouts = 0  # waits that ran out (a fresh buffer was made)

    def _pop_idle(self, p: PackPlan) -> Pack | None:
        idle = self._idle.get(p.signature)
        return idle.pop() if idle else None

    def _busy_add(self, pack: Pack, p: PackPlan) -> None:
        self._busy[id(pack)] = (p.signature, None)
        self._busy_bytes += p.nbytes
        self.peak_busy_bytes = max(self.peak_busy_bytes, self._busy_bytes)

    def take(self, p: PackPlan) -> Pack:
        """An idle buffer of this layout, else a new one (registered on its first put)."""
        pack = self._pop_idle(p)
        if pack is not None:
            self.reused += 1
        else:
            pack = Pack(p)
            self.allocated += 1
            self.bytes += pack.nbytes
        self._busy_add(pack, p)
        return pack

    def tag(self, pack: Pack, tag: Tag) -> None:
        """Which object `pack` holds now (its put returned), so that a later take can tell whether it drains."""
        if id(pack) in self._busy:  # not already given back
            self._busy[id(pack)] = (pack.signature, tag)

    def draining(self, p: PackPlan, released: Callable[[Tag], bool]) -> bool:
        """No idle buffer of this layout, but one holds a version whose every reference we know of is
        released (`released`): its free is on its way, so waiting for it beats registering a new buffer.
        A version a reader still holds (a lagging reader) is not draining: the put does not wait for it."""
        if self._idle.get(p.signature):
            return False
        tags = [tag for sig, tag in self._busy.values() if sig == p.signature and tag is not None]
        return any(released(tag) for tag in tags)

    async def take_waiting(self, p: PackPlan, timeout: float) -> Pack:
        """`take`, after waiting up to `timeout` s for a buffer of this layout to come back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        started = time.monotonic()
        self.waits += 1
        while True:
            pack = self._pop_idle(p)
            if pack is not None:
                self.reused += 1
                self._busy_add(pack, p)
                self.wait_seconds += time.monotonic() - started
                return pack
            left = deadline - loop.time()
            if left <= 0:
                self.wait_timeouts += 1
                self.wait_seconds += time.monotonic() - started
                return self.take(p)
            entry = (p.signature, loop.create_future())
            self._waiters.append(entry)
            try:
                await asyncio.wait({entry[1]}, timeout=left)
            finally:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    def give_back(self, pack: Pack) -> None:
        """The version in `pack` is freed (no reader can read it any more): the next put may refill it."""
        self._busy.pop(id(pack), None)
        self._busy_bytes -= pack.nbytes
        self._idle.setdefault(pack.signature, []).append(pack)
        for sig, fut in self._waiters:
            if sig == pack.signature and not fut.done():
                fut.set_result(None)

    def returner(self, pack: Pack) -> Callable[[], None]:
        """A callback for the agent: run once, when the object holding `pack` is released."""
        done = False

        def back() -> None:
            nonlocal done
            if not done:
                done = True
                self.give_back(pack)

        return back

    def stats(self) -> dict[str, Any]:
        return {
            "buffers": self.allocated,
            "reused": self.reused,
            "bytes": self.bytes,
            "busyBytes": self._busy_bytes,
            "peakBusyBytes": self.peak_busy_bytes,
            "idle": sum(len(v) for v in self._idle.values()),
            "waits": self.waits,
            "waitSeconds": round(self.wait_seconds, 6),
            "waitTimeouts": self.wait_timeouts,
        }


def unpack(entries: Entries, tensors: list[Any]) -> dict[str, Any]:
    """The fetched tensors as the state dict they were put as (tied names share one tensor)."""
    return {name: tensors[index] for name, index in entries}
