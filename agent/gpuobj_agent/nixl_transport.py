"""The NIXL edge: every call into nixl (1.5.1, UCX backend) lives in this module.

Why the agents are built here rather than with `nixl_agent(name, nixl_agent_config())`:
the stock constructor hard-codes the UCX progress thread's poll delay to 0, and with
that the thread busy-polls (measured here: 76-94% of a core per idle agent, strace shows
`poll(..., 0)` in a loop). A delay of 1 ms costs 1.6% of a core and 10 ms 0.3%; the
thread still wakes on UCX events in between. The agent keeps one to three NIXL agents
alive (see fencing.py), so this matters. The subclass below sets the same attributes as
`nixl_agent.__init__` and only changes the config.

Everything here is synchronous and may block for the length of a transfer (with UCX
cma the whole copy happens inside `transfer()`), so callers run it on worker threads;
the nixl bindings release the GIL while they work (measured: < 3 ms stalls of other
threads during a 64 MiB read). Agents use NIXL_THREAD_SYNC_STRICT so several threads
may call one agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from gpuobj_agent.errors import TransportError
from gpuobj_agent.registrations import RegionKey

log = logging.getLogger(__name__)

_api: ModuleType | None = None


def nixl_api() -> ModuleType:
    """Import nixl once, on first use: importing it costs about a second."""
    global _api
    if _api is None:
        import nixl._api as api  # type: ignore[import-untyped]  # nixl ships no type stubs (no py.typed)

        _api = api
    return _api


class XferHandle(Protocol):
    """A NIXL transfer request (nixl's `nixl_xfer_handle`): posted, polled, released."""

    def release(self) -> None: ...


class RegDList(Protocol):
    """A NIXL registration descriptor list (`nixlRegDList`): what register/deregister take."""

    def descCount(self) -> int: ...


class _NixlImpl(Protocol):
    """The calls this module makes on a nixl `nixl_agent` (nixl ships no types: written from its use here)."""

    def register_memory(self, dlist: RegDList) -> object: ...
    def deregister_memory(self, dlist: RegDList) -> None: ...
    def get_partial_agent_metadata(self, dlist: RegDList, inc_conn_info: bool) -> bytes: ...
    def get_agent_metadata(self) -> bytes: ...
    def get_serialized_descs(self, dlist: object) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> bytes | str: ...
    def make_connection(self, name: str) -> None: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...
    def remove_remote_agent(self, name: str) -> None: ...
    def initialize_xfer(
        self, op: str, local: object, remote: object, remote_agent: str, notif_msg: bytes = b""
    ) -> XferHandle: ...
    def transfer(self, handle: XferHandle) -> str: ...
    def check_xfer_state(self, handle: XferHandle) -> str: ...


def region_of(tensor: torch.Tensor) -> RegionKey | None:
    """The allocation backing a tensor (its whole storage), or None for a tensor with no bytes."""
    if tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    if tensor.device.type == "cuda":
        return RegionKey("VRAM", tensor.device.index or 0, storage.data_ptr(), storage.nbytes())
    return RegionKey("DRAM", 0, storage.data_ptr(), storage.nbytes())


def exact_regions(spans: Sequence[Span | None]) -> list[RegionKey]:
    """The regions that expose exactly these bytes: overlapping or touching spans merged, nothing more.

    Why not the storage: a 4 KiB object that views a 1 MiB tensor would hand its readers the keys to
    the whole MiB (another user's data, on transports that bound reads by the registration).
    """
    merged: list[RegionKey] = []
    for s in sorted((s for s in spans if s is not None), key=lambda s: (s.mem, s.dev, s.addr)):
        last = merged[-1] if merged else None
        if last is not None and (last.mem, last.dev) == (s.mem, s.dev) and s.addr <= last.addr + last.nbytes:
            merged[-1] = last._replace(nbytes=max(last.nbytes, s.addr + s.nbytes - last.addr))
        else:
            merged.append(RegionKey(s.mem, s.dev, s.addr, s.nbytes))
    return merged


@dataclass(frozen=True)
class Span:
    """The bytes of one tensor as a NIXL transfer descriptor: (memory type, device, address, length)."""

    mem: str
    dev: int
    addr: int
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Span | None:
        if tensor.numel() == 0:
            return None
        if tensor.device.type == "cuda":
            return cls("VRAM", tensor.device.index or 0, tensor.data_ptr(), tensor.nbytes)
        return cls("DRAM", 0, tensor.data_ptr(), tensor.nbytes)

    def to_json(self) -> list[str | int]:
        return [self.mem, self.dev, self.addr, self.nbytes]


def coalesce(pairs: Sequence[tuple[Span, Span]]) -> list[tuple[Span, Span]]:
    """(remote, local) descriptor pairs with each run that touches on both sides merged into one pair.

    Why: a READ costs per descriptor (the list built here, NIXL's checks, one UCX get each), and a
    state dict's pack buffer lays its tensors end to end, as a landing buffer does: 2,000 descriptors
    of 3 KB become one of 6 MB. Safe only where each side's run lies in one registration: on the
    source, touching spans of one object are one region (`exact_regions`); on the reader, the caller
    passes only pairs whose local side is one registered buffer (a landing buffer).
    """
    out: list[tuple[Span, Span]] = []
    for r, m in pairs:
        if out:
            lr, lm = out[-1]
            if (
                (lr.mem, lr.dev, lm.mem, lm.dev) == (r.mem, r.dev, m.mem, m.dev)
                and lr.addr + lr.nbytes == r.addr
                and lm.addr + lm.nbytes == m.addr
            ):
                out[-1] = (
                    Span(lr.mem, lr.dev, lr.addr, lr.nbytes + r.nbytes),
                    Span(lm.mem, lm.dev, lm.addr, lm.nbytes + m.nbytes),
                )
                continue
        out.append((r, m))
    return out


def nixl_error_name(exc: BaseException) -> str:
    """NIXL raises one exception class per status (nixlRemoteDisconnectError ...): keep the status text."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def _make_agent(name: str, progress_thread: bool, progress_delay_us: int) -> _NixlImpl:
    api = nixl_api()
    base: Any = api.nixl_agent  # untyped (nixl ships no stubs)

    class _Agent(base):  # type: ignore[misc]  # subclasses nixl's untyped nixl_agent
        """nixl_agent with a progress-thread poll delay (see the module docstring)."""

        def __init__(self) -> None:  # replaces nixl_agent.__init__: same attributes, our config
            bind = api.nixlBind
            cfg = bind.nixlAgentConfig()
            cfg.useProgThread = progress_thread
            cfg.useListenThread = False
            cfg.syncMode = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
            cfg.pthrDelay = progress_delay_us
            cfg.captureTelemetry = False
            self.agent = bind.nixlAgent(name, cfg)
            self.name = name
            # nixl_agent.__init__'s attributes, which its methods read (types as nixl 1.5.1 fills them).
            self._leaked_xfer_handles: list[Any] = []
            self.notifs: dict[str, list[bytes]] = {}
            self.backends: dict[str, Any] = {}
            self.backend_mems: dict[str, Any] = {}
            self.backend_options: dict[str, Any] = {}
            self.plugin_list = self.agent.getAvailPlugins()
            self.plugin_b_options: dict[str, Any] = {}
            self.plugin_mem_types: dict[str, Any] = {}
            if "UCX" not in self.plugin_list:
                raise TransportError(f"the NIXL UCX plugin is not available (plugins: {self.plugin_list})")
            self.backends["UCX"] = self.agent.createBackend("UCX", {})
            self.nixl_mems = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}
            self.nixl_ops = {"WRITE": bind.NIXL_WRITE, "READ": bind.NIXL_READ}

    return _Agent()


class NixlAgent:
    """One NIXL agent: one UCX context and worker, one progress thread.

    Source side: registers regions, describes them (partial metadata, descriptors).
    Reader side: loads remote metadata and reads into local tensors.
    """

    def __init__(self, name: str, *, progress_thread: bool = True, progress_delay_us: int = 1000) -> None:
        self.name = name
        try:
            self._impl: _NixlImpl | None = _make_agent(name, progress_thread, progress_delay_us)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"creating NIXL agent {name} failed: {nixl_error_name(exc)}") from exc
        self._lock = threading.Lock()
        self._graveyard: list[
            tuple[list[XferHandle], list[torch.Tensor]]
        ] = []  # transfers that could not be cancelled yet
        self.local_registrations = 0
        self.local_deregistrations = 0
        self.read_requests = 0  # NIXL READ requests posted by `read` (one per memory-type pair)
        self.read_bytes = 0  # bytes those requests' descriptors cover: what crossed the wire
        self.read_descriptors = 0  # descriptors those requests carried, after `coalesce`

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the NIXL agent (its UCX worker): remote endpoints connected to it fail from now on."""
        self._reap(final=True)
        impl, self._impl = self._impl, None
        del impl  # the pybind destructor tears the UCX worker down here (measured 3-5 ms)

    @property
    def closed(self) -> bool:
        return self._impl is None

    def _a(self) -> _NixlImpl:
        if self._impl is None:
            raise TransportError(f"NIXL agent {self.name} is closed")
        return self._impl

    # -- source side -------------------------------------------------------------------
    def _reg_dlists(self, keys: Iterable[RegionKey]) -> list[tuple[str, RegDList]]:
        bind = nixl_api().nixlBind
        groups: dict[str, list[tuple[int, int, int, str]]] = {}
        for key in keys:
            groups.setdefault(key.mem, []).append((key.addr, key.nbytes, key.dev, ""))
        segs = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}
        return [(mem, bind.nixlRegDList(segs[mem], rows)) for mem, rows in groups.items()]

    def register(self, keys: Sequence[RegionKey]) -> None:
        """Register regions (the ledger guarantees none is registered here already)."""
        done: list[RegDList] = []
        try:
            for _, dlist in self._reg_dlists(keys):
                self._a().register_memory(dlist)
                done.append(dlist)
        except Exception as exc:
            for dlist in done:
                self._a().deregister_memory(dlist)
            raise TransportError(f"NIXL register on {self.name} failed: {nixl_error_name(exc)}") from exc

    def deregister(self, keys: Sequence[RegionKey]) -> None:
        """Deregister regions (each named once: a list naming a region twice crashes NIXL)."""
        if len(set(keys)) != len(keys):
            raise TransportError("refusing to deregister a list that names a region twice")
        for _, dlist in self._reg_dlists(keys):
            try:
                self._a().deregister_memory(dlist)
            except Exception as exc:
                raise TransportError(f"NIXL deregister on {self.name} failed: {nixl_error_name(exc)}") from exc

    def partial_metadata(self, keys: Sequence[RegionKey]) -> bytes:
        """Connection info plus the keys of just these regions: what a reader of them must load."""
        bind = nixl_api().nixlBind
        if not keys:
            return self._a().get_partial_agent_metadata(bind.nixlRegDList(bind.DRAM_SEG), inc_conn_info=True)
        dlists = self._reg_dlists(keys)
        if len(dlists) == 1:
            return self._a().get_partial_agent_metadata(dlists[0][1], inc_conn_info=True)
        # DRAM and VRAM regions in one object: one blob per memory type would need two loads;
        # the full metadata covers both (rare: objects usually live on one device). The store
        # then treats every region of this agent as seen by the reader.
        return self._a().get_agent_metadata()

    def serialized_descriptors(self, spans: Sequence[Span]) -> bytes | None:
        """NIXL's own serialized xfer descriptor list (for raw NIXL readers); None if mixed memory types."""
        if not spans or len({s.mem for s in spans}) != 1:
            return None
        bind = nixl_api().nixlBind
        seg = bind.DRAM_SEG if spans[0].mem == "DRAM" else bind.VRAM_SEG
        dlist = bind.nixlXferDList(seg, [(s.addr, s.nbytes, s.dev) for s in spans])
        return self._a().get_serialized_descs(dlist)

    # -- reader side -------------------------------------------------------------------
    def load_remote(self, metadata: bytes) -> str:
        """Load (or extend) a remote agent's metadata; returns its name."""
        try:
            name = self._a().add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"loading remote NIXL metadata failed: {nixl_error_name(exc)}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, name: str) -> None:
        """Connect to a loaded remote agent now (UCX wireup), not on the first READ from it."""
        try:
            self._a().make_connection(name)
        except Exception as exc:
            raise TransportError(f"connecting to NIXL agent {name} failed: {nixl_error_name(exc)}") from exc

    def progress_for(self, seconds: float, every: float = 0.001) -> None:
        """Progress this agent's worker every `every` s for `seconds` (a reader without a progress thread).

        Why: `connect` only starts UCX's wireup; the handshake's answers are handled when this worker is
        next progressed. Without a progress thread that was the first READ's wait, 6-10 ms here (the source's
        progress thread answers on its 1 ms poll, several round trips); progressed right after `connect`,
        off a read's path, the first READ took 0.2-0.3 ms on a quiet machine and 0.3-2.8 ms under load (two
        processes, 27 spans of 11 KB, cma; 10 ms of progress was enough quiet, 5 ms was not). Every 1 ms did
        as well as every 0.2 ms, with a fifth of the wake-ups. A progress thread on the reader did not help
        (9 ms): it sleeps its poll delay between progresses."""
        if self._impl is None:
            return
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._impl.get_new_notifs()
            time.sleep(every)

    def notifications(self) -> dict[str, list[bytes]]:
        """Messages remote agents sent with their transfers since the last call (progresses the worker)."""
        if self._impl is None:
            return {}
        return self._impl.get_new_notifs()

    def forget_remote(self, name: str) -> None:
        """Drop a remote agent's cached metadata and disconnect from it (no error if unknown)."""
        if self._impl is None:
            return
        try:
            self._impl.remove_remote_agent(name)
        except Exception as exc:  # NOT_FOUND: never loaded or already removed
            log.debug("forget remote agent %s: %s", name, nixl_error_name(exc))

    def read(
        self,
        remote_agent: str,
        remote: Sequence[Span],
        local: Sequence[torch.Tensor],
        *,
        deadline: float,
        abort: threading.Event | None = None,
        registered: bool = False,
        notify: bytes = b"",
    ) -> bool:
        """One-sided READ of `remote` spans into `local` tensors (same order, same sizes).

        Returns when every byte arrived; raises TransportError on a NIXL error, on timeout
        or on abort. `registered`: the local memory is registered already (landing buffers).
        `notify`: a message NIXL delivers to the remote agent once the data has been read; sent
        only when the read is a single transfer (returns whether it was sent).
        A transfer that cannot be cancelled keeps its tensors referenced in a graveyard
        until NIXL lets go of it, so no memory NIXL may still write is reused.
        (Splitting one read over several posting threads was measured and does not help:
        two concurrent cma copies of 64 MiB ran at 4.1 GB/s together, one alone at 4.6.)
        """
        self._reap()
        regs = [] if registered else self._register_local(list(local))
        try:
            pairs = []
            for r, t in zip(remote, local, strict=True):
                mine = Span.of(t)
                assert mine is not None and mine.nbytes == r.nbytes
                pairs.append((r, mine))
            if registered:  # one landing buffer: touching runs read as one descriptor
                pairs = coalesce(pairs)
            notified = len({(r.mem, m.mem) for r, m in pairs}) == 1 and bool(notify)
            self._transfer(remote_agent, pairs, deadline, abort, notify if notified else b"", local)
            return notified
        finally:
            self._deregister_local(regs)

    # -- prepared reads: created once, re-posted per fetch ------------------------------
    def prepare_read(self, remote_agent: str, remote: Sequence[Span], local: Sequence[Span]) -> XferHandle | None:
        """A READ of `remote` into registered `local` memory, created once to be re-posted (`repost`).

        Why: creating, posting and releasing a transfer per fetch is most of a small fetch's time
        (descriptor lists built in Python, NIXL's checks and backend preparation per request). A
        request re-posted reads the same remote bytes into the same local bytes again; the caller
        owns keeping those local bytes free for it and releasing it (`release_prepared`) before the
        local memory is deregistered or the remote agent forgotten. None when the spans mix memory
        types (one request cannot carry them): the caller reads the ordinary way.
        """
        if not remote or len({r.mem for r in remote}) != 1 or len({m.mem for m in local}) != 1:
            return None
        bind = nixl_api().nixlBind
        segs = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}
        pairs = coalesce(list(zip(remote, local, strict=True)))  # `local` is one bound landing buffer
        ldl = bind.nixlXferDList(segs[local[0].mem], [(m.addr, m.nbytes, m.dev) for _, m in pairs])
        rdl = bind.nixlXferDList(segs[remote[0].mem], [(r.addr, r.nbytes, r.dev) for r, _ in pairs])
        try:
            return self._a().initialize_xfer("READ", ldl, rdl, remote_agent)
        except Exception as exc:
            raise TransportError(f"preparing a NIXL read from {remote_agent} failed: {nixl_error_name(exc)}") from exc

    def repost(self, handle: XferHandle, deadline: float, abort: threading.Event | None = None) -> None:
        """Post a prepared READ again and wait for it (TransportError on error, timeout or abort)."""
        try:
            state = self._a().transfer(handle)
            if state != "DONE":
                self._wait([handle], [state], deadline, abort)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"NIXL read failed: {nixl_error_name(exc)}") from exc

    def release_prepared(self, handle: XferHandle, keep: Sequence[torch.Tensor]) -> None:
        """Release a prepared READ; one NIXL cannot release yet keeps `keep` (its local memory) alive."""
        self._release([handle], keep)

    def _transfer(
        self,
        remote_agent: str,
        items: list[tuple[Span, Span]],
        deadline: float,
        abort: threading.Event | None,
        notify: bytes,
        keep: Sequence[torch.Tensor],
    ) -> None:
        """Post one transfer per memory-type pair and wait for all of them."""
        bind = nixl_api().nixlBind
        segs = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}
        groups: dict[tuple[str, str], list[tuple[Span, Span]]] = {}
        for r, m in items:
            groups.setdefault((r.mem, m.mem), []).append((r, m))
        handles: list[XferHandle] = []
        try:
            for (rmem, lmem), group in groups.items():
                ldl = bind.nixlXferDList(segs[lmem], [(m.addr, m.nbytes, m.dev) for _, m in group])
                rdl = bind.nixlXferDList(segs[rmem], [(r.addr, r.nbytes, r.dev) for r, _ in group])
                handles.append(self._a().initialize_xfer("READ", ldl, rdl, remote_agent, notif_msg=notify))
            states = [self._a().transfer(h) for h in handles]
            with self._lock:
                self.read_requests += len(handles)
                self.read_bytes += sum(r.nbytes for r, _ in items)
                self.read_descriptors += len(items)
            self._wait(handles, states, deadline, abort)
        except TransportError:
            self._release(handles, keep)
            raise
        except Exception as exc:
            self._release(handles, keep)
            raise TransportError(f"NIXL read from {remote_agent} failed: {nixl_error_name(exc)}") from exc
        self._release(handles, keep)

    def _wait(
        self, handles: list[XferHandle], states: list[str], deadline: float, abort: threading.Event | None
    ) -> None:
        spin_until = time.monotonic() + 0.005
        while True:
            if "ERR" in states:
                raise TransportError("NIXL transfer ended in ERR")
            if all(s == "DONE" for s in states):
                return
            now = time.monotonic()
            if abort is not None and abort.is_set():
                raise TransportError("transfer aborted")
            if now > deadline:
                raise TransportError("transfer timed out")
            if now > spin_until:
                time.sleep(0.00005)
            states = [s if s == "DONE" else self._a().check_xfer_state(h) for s, h in zip(states, handles, strict=True)]

    def _release(self, handles: list[XferHandle], local: Sequence[torch.Tensor]) -> None:
        stuck: list[XferHandle] = []
        for h in handles:
            try:
                h.release()
            except Exception as exc:  # still active and not cancellable: keep its memory alive
                log.warning("NIXL transfer handle could not be released yet: %s", nixl_error_name(exc))
                stuck.append(h)
        if stuck:
            with self._lock:
                self._graveyard.append((stuck, list(local)))

    def _reap(self, final: bool = False) -> None:
        with self._lock:
            graves, self._graveyard = self._graveyard, []
        keep: list[tuple[list[XferHandle], list[torch.Tensor]]] = []
        for handles, tensors in graves:
            left: list[XferHandle] = []
            for h in handles:
                try:
                    h.release()
                except Exception:
                    left.append(h)
            if left:
                keep.append((left, tensors))
        if keep:
            if final:
                log.error("%d NIXL transfers could not be cancelled before closing %s", len(keep), self.name)
            with self._lock:
                self._graveyard.extend(keep)

    def _register_local(self, tensors: Sequence[torch.Tensor]) -> list[RegDList]:
        keys = list(dict.fromkeys(k for k in (region_of(t) for t in tensors) if k is not None))
        dlists = [d for _, d in self._reg_dlists(keys)]
        done: list[RegDList] = []
        try:
            for d in dlists:
                self._a().register_memory(d)
                done.append(d)
        except Exception as exc:
            self._deregister_local(done)
            raise TransportError(f"registering fetch buffers failed: {nixl_error_name(exc)}") from exc
        with self._lock:
            self.local_registrations += sum(d.descCount() for d in done)
        return done

    def _deregister_local(self, dlists: list[RegDList]) -> None:
        for d in dlists:
            try:
                self._a().deregister_memory(d)
            except Exception as exc:
                log.error("deregistering fetch buffers failed: %s", nixl_error_name(exc))
                continue
            with self._lock:
                self.local_deregistrations += d.descCount()
