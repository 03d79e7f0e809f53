"""Reference handles: what a workload holds for a GPUObject, and what it passes to another pod.

Teardown without deserialization (docs/design.md): dropping a handle, or exiting with handles
alive, releases the reference without fetching or deserializing anything. A handle's finalizer only hands plain
data (kind, namespace, name, uid) to the client's release queue; it touches no
tensor, imports nothing and performs no I/O itself, so it is safe at interpreter
shutdown.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuobj_contract.layouts import TensorLayout

if TYPE_CHECKING:
    from gpuobj.client.agent_seam import Grant  # annotations only: handles stay importable without torch

__all__ = ["ObjectAddress", "ObjectRef", "SharedRef", "TensorLayout"]


@dataclass(frozen=True)
class ObjectAddress:
    """Everything needed to find and read an object: plain, picklable data."""

    namespace: str
    name: str
    uid: str
    object_id: str
    source_pod: str
    source_endpoint: str
    layouts: tuple[TensorLayout, ...] = field(default_factory=tuple)
    # A state dict's names: (name, index into layouts); tied names share an index. Empty: a list object.
    entries: tuple[tuple[str, int], ...] = ()
    # The source pod's uid: requests to its agent name it, and over TLS its certificate must (docs/security.md).
    source_pod_uid: str = ""

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for t in self.layouts)


ReleaseFn = Callable[..., None]  # (kind, namespace, name, uid, via): plain data only


class ObjectRef:
    """A live reference to a GPUObject held by this process.

    ``kind`` is "owner" (this process put the object; releasing deletes the GPUObject),
    "claim" (a GPUObjectClaim held by this pod; releasing deletes the claim) or
    "address" (an unowned copy, e.g. unpickled: releasing does nothing).
    """

    __slots__ = (
        "__weakref__",
        "_finalizer",
        "_record",
        "address",
        "claim_name",
        "claim_uid",
        "expires_at",
        "grant",
        "kind",
        "via",
    )

    def __init__(
        self,
        address: ObjectAddress,
        kind: str,
        release: ReleaseFn | None,
        *,
        claim_name: str | None = None,
        claim_uid: str | None = None,
        record: Any = None,
        grant: Grant | None = None,
        via: tuple[str, str] | None = None,
        expires_at: float | None = None,
    ) -> None:
        self.address = address
        self.expires_at = expires_at  # a claim with a ttl: when (time.time()) the operator drops it
        self.kind = kind
        self.claim_name = claim_name
        self.claim_uid = claim_uid
        self.grant = grant  # a read grant from the source (hand-off): fetch needs no request
        # where a hand-off claim's release goes: (endpoint, pod uid) of the source agent that queued it
        self.via = via
        self._record = record  # the write-behind record, while this process writes it
        self._finalizer: weakref.finalize[..., ObjectRef] | None = None
        if release is not None and kind == "owner":
            self._finalizer = weakref.finalize(
                self, release, "object", address.namespace, address.name, address.uid, None
            )
        elif release is not None and kind == "claim":
            assert claim_name
            self._finalizer = weakref.finalize(
                self, release, "claim", address.namespace, claim_name, claim_uid or "", via
            )

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def namespace(self) -> str:
        return self.address.namespace

    @property
    def alive(self) -> bool:
        """True until released (explicitly, or when the handle was collected)."""
        return self._finalizer is not None and self._finalizer.alive

    @property
    def expired(self) -> bool:
        """True once the claim's ttl has passed: the handle refuses to read from then on."""
        return self.expires_at is not None and time.time() >= self.expires_at

    @property
    def pending(self) -> bool:
        """True while an API write about this reference (its record, or its release) has not landed."""
        return bool(self._record is not None and self._record.pending)

    @property
    def failed(self) -> BaseException | None:
        """Why the API refused to record this reference (its bytes were freed), else None."""
        return None if self._record is None else self._record.failed

    def release(self) -> None:
        """Drop this reference now. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    def detach(self) -> None:
        """Forget the reference without releasing it (it was handed to someone else)."""
        if self._finalizer is not None:
            self._finalizer.detach()

    def __reduce__(self) -> tuple[Callable[[ObjectAddress], ObjectRef], tuple[ObjectAddress]]:
        # A pickled handle carries the address only: the receiving process holds no
        # reference until it adopts a share or borrows (see Client.share / Client.adopt).
        return (_rebuild_address_ref, (self.address,))

    def __repr__(self) -> str:
        state = "live" if self.alive else ("unowned" if self._finalizer is None else "released")
        return f"<ObjectRef {self.address.namespace}/{self.address.name} {self.kind} {state}>"


def _rebuild_address_ref(address: ObjectAddress) -> ObjectRef:
    return ObjectRef(address, "address", None)


@dataclass(frozen=True)
class SharedRef:
    """A reference claimed on a receiver pod's behalf, ready to send (pickle, queue, HTTP).

    The claim already exists and is owned by the receiver pod, so the sender may drop its
    own reference at once: nothing is freed between hand-off and adoption (docs/design.md, "Borrow and hand-off").
    """

    address: ObjectAddress
    claim_name: str
    claim_uid: str  # "" while the source's write-behind has not recorded the claim
    holder_pod: str
    read_once: bool = False  # the receiver's handle releases itself after its first completed fetch
    grant: Grant | None = None  # read grant from the source: a fetch needs no request (see the agent's Reads.grant)
    release_via: str | None = None  # the source agent that takes this claim's release
    expires_at: float | None = None  # the claim's ttl from its making (time.time()): the receiver's handle ends then
