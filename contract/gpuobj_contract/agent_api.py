"""The agent control API as code: its routes and JSON shapes, one home for the agent, the operator,
the client and the benchmarks (docs/agent-api.md describes the same in words).

Why typed shapes: a field renamed on one side used to fail as a KeyError (or worse, a default)
on the other. Each shape parses what it receives with `from_json` (unknown fields are ignored:
a newer agent may add some) and writes what it sends with `to_json`; plain Python, no I/O.

Request bodies (MaterializeRequest, FreeRequest, ReadRequest) are the exception: the agent reads
them from callers it does not trust, so their `from_json` is strict. A body that is not an object,
an unknown field (a misspelt `waitfence` would otherwise do nothing), or a value of the wrong type
or range is a RequestError naming the field; the agent answers it with a 400 and changes nothing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar
from urllib.parse import quote

from gpuobj_contract import patterns
from gpuobj_contract.layouts import LayoutError, TensorLayout, parse_layouts

Parsed = TypeVar("Parsed")  # what ParseMemo keeps: parsed layouts or spans

# A NIXL READ posted with this notification message ends the read ticket `<readId>` at the source.
READ_END_NOTIF_PREFIX = "gpuobj-read-end:"


def is_object_id(text: object) -> bool:
    """An object id as spec.objectId allows it (patterns.OBJECT_ID, matched in full: "o-1\n" is not one)."""
    return patterns.OBJECT_ID.matches(text)


def is_stream_name(text: object) -> bool:
    """A stream name: its GPUObjectStream's object name (patterns.STREAM_NAME)."""
    return patterns.STREAM_NAME.matches(text)


class RequestError(ValueError):
    """A request body the agent refuses (its 400): the message names the field and what it must be."""


MAX_SHARED_WITH = 64  # spec.sharedWith's maxItems
MAX_REASON = 1024
MAX_READER = 256


