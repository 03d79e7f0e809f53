"""Tensor layouts: the (shape, dtype, device) triple that describes one tensor on the wire.

Why: a reader allocates its destination from layouts alone and a declared object
(`kubectl apply`) is nothing but layouts, so one module parses and validates them;
user input never reaches torch unchecked. Dtype names are `gpuobj_contract.names.DTYPES`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from gpuobj_agent.errors import BadRequest
from gpuobj_contract import names

MAX_NDIM = 32
_DEVICE_RE = re.compile(names.DEVICES_PATTERN)

DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in names.DTYPES if isinstance(getattr(torch, n, None), torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The contract name of a torch dtype ("bfloat16"), or BadRequest if it has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise BadRequest(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})") from None


def normalize_device(device: str | torch.device) -> str:
    """ "cpu" or "cuda:N": one spelling per device, so layouts compare equal."""
    text = str(device)
    if not _DEVICE_RE.fullmatch(text):
        raise BadRequest(f"device {text!r} is not valid (expected cpu, cuda or cuda:N)")
    return "cuda:0" if text == "cuda" else text


def tensor_device(tensor: torch.Tensor) -> str:
    """The normalized device of a tensor; a CUDA tensor always names its index."""
    if tensor.device.type == "cuda":
        return f"cuda:{tensor.device.index if tensor.device.index is not None else 0}"
    if tensor.device.type == "cpu":
        return "cpu"
    raise BadRequest(f"tensors on {tensor.device} are not supported (cpu or cuda only)")


@dataclass(frozen=True)
class TensorLayout:
    """What a reader needs to allocate a destination tensor: shape, dtype name, device."""

    shape: tuple[int, ...]
    dtype: str
    device: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device}

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(int(s) for s in tensor.shape), dtype_name(tensor.dtype), tensor_device(tensor))

    @classmethod
    def from_json(cls, obj: Any, where: str = "tensor") -> TensorLayout:
        """Parse and validate one layout from JSON; every failure is a BadRequest naming the field."""
        if not isinstance(obj, dict):
            raise BadRequest(f"{where}: expected an object with shape, dtype and device")
        unknown = set(obj) - {"shape", "dtype", "device"}
        if unknown:
            raise BadRequest(f"{where}: unknown field(s) {sorted(unknown)}")
        shape = obj.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise BadRequest(f"{where}.shape: expected a list of at most {MAX_NDIM} non-negative integers")
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0 or dim >= 2**62:
                raise BadRequest(f"{where}.shape: {dim!r} is not a non-negative integer")
        dtype = obj.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise BadRequest(f"{where}.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        device = obj.get("device", "cpu")
        if not isinstance(device, str):
            raise BadRequest(f"{where}.device: expected a string")
        layout = cls(tuple(shape), dtype, normalize_device(device))
        if layout.numel >= 2**62:
            raise BadRequest(f"{where}: {layout.shape} has too many elements")
        return layout

    def allocate(self, *, device: str | None = None, zero: bool = False) -> torch.Tensor:
        """A new contiguous tensor of this layout (on `device` if given)."""
        factory = torch.zeros if zero else torch.empty
        return factory(self.shape, dtype=self.torch_dtype, device=device or self.device)


def parse_layouts(obj: Any, where: str = "tensors") -> list[TensorLayout]:
    """A non-empty JSON list of layouts."""
    if not isinstance(obj, list) or not obj:
        raise BadRequest(f"{where}: expected a non-empty list of tensor layouts")
    if len(obj) > 4096:
        raise BadRequest(f"{where}: at most 4096 tensors per object")
    return [TensorLayout.from_json(item, f"{where}[{i}]") for i, item in enumerate(obj)]
