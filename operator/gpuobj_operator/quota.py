"""Per-namespace byte quotas: each namespace's running sum of recorded bytes, and which objects are refused.

Why in the operator: it is the one place that sees every GPUObject of every pod of a namespace (its
ledger), so a sum across pods costs one addition per event. Admission sees one request at a time and
cannot sum; an agent knows its own pod only. The price: a put is counted when its record lands (after
the write window), so an object over the quota is refused after its bytes were stored: it is marked
Failed (reason QuotaExceeded, with an Event) and, if it holds bytes, deleted so that they are freed.

Rules (docs/security.md, "Quotas"):
- An object counts from the moment the ledger first admits it until its record is gone (its bytes are
  held until the free), except once it is Failed (a Failed object holds no bytes, or is a refused one).
- A new object (no state yet) is admitted if the namespace's sum plus its bytes stays within the quota;
  else it is refused, for good (a quota raised later does not bring it back).
- An object that was admitted before (Ready, Releasing or Lost, or already being deleted) is admitted
  whatever the sum: a lowered quota or an operator restart never refuses bytes already accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuobj_contract import names
from gpuobj_operator.model import Key, ObjectInfo

REASON = names.REASON_QUOTA_EXCEEDED

_UNITS = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
_QUANTITY = re.compile(r"([0-9]+)([kKMGTP]i?|)")


def parse_bytes(text: str) -> int:
    """A byte count as Kubernetes writes memory quantities (`8Gi`, `500M`, `1048576`); whole numbers only."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a byte quantity (e.g. 8Gi, 512Mi, 500M or a number of bytes)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_namespace_quota(text: str) -> tuple[str, int]:
    """`team-a=8Gi` -> ("team-a", 8 GiB), as the operator's `--namespace-quota` flag takes it."""
    namespace, sep, quantity = text.partition("=")
    if not sep or not namespace.strip():
        raise ValueError(f"{text!r}: expected NAMESPACE=BYTES, e.g. team-a=8Gi")
    return namespace.strip(), parse_bytes(quantity)


@dataclass(frozen=True)
class QuotaLimits:
    """What a platform team set: a quota per namespace, and one for every namespace not listed (None: none)."""

    namespaces: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    default: int | None = None

    def limit(self, namespace: str) -> int | None:
        return self.namespaces.get(namespace, self.default)


@dataclass
class QuotaBook:
    """The running sums. Fed by the ledger on every object event (O(1) each); read by the decisions."""

    limits: QuotaLimits = field(default_factory=QuotaLimits)
    used: dict[str, int] = field(default_factory=dict)  # namespace -> bytes of admitted objects
    refusals: dict[str, int] = field(default_factory=dict)  # namespace -> objects refused (a counter)
    _counted: dict[Key, tuple[str, int]] = field(default_factory=dict)  # key -> (uid, bytes counted)
    _refused: dict[Key, tuple[str, str]] = field(default_factory=dict)  # key -> (uid, why)

    def observe(self, obj: ObjectInfo) -> None:
        """The ledger holds this version of the object now: admit, refuse or re-count it."""
        refused = self._refused.get(obj.key)
        if refused is not None:
            if refused[0] == obj.uid:
                return  # refused for good
            del self._refused[obj.key]  # a new object of the same name
        counted = self._counted.get(obj.key)
        if counted is not None and counted[0] != obj.uid:
            self._uncount(obj.key)
            counted = None
        if obj.state == names.STATE_FAILED:
            self._uncount(obj.key)
            if _failed_for_quota(obj):  # refused before (an operator restart): still refused
                self._refused[obj.key] = (obj.uid, _ready_message(obj))
            return
        if counted is not None:
            if counted[1] != obj.bytes:  # the schema keeps tensors fixed; recount rather than drift
                self._uncount(obj.key)
                self._count(obj)
            return
        limit = self.limits.limit(obj.namespace)
        held = self.used.get(obj.namespace, 0)
        admitted_before = obj.deleting or obj.state in (names.STATE_READY, names.STATE_RELEASING, names.STATE_LOST)
        if limit is None or admitted_before or held + obj.bytes <= limit:
            self._count(obj)
            return
        self._refused[obj.key] = (
            obj.uid,
            f"namespace {obj.namespace} would hold {held + obj.bytes} bytes of GPUObjects with this one "
            f"({obj.bytes} bytes), over its quota of {limit} bytes ({held} held): release objects there, or "
            "ask the platform team for a larger quota (chart value quota.namespaces)",
        )
        self.refusals[obj.namespace] = self.refusals.get(obj.namespace, 0) + 1

    def forget(self, obj: ObjectInfo) -> None:
        """The record is gone (its bytes were freed, or went with their pod)."""
        counted = self._counted.get(obj.key)
        if counted is not None and counted[0] == obj.uid:
            self._uncount(obj.key)
        refused = self._refused.get(obj.key)
        if refused is not None and refused[0] == obj.uid:
            del self._refused[obj.key]

    def refusal(self, obj: ObjectInfo) -> str | None:
        """Why this object is refused, or None if it is not."""
        refused = self._refused.get(obj.key)
        return refused[1] if refused is not None and refused[0] == obj.uid else None

    def _count(self, obj: ObjectInfo) -> None:
        self._counted[obj.key] = (obj.uid, obj.bytes)
        self.used[obj.namespace] = self.used.get(obj.namespace, 0) + obj.bytes

    def _uncount(self, key: Key) -> None:
        counted = self._counted.pop(key, None)
        if counted is None:
            return
        left = self.used.get(key[0], 0) - counted[1]
        if left > 0:
            self.used[key[0]] = left
        else:
            self.used.pop(key[0], None)  # no series left behind for a namespace that holds nothing


def _ready_message(obj: ObjectInfo) -> str:
    ready = obj.status.condition(names.CONDITION_READY)
    return ready.message if ready is not None else ""


def _failed_for_quota(obj: ObjectInfo) -> bool:
    ready = obj.status.condition(names.CONDITION_READY)
    return ready is not None and ready.reason == REASON
