"""What the operator sends an agent, built from the API's records with the contract's typed shapes."""

from __future__ import annotations

import pytest

from gpuobj_contract.layouts import LayoutError, TensorLayout
from gpuobj_operator.model import ObjectInfo
from gpuobj_operator.reconciler import _materialize_request


def declared(tensors: list[dict], **kw) -> ObjectInfo:
    return ObjectInfo("ml", "weights", "obj-uid-1", source_pod="trainer-0", tensors=tensors, **kw)


def test_a_declared_object_asks_for_its_layouts_key_stream_and_readers() -> None:
    tensors = [
        {"name": "weight", "shape": [4, 4], "dtype": "float32", "device": "cuda"},
        {"shape": [4], "dtype": "int8"},
    ]
    request = _materialize_request(declared(tensors, key_name="weights", shared_with=("b",), stream=("s", 3)))
    # A tensor's name is the API's alone; devices are spelled one way; a missing device is the CPU.
    assert request.tensors == (TensorLayout((4, 4), "float32", "cuda:0"), TensorLayout((4,), "int8", "cpu"))
    assert (request.key, request.stream, request.stream_index) == ("weights", "s", 3)
    assert request.to_json()["sharedWith"] == ["b"]


def test_a_layout_the_agent_would_refuse_is_refused_naming_the_field() -> None:
    with pytest.raises(LayoutError, match=r"spec\.tensors\[0\]\.dtype"):
        _materialize_request(declared([{"shape": [4], "dtype": "float128"}]))
