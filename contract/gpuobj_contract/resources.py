"""Typed shapes of the three custom resources' spec and status: GPUObject, GPUObjectClaim, GPUObjectStream.

Why: the CRD schemas (crds/) are the one source of the API's fields, and the client, the stream
reader and the operator all read and write them. Spelled as dict keys in each, a renamed or
misspelled field failed late (a KeyError, or worse a silent default). Here each spec and status is
a frozen dataclass; `from_json` reads what the API server returns (unknown fields are ignored:
a newer schema may add some) and `to_json` writes what is sent (an optional field's None or empty
list left out; a required field always written, even empty: a 0-d tensor's shape is []).
A unit test (tests/unit/contract/test_resources.py) pins every class to its CRD schema: each
property of the schema has a field here and each field a property, with the same type and the
same required-ness, so neither side can change alone.

JSON names are the fields' names in camelCase; a field whose JSON name is irregular (`podUID`)
says so in its metadata. Plain Python, no I/O.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from gpuobj_contract.layouts import TensorLayout

S = TypeVar("S", bound="Shape")


def json_field(name: str, default: Any = None) -> Any:
    """A field whose JSON name is not its camelCase name (e.g. podUID)."""
    return field(default=default, metadata={"json": name})


def json_name(f: dataclasses.Field[Any]) -> str:
    explicit = f.metadata.get("json")
    if explicit:
        return str(explicit)
    head, *rest = f.name.split("_")
    return head + "".join(part.capitalize() for part in rest)


Decoder = Callable[[Any], Any]


@dataclass(frozen=True)
class _FieldPlan:
    """How one field is read and written, worked out once per class: the operator parses every watch
    event through these shapes, and reflecting on the types per event cost 40 times a dict lookup."""

    name: str
    key: str  # its JSON name
    decode: Decoder | None  # None: the JSON value as it is (a str)
    required: bool  # written even when empty (a 0-d tensor's shape is [])


_PLANS: dict[type, tuple[_FieldPlan, ...]] = {}


def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)  # annotations are strings under `from __future__`
        plan = _PLANS[cls] = tuple(
            _FieldPlan(
                f.name,
                json_name(f),
                _decoder(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        )
    return plan


def _unwrap_optional(tp: Any) -> Any:
    """X for `X | None`, else tp."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _decoder(tp: Any) -> Decoder | None:
    """What reads a (non-null) JSON value into a field of type ``tp``; None: the value as it is."""
    tp = _unwrap_optional(tp)
    if typing.get_origin(tp) is tuple:
        item = _decoder(typing.get_args(tp)[0])
        if item is None:
            return tuple
        return lambda value: tuple(None if v is None else item(v) for v in value)
    if isinstance(tp, type) and issubclass(tp, Shape):
        return tp.from_json
    if tp in (int, float, bool):
        scalar: Decoder = tp
        return scalar
    return None


def _encode(value: Any) -> Any:
    if isinstance(value, Shape):
        return value.to_json()
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


class Shape:
    """A spec or status (or a part of one): parsed from and written to the API's JSON by its fields."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def from_json(cls: type[S], data: Mapping[str, Any] | None) -> S:
        data = data or {}
        kwargs = {}
        for f in _plan(cls):
            if f.key in data:
                value = data[f.key]
                kwargs[f.name] = value if value is None or f.decode is None else f.decode(value)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"{cls.__name__}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in _plan(type(self)):
            value = getattr(self, f.name)
            if not f.required and (value is None or value == ()):
                continue
            out[f.key] = _encode(value)
        return out


@dataclass(frozen=True)
class Condition(Shape):
    """One observation, in the Kubernetes API conventions' shape (status.conditions[])."""

    type: str
    status: str
    last_transition_time: str
    reason: str
    message: str
    observed_generation: int | None = None


def find_condition(conditions: tuple[Condition, ...], kind: str) -> Condition | None:
    return next((c for c in conditions if c.type == kind), None)


# ------------------------------------------------------------------ GPUObject


@dataclass(frozen=True)
class ObjectSource(Shape):
    """The pod whose agent holds the primary copy (and, when set, which incarnation of it)."""

    pod_name: str
    pod_uid: str | None = json_field("podUID")
    incarnation: str | None = None


