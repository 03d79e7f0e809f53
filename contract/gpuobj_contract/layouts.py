"""Tensor layouts as the API describes them (shape, dtype, device) and the bytes they occupy.

The dtype names are the CRD's enum (crds/gpuobj.io_gpuobjects.yaml); a unit test keeps them equal.
"""

from __future__ import annotations

import math

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


def tensor_bytes(tensors: list[dict]) -> int:
    """Bytes an object's tensors occupy, from shapes and dtypes."""
    return sum(math.prod(t.get("shape", [])) * DTYPE_BYTES[t["dtype"]] for t in tensors)
