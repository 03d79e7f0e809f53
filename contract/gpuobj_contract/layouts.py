"""Tensor layouts: the (shape, dtype, device) triple that describes one tensor on the wire and in the API.

Why here, in plain Python: the client, the agent, the operator and the benchmarks all describe
tensors this way, and user input (a CRD spec, an agent request) is parsed and validated once,
before anything reaches torch. Torch conversions (dtype objects, allocation) live in the agent
(gpuobj_agent.layouts), the only part that imports torch. The dtype names are the CRD's enum
(crds/gpuobj.io_gpuobjects.yaml); a unit test keeps them equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpuobj_contract import patterns

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def tensor_bytes(tensors: list[dict[str, Any]]) -> int:
    """Bytes an object's tensors occupy, from shapes and dtypes."""
    return sum(math.prod(t.get("shape", [])) * DTYPE_BYTES[t["dtype"]] for t in tensors)


MAX_NDIM = 32
MAX_TENSORS = 2048  # spec.tensors' maxItems in crds/gpuobj.io_gpuobjects.yaml, which a unit test keeps equal
# The most tensors the client library lists in a GPUObject's spec.tensors; beyond, spec.tensorSummary (count
# and bytes) stands in. Why: the API server's cost of every write of an object grows with its spec (decode,
# schema, CEL, managed fields): 18-176 ms a write at 291 listed tensors, 169-1,182 ms at 2,000 (docs/design.md,
# "What a GPUObject records of its tensors"); no reader needs the list: layouts travel in the agent's grants.
LISTED_TENSORS_MAX = 64
DEVICES_PATTERN = patterns.DEVICE.regex  # spec.tensors[].device


class LayoutError(ValueError):
    """A layout that is not valid; the message names the field."""


def normalize_device(device: object) -> str:
    """ "cpu" or "cuda:N": one spelling per device, so layouts compare equal."""
    text = str(device)
    if not patterns.DEVICE.matches(text):
        raise LayoutError(f"device {text!r} is not valid (expected cpu, cuda or cuda:N)")
    return "cuda:0" if text == "cuda" else text


@dataclass(frozen=True)
class TensorLayout:
    """What a reader needs to allocate a destination tensor: shape, dtype name, device."""

    shape: tuple[int, ...]
    dtype: str
    device: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device}

    @classmethod
    def from_json(cls, obj: Any, where: str = "tensor", *, ignore: frozenset[str] = frozenset()) -> TensorLayout:
        """Parse and validate one layout; every failure is a LayoutError naming the field.

        `ignore`: fields allowed and dropped (a CRD's tensors carry a `name` for people).
        """
        if not isinstance(obj, dict):
            raise LayoutError(f"{where}: expected an object with shape, dtype and device")
        unknown = set(obj) - {"shape", "dtype", "device"} - ignore
        if unknown:
            raise LayoutError(f"{where}: unknown field(s) {sorted(unknown)}")
        shape = obj.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise LayoutError(f"{where}.shape: expected a list of at most {MAX_NDIM} non-negative integers")
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0 or dim >= 2**62:
                raise LayoutError(f"{where}.shape: {dim!r} is not a non-negative integer")
        dtype = obj.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise LayoutError(f"{where}.dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        device = obj.get("device", "cpu")
        if not isinstance(device, str):
            raise LayoutError(f"{where}.device: expected a string")
        try:
            layout = cls(tuple(shape), dtype, normalize_device(device))
        except LayoutError as exc:
            raise LayoutError(f"{where}.device: {exc}") from None
        if layout.numel >= 2**62:
            raise LayoutError(f"{where}: {layout.shape} has too many elements")
        return layout


def parse_layouts(obj: Any, where: str = "tensors", *, ignore: frozenset[str] = frozenset()) -> list[TensorLayout]:
    """A non-empty JSON list of layouts."""
    if not isinstance(obj, list) or not obj:
        raise LayoutError(f"{where}: expected a non-empty list of tensor layouts")
    if len(obj) > MAX_TENSORS:
        raise LayoutError(f"{where}: at most {MAX_TENSORS} tensors per object")
    return [TensorLayout.from_json(item, f"{where}[{i}]", ignore=ignore) for i, item in enumerate(obj)]
