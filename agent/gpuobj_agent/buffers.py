"""Landing buffers: registered, pre-faulted CPU memory that fetched tensors are carved from.

Why: reading into freshly allocated memory costs more than the read itself. Measured
here, 64 MiB: a READ into a new tensor takes 36 ms, into touched memory 18 ms (the
kernel faults in and zeroes 16,384 pages during the copy), and registering and
deregistering the destination adds more per fetch. So CPU fetches land in buffers that
stay registered with the reader's NIXL agent and stay faulted in. A fetched object's
tensors are views of one buffer; when the last of them (and every view of them) is
garbage, the buffer returns to the pool. Idle buffers are bounded (`max_idle_bytes`,
oldest evicted first) and trimmed after `idle_seconds`, each deregistered before it is
dropped, so the pool never grows without bound and registrations always balance.

A buffer can also be *bound* to a prepared read (fetch.py): it then lands every fetch of one
object in the same memory, and each fetch hands out new tensor objects over it (`Bound`). Whether
the last fetch's tensors are still alive is read from the storage's use count, so a buffer whose
tensors someone still holds is never landed in again.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gpuobj_agent.layouts import TensorLayout, allocate, torch_dtype
from gpuobj_agent.nixl_transport import NixlAgent, region_of
from gpuobj_agent.registrations import RegionKey

log = logging.getLogger(__name__)

ALIGN = 64  # every tensor starts on a 64-byte boundary, so any dtype view is aligned
MIN_BUFFER = 64 << 10


def _round(nbytes: int) -> int:
    """Capacity for a request: powers of two below 16 MiB, then 2 MiB steps (bounded waste)."""
    if nbytes <= MIN_BUFFER:
        return MIN_BUFFER
    if nbytes < 16 << 20:
        return 1 << (nbytes - 1).bit_length()
    step = 2 << 20
    return (nbytes + step - 1) // step * step


def _use_count_fn() -> Callable[[int], int] | None:
    """torch's count of references to a storage (every tensor or view over it holds one), if it has one."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return fn if callable(fn) else None


_use_count = _use_count_fn()
BINDABLE = _use_count is not None  # without it, prepared reads are off (fetches carve instead)


@dataclass(eq=False)
class Buffer:
    array: np.ndarray
    key: RegionKey
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def capacity(self) -> int:
        return int(self.array.nbytes)


