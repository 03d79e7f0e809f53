"""Tensor layouts: parsing user input into something torch can allocate, or a clear 400."""

from __future__ import annotations

import pytest
import torch

from gpuobj_agent.errors import BadRequest
from gpuobj_agent.layouts import DTYPES, TensorLayout, allocate, layout_of, parse_layouts
from gpuobj_contract import names


def test_every_contract_dtype_maps_to_torch_and_back():
    assert set(DTYPES) == set(names.DTYPES)
    for name, dtype in DTYPES.items():
        layout = layout_of(torch.empty((2, 3), dtype=dtype))
        assert layout.dtype == name and layout.nbytes == 6 * dtype.itemsize


def test_zero_dim_and_empty_layouts_round_trip():
    for shape in ([], [0], [3, 0, 2]):
        layout = TensorLayout.from_json({"shape": shape, "dtype": "bool", "device": "cpu"})
        assert TensorLayout.from_json(layout.to_json()) == layout
        t = allocate(layout, zero=True)
        assert tuple(t.shape) == tuple(shape) and t.dtype == torch.bool


def test_cuda_is_spelled_with_its_index():
    assert TensorLayout.from_json({"shape": [1], "dtype": "int8", "device": "cuda"}).device == "cuda:0"
    assert TensorLayout.from_json({"shape": [1], "dtype": "int8", "device": "cuda:3"}).device == "cuda:3"


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        "x",
        {"shape": [1], "dtype": "float32", "device": "cpu", "extra": 1},
        {"shape": "1", "dtype": "float32"},
        {"shape": [-1], "dtype": "float32"},
        {"shape": [1.5], "dtype": "float32"},
        {"shape": [True], "dtype": "float32"},
        {"shape": [1], "dtype": "float33"},
        {"shape": [1], "dtype": 5},
        {"shape": [1], "dtype": "float32", "device": "tpu"},
        {"shape": [1], "dtype": "float32", "device": "cuda:x"},
        {"shape": [2**40, 2**40], "dtype": "float32"},
        {"shape": [1] * 33, "dtype": "float32"},
    ],
)
def test_malformed_layouts_are_a_bad_request_with_a_message(bad):
    with pytest.raises(BadRequest) as err:
        parse_layouts([bad] if not isinstance(bad, list) else bad)
    assert str(err.value)