@dataclass(frozen=True)
class TensorSpec(Shape):
    """One tensor of spec.tensors: a layout, and a name for people."""

    shape: tuple[int, ...]
    dtype: str
    device: str | None = None  # the schema's default: cpu
    name: str | None = None

    @classmethod
    def of(cls, layout: TensorLayout) -> TensorSpec:
        return cls(layout.shape, layout.dtype, layout.device)

    def layout(self) -> TensorLayout:
        """Parsed and validated (LayoutError names the field)."""
        return TensorLayout.from_json({"shape": list(self.shape), "dtype": self.dtype, "device": self.device or "cpu"})


@dataclass(frozen=True)
class TensorSummary(Shape):
    """spec.tensorSummary: how many tensors and bytes, standing in for a long spec.tensors (library puts only)."""

    count: int
    bytes: int


@dataclass(frozen=True)
class StreamItem(Shape):
    """spec.stream: which GPUObjectStream the object is an item of, and where in it."""

    name: str
    index: int


@dataclass(frozen=True)
class GPUObjectSpec(Shape):
    """Either ``tensors`` (every layout) or ``tensor_summary`` (library puts of more than LISTED_TENSORS_MAX)."""

    source: ObjectSource
    tensors: tuple[TensorSpec, ...] = ()
    tensor_summary: TensorSummary | None = None
    object_id: str | None = None
    shared_with: tuple[str, ...] = ()
    key: str | None = None
    stream: StreamItem | None = None

    def layouts(self) -> tuple[TensorLayout, ...]:
        return tuple(t.layout() for t in self.tensors)


@dataclass(frozen=True)
class Transport(Shape):
    backend: str | None = None
    agent_endpoint: str | None = None
    agent_incarnation: str | None = None


@dataclass(frozen=True)
class GPUObjectStatus(Shape):
    observed_generation: int | None = None
    state: str | None = None
    object_id: str | None = None
    bytes: int | None = None
    tensor_count: int | None = None
    references: int | None = None
    claims: int | None = None
    source_pod_uid: str | None = json_field("sourcePodUID")
    transport: Transport | None = None
    last_reference_gone_time: str | None = None
    conditions: tuple[Condition, ...] = ()

    def condition(self, kind: str) -> Condition | None:
        return find_condition(self.conditions, kind)


# ------------------------------------------------------------------ GPUObjectClaim


@dataclass(frozen=True)
class ClaimHolder(Shape):
    pod_name: str
    incarnation: str | None = None


@dataclass(frozen=True)
class GPUObjectClaimSpec(Shape):
    object_name: str
    object_uid: str | None = json_field("objectUID")
    ttl_seconds: int | None = None
    holder: ClaimHolder | None = None


@dataclass(frozen=True)
class GPUObjectClaimStatus(Shape):
    observed_generation: int | None = None
    state: str | None = None
    object_uid: str | None = json_field("objectUID")
    bytes: int | None = None
    source_pod: str | None = None
    conditions: tuple[Condition, ...] = ()

    def condition(self, kind: str) -> Condition | None:
        return find_condition(self.conditions, kind)


# ------------------------------------------------------------------ GPUObjectStream


@dataclass(frozen=True)
class StreamProducer(Shape):
    pod_name: str


@dataclass(frozen=True)
class GPUObjectStreamSpec(Shape):
    producer: StreamProducer


@dataclass(frozen=True)
class GPUObjectStreamStatus(Shape):
    observed_generation: int | None = None
    emitted: int | None = None
    consumed: int | None = None
    live_items: int | None = None
    bytes: int | None = None


# The shapes of each kind, by CRD file (the pin test walks these).
SHAPES: dict[str, tuple[type[Shape], type[Shape]]] = {
    "gpuobj.io_gpuobjects.yaml": (GPUObjectSpec, GPUObjectStatus),
    "gpuobj.io_gpuobjectclaims.yaml": (GPUObjectClaimSpec, GPUObjectClaimStatus),
    "gpuobj.io_gpuobjectstreams.yaml": (GPUObjectStreamSpec, GPUObjectStreamStatus),
}