def views(whole: torch.Tensor, layouts: Sequence[TensorLayout], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Contiguous tensors of `layouts` at byte `offsets` of the byte tensor `whole` (an empty one: its own).

    Why `as_strided` of one typed view per dtype: a slice, a dtype view and a shape view per tensor took
    3.7 us a tensor (7.4 ms for a 2,000-tensor state dict, every fetch); this takes 0.9 us. The offsets
    are ALIGN-aligned, so every one is a whole number of elements."""
    typed: dict[str, torch.Tensor] = {}
    out = []
    for la, off in zip(layouts, offsets, strict=True):
        if not la.nbytes:
            out.append(allocate(la, device="cpu"))
            continue
        base = typed.get(la.dtype)
        if base is None:
            base = typed[la.dtype] = whole.view(torch_dtype(la))
        shape = la.shape
        stride, step = [0] * len(shape), 1
        for i in range(len(shape) - 1, -1, -1):
            stride[i] = step
            step *= shape[i]
        out.append(base.as_strided(shape, stride, off // base.element_size()))
    return out


class Bound:
    """A landing buffer held for one object's prepared read: the same bytes every fetch, new tensors each time.

    `hand_out` returns new tensor objects (views of templates made once: a `detach` costs a third
    of a microsecond, carving a buffer several). The buffer is `busy` while any tensor handed out,
    or any view of one, is alive: torch counts the references to a storage, and here only the
    templates hold it otherwise. A busy buffer is never landed in: its holder's bytes stay theirs.
    """

    def __init__(self, buf: Buffer, layouts: Sequence[TensorLayout]) -> None:
        assert _use_count is not None
        offsets, total = LandingPool.plan(layouts)
        self.buf = buf
        self.layouts = tuple(layouts)
        whole = torch.from_numpy(buf.array[:total])
        self.whole = whole  # the whole buffer as one tensor (what a stuck READ keeps alive)
        self._templates = views(whole, layouts, offsets)
        self.tensors = self._templates  # where a READ lands (registered memory)
        self._cdata = whole.untyped_storage()._cdata
        self._idle = _use_count(self._cdata)  # the base and the templates
        self.released = False  # unbound while busy: back to the pool once its tensors die
        self.used = time.monotonic()

    def busy(self) -> bool:
        return _use_count(self._cdata) != self._idle  # type: ignore[misc]

    def hand_out(self) -> list[torch.Tensor]:
        self.used = time.monotonic()
        return [t.detach() for t in self._templates]


class LandingPool:
    """Registered CPU buffers, reused across fetches. Thread-safe: tensors die on any thread."""

    def __init__(self, agent: NixlAgent, *, max_idle_bytes: int = 512 << 20, idle_seconds: float = 30.0) -> None:
        self.agent = agent
        self.max_idle_bytes = max_idle_bytes
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[Buffer] = []
        self._all: set[Buffer] = set()
        self._idle_bytes = 0
        self._closed = False
        self._carved = 0  # buffers whose carved tensors are alive
        self._bound: set[Bound] = set()  # buffers held by prepared reads
        self.on_trim: list[Callable[[float], None]] = []  # run first in trim (the fetcher lets idle reads go)
        self.registrations = 0
        self.deregistrations = 0

    @staticmethod
    def plan(layouts: Sequence[TensorLayout]) -> tuple[list[int], int]:
        """Offsets of each tensor in one buffer, and the bytes needed."""
        offsets, total = [], 0
        for layout in layouts:
            offsets.append(total)
            total += (layout.nbytes + ALIGN - 1) // ALIGN * ALIGN
        return offsets, total

    def carve(self, layouts: Sequence[TensorLayout]) -> tuple[list[torch.Tensor], Buffer | None]:
        """New tensors for an object's layouts, all in one registered buffer (already registered)."""
        offsets, total = self.plan(layouts)
        if total == 0:
            return [allocate(layout, device="cpu") for layout in layouts], None
        buf = self._take(total)
        view = buf.array[:total]  # a new ndarray per fetch: it lives exactly as long as the tensors' storage
        tensors = views(torch.from_numpy(view), layouts, offsets)
        weakref.finalize(view, self._give_back, buf)
        return tensors, buf

    @property
    def in_use(self) -> int:
        """Buffers whose fetched tensors (or views of them) are alive: carved or bound."""
        with self._lock:
            bound = list(self._bound)
        return self._carved + sum(1 for b in bound if b.busy())

    def bind(self, layouts: Sequence[TensorLayout]) -> Bound:
        """A buffer for a prepared read of these layouts; it stays out of the pool until `unbind`."""
        self._reclaim()
        _, total = self.plan(layouts)
        buf = self._take(max(total, 1), carved=False)
        bound = Bound(buf, layouts)
        with self._lock:
            self._bound.add(bound)
        return bound

    def unbind(self, bound: Bound) -> None:
        """The prepared read is gone: the buffer returns to the pool now, or once its tensors die."""
        bound.released = True
        self._reclaim()

    def _reclaim(self) -> None:
        with self._lock:
            done = [b for b in self._bound if b.released and not b.busy()]
            self._bound.difference_update(done)
        for b in done:
            self._give_back(b.buf, carved=False)

    def _take(self, nbytes: int, carved: bool = True) -> Buffer:
        with self._lock:
            best = None
            for buf in self._idle:  # smallest idle buffer that fits, at most twice the size asked
                if nbytes <= buf.capacity <= max(2 * nbytes, MIN_BUFFER) and (
                    best is None or buf.capacity < best.capacity
                ):
                    best = buf
            if best is not None:
                self._idle.remove(best)
                self._idle_bytes -= best.capacity
                self._carved += carved
                return best
        capacity = _round(nbytes)
        raw = np.empty(capacity + ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % ALIGN
        array = raw[start : start + capacity]  # 64-byte aligned, so every carved tensor is
        array.fill(0)  # fault every page in now, once
        key = region_of(torch.from_numpy(array))
        assert key is not None
        self.agent.register([key])
        buf = Buffer(array, key)
        with self._lock:
            self.registrations += 1
            self._carved += carved
            self._all.add(buf)
        return buf

    def _give_back(self, buf: Buffer, carved: bool = True) -> None:
        evict: list[Buffer] = []
        with self._lock:
            self._carved -= carved
            if not self._closed:
                buf.idle_since = time.monotonic()
                self._idle.append(buf)
                self._idle_bytes += buf.capacity
                while self._idle_bytes > self.max_idle_bytes and self._idle:
                    old = min(self._idle, key=lambda b: b.idle_since)
                    self._idle.remove(old)
                    self._idle_bytes -= old.capacity
                    evict.append(old)
        self._drop(evict)

    def trim(self, now: float | None = None) -> int:
        """Drop buffers idle longer than `idle_seconds`; returns how many."""
        now = time.monotonic() if now is None else now
        for hook in list(self.on_trim):
            hook(now)
        self._reclaim()
        with self._lock:
            old = [b for b in self._idle if now - b.idle_since > self.idle_seconds]
            for b in old:
                self._idle.remove(b)
                self._idle_bytes -= b.capacity
        self._drop(old)
        return len(old)

    def close(self) -> None:
        """Deregister every buffer (before the reader agent goes). Tensors still using one keep their
        memory (it is numpy's); it just is no longer registered, and is freed when they die."""
        with self._lock:
            self._closed = True
            self._bound.clear()
            everything = list(self._all)
            self._idle, self._idle_bytes = [], 0
        self._drop(everything)

    def _drop(self, bufs: list[Buffer]) -> None:
        for buf in bufs:
            with self._lock:
                if buf not in self._all:
                    continue
                self._all.discard(buf)
            try:
                self.agent.deregister([buf.key])
            except Exception as exc:  # the agent is going away: its registrations go with it
                log.error("deregistering a landing buffer failed: %s", exc)
            with self._lock:
                self.deregistrations += 1

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes
