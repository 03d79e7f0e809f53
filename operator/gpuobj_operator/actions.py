"""The action vocabulary: what the decisions ask the reconciler to do. Plain data.

Why apart: the decisions (decisions.py) return these and the reconciler executes them
through a table from type to executor; neither needs the other's module to name them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuobj_operator.model import Key


@dataclass(frozen=True)
class Action:
    """Something the reconciler must do against the API or an agent."""


@dataclass(frozen=True)
class LookupPod(Action):
    namespace: str
    name: str


@dataclass(frozen=True)
class AddFinalizer(Action):
    key: Key
    uid: str


@dataclass(frozen=True)
class Materialize(Action):
    key: Key
    uid: str
    endpoint: str
    object_id: str
    pod_uid: str = ""


@dataclass(frozen=True)
class Free(Action):
    """Free on the source agent, then drop the finalizer. The reconciler re-checks claims first."""

    key: Key
    uid: str
    object_id: str
    endpoint: str
    bytes: int
    reason: str
    pod_uid: str = ""  # the agent must serve this pod (checked by the agent on the same call)


@dataclass(frozen=True)
class ReleaseWithoutFree(Action):
    """Drop the finalizer of an object whose bytes are already gone (source pod lost)."""

    key: Key
    uid: str
    reason: str


@dataclass(frozen=True)
class DeleteObject(Action):
    key: Key
    uid: str
    reason: str
    message: str


@dataclass(frozen=True)
class PatchObjectStatus(Action):
    key: Key
    status: dict[str, Any]


@dataclass(frozen=True)
class PatchClaimStatus(Action):
    key: Key
    status: dict[str, Any]


@dataclass(frozen=True)
class SetClaimOwner(Action):
    key: Key
    uid: str
    pod_name: str
    pod_uid: str


@dataclass(frozen=True)
class DeleteClaim(Action):
    key: Key
    uid: str
    reason: str
    holder: str = "pod"  # what is gone: the holder pod, or only its process ("process")


@dataclass(frozen=True)
class Requeue(Action):
    """Decide this again after ``seconds`` (a claim's TTL runs out then)."""

    kind: str
    key: Key
    seconds: float


@dataclass(frozen=True)
class PatchStreamStatus(Action):
    key: Key
    status: dict[str, Any]


@dataclass(frozen=True)
class FinishStream(Action):
    """A deleted stream whose items are all gone: free unreported items on the producer, drop the finalizer."""

    key: Key
    uid: str
    producer_endpoint: str | None
    producer_uid: str = ""


@dataclass(frozen=True)
class Emit(Action):
    """A Kubernetes Event about an object."""

    kind: str
    key: Key
    uid: str
    type: str
    reason: str
    message: str
