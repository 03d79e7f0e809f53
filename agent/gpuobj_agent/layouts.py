"""Tensor layouts meet torch: dtype objects, the layout of a tensor, allocation from a layout.

Why: the layout itself (gpuobj_contract.layouts.TensorLayout) is plain data that the client, the
operator and the benchmarks share; only the agent holds tensors, so only it converts layouts to
and from torch. User input is parsed by the contract and never reaches torch unchecked; a bad
layout is a BadRequest (400) here.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuobj_agent.errors import BadRequest
from gpuobj_contract import layouts as contract
from gpuobj_contract.layouts import TensorLayout

__all__ = ["DTYPES", "TensorLayout", "allocate", "dtype_name", "layout_of", "normalize_device", "parse_layouts"]

DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in contract.DTYPE_BYTES if isinstance(getattr(torch, n, None), torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The contract name of a torch dtype ("bfloat16"), or BadRequest if it has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise BadRequest(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})") from None


def normalize_device(device: str | torch.device) -> str:
    """ "cpu" or "cuda:N" (see the contract), as a BadRequest when it is not a device."""
    try:
        return contract.normalize_device(device)
    except contract.LayoutError as exc:
        raise BadRequest(str(exc)) from None


def tensor_device(tensor: torch.Tensor) -> str:
    """The normalized device of a tensor; a CUDA tensor always names its index."""
    # is_cpu / is_cuda / get_device(), not tensor.device: that builds a device object per call, and a
    # 2,000-tensor state dict asks on every put
    if tensor.is_cpu:
        return "cpu"
    if tensor.is_cuda:
        return f"cuda:{tensor.get_device()}"
    raise BadRequest(f"tensors on {tensor.device} are not supported (cpu or cuda only)")


def layout_of(tensor: torch.Tensor) -> TensorLayout:
    """The layout of a tensor (validates dtype and device)."""
    return TensorLayout(tuple(tensor.shape), dtype_name(tensor.dtype), tensor_device(tensor))  # torch.Size: ints


def torch_dtype(layout: TensorLayout) -> torch.dtype:
    return DTYPES[layout.dtype]


def allocate(layout: TensorLayout, *, device: str | None = None, zero: bool = False) -> torch.Tensor:
    """A new contiguous tensor of this layout (on `device` if given)."""
    factory = torch.zeros if zero else torch.empty
    return factory(layout.shape, dtype=torch_dtype(layout), device=device or layout.device)


def parse_layout(obj: Any, where: str = "tensor") -> TensorLayout:
    try:
        return TensorLayout.from_json(obj, where)
    except contract.LayoutError as exc:
        raise BadRequest(str(exc)) from None


def parse_layouts(obj: Any, where: str = "tensors") -> list[TensorLayout]:
    """A non-empty JSON list of layouts, or a BadRequest naming the field."""
    try:
        return contract.parse_layouts(obj, where)
    except contract.LayoutError as exc:
        raise BadRequest(str(exc)) from None
