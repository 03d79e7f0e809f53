"""The one TensorLayout: plain data every part shares, validated without torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuobj_contract.layouts import DTYPE_BYTES, MAX_TENSORS, LayoutError, TensorLayout, parse_layouts, tensor_bytes


def test_bytes_come_from_the_contract_dtype_sizes() -> None:
    layout = TensorLayout((4, 8), "bfloat16", "cuda:1")
    assert (layout.numel, layout.itemsize, layout.nbytes) == (32, 2, 64)
    assert tensor_bytes([layout.to_json()]) == layout.nbytes
    assert all(TensorLayout((3,), d, "cpu").nbytes == 3 * size for d, size in DTYPE_BYTES.items())


def test_a_crd_spec_with_tensor_names_parses_when_names_are_allowed() -> None:
    spec = [{"name": "weight", "shape": [2, 2], "dtype": "float32"}]
    with pytest.raises(LayoutError, match=r"tensors\[0\]: unknown field"):
        parse_layouts(spec)
    assert parse_layouts(spec, ignore=frozenset({"name"})) == [TensorLayout((2, 2), "float32", "cpu")]


@pytest.mark.parametrize("device", ["cuda\n", "cpu ", "tpu", "cuda:", "CUDA:0"])
def test_devices_are_matched_in_full(device: str) -> None:
    with pytest.raises(LayoutError, match="device"):
        TensorLayout.from_json({"shape": [1], "dtype": "int8", "device": device})


def test_layout_errors_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"x\.dtype"):
        TensorLayout.from_json({"shape": [1], "dtype": "float33"}, "x")


def test_the_tensor_count_limit_is_the_crds() -> None:
    """The contract refuses what the API server would refuse, before a client copies anything."""
    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "crds" / "gpuobj.io_gpuobjects.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["tensors"]["maxItems"] == MAX_TENSORS
    assert spec["tensorSummary"]["properties"]["count"]["maximum"] == MAX_TENSORS
    one = {"shape": [1], "dtype": "int8"}
    assert len(parse_layouts([one] * MAX_TENSORS)) == MAX_TENSORS
    with pytest.raises(LayoutError, match=f"at most {MAX_TENSORS} tensors"):
        parse_layouts([one] * (MAX_TENSORS + 1))