def request_fields(data: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """A request body's fields: a JSON object with none but ``allowed`` (RequestError otherwise)."""
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    unknown = set(data) - allowed
    if unknown:
        raise RequestError(f"unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return data


def _optional_text(data: dict[str, Any], key: str, max_length: int) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_length:
        raise RequestError(f"{key} must be a string of at most {max_length} characters")
    return value


def _optional_match(data: dict[str, Any], key: str, pattern: patterns.TextPattern, what: str) -> str | None:
    value = data.get(key)
    if value is not None and not pattern.matches(value):
        raise RequestError(f"{key} {str(value)[:80]!r} is not valid: {what}")
    return value


def _namespaces(data: dict[str, Any], key: str) -> tuple[str, ...]:
    value = data.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_SHARED_WITH:
        raise RequestError(f"{key} must be a list of at most {MAX_SHARED_WITH} namespace names")
    for ns in value:
        if not patterns.NAMESPACE.matches(ns):
            raise RequestError(f"{key}: {str(ns)[:80]!r} is not a namespace name")
    if len(set(value)) != len(value):
        raise RequestError(f"{key} names a namespace twice (it is a set)")
    return tuple(value)


OBJECT_ID_RULE = "1-128 characters of [A-Za-z0-9._-]"
STREAM_NAME_RULE = (
    "a Kubernetes object name (1-253 characters of [a-z0-9.-], starting and ending with a letter or digit)"
)


class Route(NamedTuple):
    """One endpoint: its method and path template (aiohttp's `{name}` syntax)."""

    method: str
    template: str

    def path(self, **params: str) -> str:
        """The concrete path, every parameter percent-encoded."""
        return self.template.format(**{k: quote(str(v), safe="") for k, v in params.items()})


HEALTHZ = Route("GET", "/healthz")
READYZ = Route("GET", "/readyz")
METRICS = Route("GET", "/metrics")
INFO = Route("GET", "/v1/info")
INVENTORY = Route("GET", "/v1/objects")
GET_OBJECT = Route("GET", "/v1/objects/{id}")
MATERIALIZE = Route("PUT", "/v1/objects/{id}")
BEGIN_READ = Route("POST", "/v1/objects/{id}/reads")
END_READ = Route("DELETE", "/v1/reads/{read_id}")
FREE = Route("POST", "/v1/objects/{id}/free")
FREE_STREAM = Route("POST", "/v1/streams/{stream}/free")
RELEASE_HANDOFF = Route("POST", "/v1/claims/{claim}/release")

OPEN_ROUTES = (HEALTHZ, READYZ, METRICS)  # no credential needed
MAX_WRITE_RATE = 1e6  # writes a second: the most a probe may tell one agent (names.HEADER_WRITE_RATE)
PROTECTED_PREFIX = "/v1/"


@dataclass(frozen=True)
class ErrorAnswer:
    """Every refusal: the HTTP status says which kind, `error` says what to do."""

    error: str

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ErrorAnswer:
        return cls(str(data.get("error", "")))


@dataclass(frozen=True)
class HealthAnswer:
    """HEALTHZ ("ok") and READYZ ("ready", with the active NIXL agent)."""

    status: str
    nixl_agent: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, **({"nixlAgent": self.nixl_agent} if self.nixl_agent else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HealthAnswer:
        return cls(str(data.get("status", "")), data.get("nixlAgent"))


@dataclass(frozen=True)
class AgentInfo:
    """INFO: whose agent this is (pod, namespace, UID, process incarnation) and its NIXL agents."""

    pod: str
    namespace: str
    pod_uid: str
    incarnation: str
    nixl_agent: str | None = None  # the active one; None while starting or stopping
    nixl_agents: tuple[str, ...] = ()  # every live one (active and sealed)
    started_at: str = ""
    endpoint: str = ""
    write_rate: float | None = None  # the pod's share of the fleet's write budget as last told (writes/s)

    def to_json(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "namespace": self.namespace,
            "podUID": self.pod_uid,
            "incarnation": self.incarnation,
            "nixlAgent": self.nixl_agent,
            "nixlAgents": list(self.nixl_agents),
            "startedAt": self.started_at,
            "endpoint": self.endpoint,
            "writeRate": self.write_rate,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentInfo:
        return cls(
            pod=str(data.get("pod", "")),
            namespace=str(data.get("namespace", "")),
            pod_uid=str(data.get("podUID", "")),
            incarnation=str(data.get("incarnation", "")),
            nixl_agent=data.get("nixlAgent"),
            nixl_agents=tuple(str(n) for n in data.get("nixlAgents") or ()),
            started_at=str(data.get("startedAt", "")),
            endpoint=str(data.get("endpoint", "")),
            write_rate=_rate_or_none(data.get("writeRate")),
        )


def _rate_or_none(value: Any) -> float | None:
    """INFO's writeRate as a number, or None when absent or not one (an older or broken agent's answer
    must not fail a probe: the rate only says what the agent was told)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass(frozen=True)
class ObjectDescription:
    """GET_OBJECT: one object as the agent holds it."""

    id: str
    bytes: int
    tensors: tuple[TensorLayout, ...]
    created_at: str
    stream: str | None = None
    stream_index: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "bytes": self.bytes,
            "tensors": [t.to_json() for t in self.tensors],
            "createdAt": self.created_at,
            "stream": self.stream,
            "streamIndex": self.stream_index,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ObjectDescription:
        return cls(
            id=str(data["id"]),
            bytes=int(data.get("bytes", 0)),
            tensors=tuple(TensorLayout.from_json(t, "tensors[]") for t in data.get("tensors", [])),
            created_at=str(data.get("createdAt", "")),
            stream=data.get("stream"),
            stream_index=data.get("streamIndex"),
        )


@dataclass(frozen=True)
class HandoffReleaseAnswer:
    """RELEASE_HANDOFF: the source's queue took the receiver's release (404 when it does not know the claim)."""

    released: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"released": self.released}


@dataclass(frozen=True)
class FreeRequest:
    """FREE's body (empty allowed). `reason` is for the agent's log; `wait_fence`: answer only once every
    NIXL agent that exposed the memory is destroyed (bounded), so `fenced` says the bytes are gone."""

    reason: str | None = None
    wait_fence: bool = False

    FIELDS: ClassVar[frozenset[str]] = frozenset({"reason", "waitFence"})

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"waitFence": self.wait_fence} if self.wait_fence else {}
        if self.reason:
            body["reason"] = self.reason
        return body

    @classmethod
    def from_json(cls, data: Any) -> FreeRequest:
        """Strict (see the module's doc): RequestError names the field."""
        data = request_fields(data, cls.FIELDS)
        wait_fence = data.get("waitFence", False)
        if not isinstance(wait_fence, bool):
            raise RequestError("waitFence must be true or false")
        return cls(reason=_optional_text(data, "reason", MAX_REASON), wait_fence=wait_fence)


@dataclass(frozen=True)
class FreeAnswer:
    """`freed`: this call released the object; false for an unknown or already freed id (free is idempotent)."""

    freed: bool
    bytes: int = 0
    waited_seconds: float = 0.0
    fenced: bool = True
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        if not self.freed:
            return {"freed": False, "reason": self.reason}
        return {"freed": True, "bytes": self.bytes, "waitedSeconds": self.waited_seconds, "fenced": self.fenced}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FreeAnswer:
        return cls(
            freed=bool(data.get("freed")),
            bytes=int(data.get("bytes", 0)),
            waited_seconds=float(data.get("waitedSeconds", 0.0)),
            fenced=bool(data.get("fenced", True)),
            reason=str(data.get("reason", "")),
        )


@dataclass(frozen=True)
class StreamFreeAnswer:
    freed: tuple[str, ...]
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"freed": list(self.freed), "bytes": self.bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamFreeAnswer:
        return cls(tuple(str(i) for i in data.get("freed", [])), int(data.get("bytes", 0)))


@dataclass(frozen=True)
class ReadEndAnswer:
    """`valid`: the read ended within its lease (its bytes are good); `expired`: it did not (discard them)."""

    ended: bool
    valid: bool
    expired: bool

    def to_json(self) -> dict[str, Any]:
        return {"ended": self.ended, "valid": self.valid, "expired": self.expired}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReadEndAnswer:
        return cls(bool(data.get("ended")), bool(data.get("valid")), bool(data.get("expired")))


@dataclass(frozen=True)
class MaterializeRequest:
    """Bind the tensors published under `key` (layouts must match), or allocate zeroed ones.

    `shared_with`: namespaces besides the source's own whose pods may read it (GPUObject spec.sharedWith).
    """

    tensors: tuple[TensorLayout, ...]
    key: str | None = None
    stream: str | None = None
    stream_index: int | None = None
    shared_with: tuple[str, ...] = ()

    FIELDS: ClassVar[frozenset[str]] = frozenset({"tensors", "key", "stream", "streamIndex", "sharedWith"})

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"tensors": [t.to_json() for t in self.tensors]}
        for name, value in (("key", self.key), ("stream", self.stream), ("streamIndex", self.stream_index)):
            if value is not None:
                body[name] = value
        if self.shared_with:
            body["sharedWith"] = list(self.shared_with)
        return body

    @classmethod
    def from_json(cls, data: Any) -> MaterializeRequest:
        """Strict (see the module's doc), with the GPUObject schema's rules: RequestError names the field.

        A stream item names both its stream and its index (spec.stream requires both), the index from 0."""
        data = request_fields(data, cls.FIELDS)
        try:
            tensors = tuple(parse_layouts(data.get("tensors"), "tensors"))
        except LayoutError as exc:
            raise RequestError(str(exc)) from None
        stream = _optional_match(data, "stream", patterns.STREAM_NAME, STREAM_NAME_RULE)
        index = data.get("streamIndex")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**63):
            raise RequestError("streamIndex must be a whole number from 0")
        if (stream is None) != (index is None):
            raise RequestError("stream and streamIndex go together: a stream item names both, other objects neither")
        return cls(
            tensors=tensors,
            key=_optional_match(data, "key", patterns.OBJECT_ID, OBJECT_ID_RULE),
            stream=stream,
            stream_index=index,
            shared_with=_namespaces(data, "sharedWith"),
        )


@dataclass(frozen=True)
class MaterializeAnswer:
    """`created`: this call made the object (false: it was there already, with the same layouts).
    `incarnation`: the agent process that holds the bytes, which the operator records in the status."""

    created: bool
    id: str
    bytes: int
    incarnation: str = ""
    description: ObjectDescription | None = None  # the object as GET_OBJECT describes it (written, not read)

    def to_json(self) -> dict[str, Any]:
        described = self.description.to_json() if self.description is not None else {}
        return {
            **described,
            "created": self.created,
            "id": self.id,
            "bytes": self.bytes,
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MaterializeAnswer:
        return cls(
            created=bool(data.get("created")),
            id=str(data.get("id", "")),
            bytes=int(data.get("bytes", 0)),
            incarnation=str(data.get("incarnation", "")),
        )


@dataclass(frozen=True)
class InventoryItem:
    id: str
    bytes: int
    age_seconds: float = 0.0
    stream: str | None = None
    stream_index: int | None = None
    key: str | None = None
    inflight_reads: int = 0
    freeing: bool = False
    # Its GPUObject is queued in this process's write-behind and not recorded yet (an API outage, say):
    # referenced by a live handle, so the audit never reclaims it (operator/gpuobj_operator/audit.py).
    record_pending: bool = False
    tensors: tuple[TensorLayout, ...] = ()
    created_at: str = ""  # RFC 3339 with milliseconds: with the id, its place in the pages (inventory_order)
    devices: tuple[str, ...] = ()
    # Unnamed, never shared, and not to be recorded (the client's recording policy, docs/design.md): held by
    # a live handle of the embedding process, whose bytes die with it; the audit neither counts nor reclaims it.
    private: bool = False

    def description(self) -> ObjectDescription:
        """The object as GET_OBJECT describes it: an inventory item is that and the agent's bookkeeping."""
        return ObjectDescription(self.id, self.bytes, self.tensors, self.created_at, self.stream, self.stream_index)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.description().to_json(),
            "devices": list(self.devices),
            "ageSeconds": self.age_seconds,
            "inflightReads": self.inflight_reads,
            "key": self.key,
            "freeing": self.freeing,
            "recordPending": self.record_pending,
            "private": self.private,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> InventoryItem:
        return cls(
            id=str(o["id"]),
            bytes=int(o.get("bytes", 0)),
            age_seconds=float(o.get("ageSeconds", 0.0)),
            stream=o.get("stream"),
            stream_index=o.get("streamIndex"),
            key=o.get("key"),
            inflight_reads=int(o.get("inflightReads", 0)),
            freeing=bool(o.get("freeing", False)),
            record_pending=bool(o.get("recordPending", False)),
            private=bool(o.get("private", False)),
            tensors=tuple(TensorLayout.from_json(t, "tensor") for t in o.get("tensors", [])),
            created_at=str(o.get("createdAt", "")),
            devices=tuple(str(d) for d in o.get("devices") or ()),
        )


# INVENTORY pages: `?limit=N` (1..MAX_INVENTORY_PAGE) answers at most N objects, oldest first, and a
# `continue` token when more follow; `?continue=TOKEN&limit=N` the next page. Without `limit` the
# answer holds every object (one answer; about 300 bytes an object).
MAX_INVENTORY_PAGE = 5000
INVENTORY_PAGE = 1000  # what the operator asks for: a 10,000-object store is ten answers of ~300 KB


def inventory_order(item: InventoryItem | dict[str, Any]) -> tuple[str, str]:
    """Where an object stands in the inventory's pages: its creation time, then its id. Both are fixed
    for the object's life, so an object held while the pages are read is on exactly one of them, however
    many others come and go meanwhile (a page boundary is a position in this order, not an offset)."""
    if isinstance(item, InventoryItem):
        return (item.created_at, item.id)
    return (str(item.get("createdAt", "")), str(item.get("id", "")))


def inventory_token(item: InventoryItem | dict[str, Any]) -> str:
    """The `continue` token after ``item``: its place in inventory_order."""
    created, object_id = inventory_order(item)
    return f"{created}|{object_id}"


def parse_inventory_token(token: str) -> tuple[str, str]:
    """The position a `continue` token names; ValueError for one no agent would have written."""
    created, sep, object_id = token.partition("|")
    if not sep or not is_object_id(object_id) or len(created) > 64:
        raise ValueError(f"not an inventory continue token: {token[:80]!r}")
    return created, object_id


@dataclass(frozen=True)
class Inventory:
    """What an agent holds, and whose agent it is (pod, UID, process incarnation). One page of it when
    ``continue_token`` is set: the rest follows from INVENTORY with `continue`."""

    pod: str
    namespace: str
    pod_uid: str
    incarnation: str
    objects: tuple[InventoryItem, ...] = field(default_factory=tuple)
    continue_token: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pod": self.pod,
            "namespace": self.namespace,
            "podUID": self.pod_uid,
            "incarnation": self.incarnation,
            "objects": [o.to_json() for o in self.objects],
        }
        if self.continue_token:
            out["continue"] = self.continue_token
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Inventory:
        """Strict: an answer without its identity or its object list is refused (ValueError), never read
        as "holds nothing" (the audit would then find every object missing, or every leak gone)."""
        objects = data.get("objects")
        if not isinstance(objects, list):
            raise ValueError("an inventory without an objects list")
        if not data.get("podUID") or not data.get("incarnation"):
            raise ValueError("an inventory without the agent's podUID and incarnation")
        try:
            items = tuple(InventoryItem.from_json(o) for o in objects)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"a malformed inventory item: {exc!r}") from None
        return cls(
            pod=str(data.get("pod", "")),
            namespace=str(data.get("namespace", "")),
            pod_uid=str(data["podUID"]),
            incarnation=str(data["incarnation"]),
            objects=items,
            continue_token=str(data.get("continue") or ""),
        )


@dataclass(frozen=True)
class ReadRequest:
    """BEGIN_READ's body. `reader` is informational: the verified token names the reader."""

    reader: str = ""

    FIELDS: ClassVar[frozenset[str]] = frozenset({"reader"})

    def to_json(self) -> dict[str, Any]:
        return {"reader": self.reader}

    @classmethod
    def from_json(cls, data: Any) -> ReadRequest:
        """Strict (see the module's doc); an empty body is a read by an unnamed reader."""
        data = request_fields(data, cls.FIELDS)
        return cls(_optional_text(data, "reader", MAX_READER) or "")


MEMORY_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class ReadSpan:
    """The bytes of one tensor as NIXL addresses them: memory type, device, address, length."""

    mem: str
    dev: int
    addr: int
    nbytes: int

    @classmethod
    def from_json(cls, item: Any) -> ReadSpan | None:
        """A `[mem, dev, addr, nbytes]` list, or None for a tensor with no bytes; ValueError if malformed."""
        if item is None:
            return None
        if (
            not isinstance(item, list)
            or len(item) != 4
            or item[0] not in MEMORY_TYPES
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item[1:])
        ):
            raise ValueError(f"malformed span {item!r}")
        return cls(item[0], item[1], item[2], item[3])

    def to_json(self) -> list[Any]:
        return [self.mem, self.dev, self.addr, self.nbytes]


@dataclass(frozen=True)
class ReadTicket:
    """What a reader needs to READ an object: BEGIN_READ's answer (a ticket, with `read_id` and a lease)
    or a read grant a hand-off carries (the same shape with neither; it adds `generation`).

    `agent_metadata` is base64 of the NIXL partial metadata of the object's registration (empty when
    no tensor has bytes); `spans` and `tensors` pair up one to one.

    `next_agent` / `next_agent_metadata` (pooled objects only, when one is ready): the source's spare NIXL
    agent that its next pooled version will most likely be registered in, and base64 of that agent's
    connection info alone (no region's key). A reader loads and connects to it off its read's path, so
    its first read of the next version makes no new connection; it can read nothing through it until a
    grant or ticket of that version hands it the region's key (docs/weight-sync.md).
    """

    nixl_agent: str
    agent_metadata: str
    spans: tuple[ReadSpan | None, ...]
    tensors: tuple[TensorLayout, ...]
    nbytes: int = 0
    live_agents: tuple[str, ...] = ()
    incarnation: str = ""
    read_id: str = ""
    lease_seconds: float = 0.0
    descriptors: str | None = None
    generation: int | None = None
    next_agent: str | None = None
    next_agent_metadata: str = ""

    def to_json(self) -> dict[str, Any]:
        """A ticket (with readId and leaseSeconds) or a grant (with generation), as BEGIN_READ answers it."""
        body: dict[str, Any] = {"readId": self.read_id} if self.read_id else {}
        body.update(
            {
                "nixlAgent": self.nixl_agent,
                "agentMetadata": self.agent_metadata,
                "descriptors": self.descriptors,
                "spans": [s.to_json() if s is not None else None for s in self.spans],
                "tensors": [t.to_json() for t in self.tensors],
                "bytes": self.nbytes,
            }
        )
        if self.read_id:
            body["leaseSeconds"] = self.lease_seconds
        body["liveAgents"] = list(self.live_agents)
        body["incarnation"] = self.incarnation
        if self.generation is not None:
            body["generation"] = self.generation
        if self.next_agent:
            body["nextAgent"] = self.next_agent
            body["nextAgentMetadata"] = self.next_agent_metadata
        return body

    @classmethod
    def from_json(cls, data: Any, memo: ParseMemo | None = None) -> ReadTicket:
        """Parse and check a ticket or grant; ValueError (LayoutError for a layout) names what is wrong.

        `memo`: lists of tensors and spans parsed before, reused when this one's are equal."""
        if not isinstance(data, dict):
            raise ValueError("expected an object")
        memo = memo or _NO_MEMO
        try:
            tensors = memo.layouts(data["tensors"])
            spans = memo.spans(data["spans"])
            agent = data["nixlAgent"]
            metadata = data.get("agentMetadata") or ""
            live = tuple(str(n) for n in data.get("liveAgents") or ())
            ticket = cls(
                nixl_agent=agent,
                agent_metadata=metadata,
                spans=spans,
                tensors=tensors,
                nbytes=int(data.get("bytes", 0)),
                live_agents=live,
                incarnation=str(data.get("incarnation") or ""),
                read_id=str(data.get("readId") or ""),
                lease_seconds=float(data.get("leaseSeconds") or 0),
                descriptors=data.get("descriptors"),
                generation=data.get("generation"),
                next_agent=data.get("nextAgent") or None,
                next_agent_metadata=data.get("nextAgentMetadata") or "",
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"missing or mistyped field {exc}") from None
        if not isinstance(agent, str) or not isinstance(metadata, str):
            raise ValueError("nixlAgent and agentMetadata must be strings")
        if not isinstance(ticket.next_agent, (str, type(None))) or not isinstance(ticket.next_agent_metadata, str):
            raise ValueError("nextAgent and nextAgentMetadata must be strings")
        if len(spans) != len(tensors):
            raise ValueError(f"{len(spans)} spans for {len(tensors)} tensors")
        for span, layout in zip(spans, tensors, strict=True):
            if span is not None and span.nbytes != layout.nbytes:
                raise ValueError(f"a span of {span.nbytes} bytes for a {layout.nbytes}-byte tensor")
        return ticket


def _parse_tensors(raw: Any) -> tuple[TensorLayout, ...]:
    return tuple(TensorLayout.from_json(t, "tensors[]") for t in raw)


def _parse_spans(raw: Any) -> tuple[ReadSpan | None, ...]:
    return tuple(ReadSpan.from_json(s) for s in raw)


class ParseMemo:
    """The last few lists of tensors and of spans a reader parsed, each with what it parsed to.

    Why: a grant of a model's next version repeats its layouts (and, from a reused pack buffer, its
    spans): 2,000 of each take ~7 ms to parse and check, ~0.1 ms to compare with a list parsed before.
    A list equal to one parsed before (Python's ==) gives what that one parsed to: the same values. The
    lists are kept as given (a grant is never changed once received). Any thread.
    """

    def __init__(self, size: int = 4) -> None:
        self._lock = threading.Lock()
        self._layouts: deque[tuple[list[Any], tuple[TensorLayout, ...]]] = deque(maxlen=size)
        self._spans: deque[tuple[list[Any], tuple[ReadSpan | None, ...]]] = deque(maxlen=size)
        self._size = size

    def layouts(self, raw: Any) -> tuple[TensorLayout, ...]:
        """A ticket's `tensors`, parsed (LayoutError names what is wrong)."""
        return self._parsed(self._layouts, raw, _parse_tensors)

    def spans(self, raw: Any) -> tuple[ReadSpan | None, ...]:
        """A ticket's `spans`, parsed (ValueError names what is wrong)."""
        return self._parsed(self._spans, raw, _parse_spans)

    def _parsed(self, seen: deque[tuple[list[Any], Parsed]], raw: Any, parse: Callable[[Any], Parsed]) -> Parsed:
        if not isinstance(raw, list) or not self._size:  # the JSON shape is a list; anything else fails in parse
            return parse(raw)
        with self._lock:
            for earlier, result in seen:
                if earlier is raw or earlier == raw:
                    return result
        result = parse(raw)  # raises for a malformed list: nothing remembered
        with self._lock:
            seen.append((raw, result))
        return result


_NO_MEMO = ParseMemo(size=0)
