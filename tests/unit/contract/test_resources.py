"""The typed CRD shapes (gpuobj_contract.resources) pinned to the schemas in crds/, both ways."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuobj_contract import resources as r
from gpuobj_contract.layouts import TensorLayout

CRDS = Path(__file__).resolve().parents[3] / "crds"
SCALARS = {"string": str, "integer": int, "boolean": bool, "number": float}


def schema_of(crd_file: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / crd_file).read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]


def check(cls: type[r.Shape], schema: dict[str, Any], where: str) -> None:
    """Every property has a field and every field a property, of the same type and required-ness."""
    fields = {r.json_name(f): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    properties = schema.get("properties", {})
    assert set(fields) == set(properties), f"{where}: fields {sorted(fields)} vs schema {sorted(properties)}"
    required = set(schema.get("required", []))
    hints = typing.get_type_hints(cls)
    for key, f in fields.items():
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert (key in required) == (not has_default), f"{where}.{key}: required in the schema iff no default"
        tp = r._unwrap_optional(hints[f.name])
        prop = properties[key]
        if prop["type"] == "array":
            assert typing.get_origin(tp) is tuple, f"{where}.{key}: an array is a tuple"
            item_tp, items = typing.get_args(tp)[0], prop["items"]
            if items["type"] == "object":
                check(item_tp, items, f"{where}.{key}[]")
            else:
                assert item_tp is SCALARS[items["type"]], f"{where}.{key}[]"
        elif prop["type"] == "object":
            assert isinstance(tp, type) and issubclass(tp, r.Shape), f"{where}.{key}: an object is a Shape"
            check(tp, prop, f"{where}.{key}")
        else:
            assert tp is SCALARS[prop["type"]], f"{where}.{key}: {prop['type']} vs {tp}"


@pytest.mark.parametrize("crd_file", sorted(r.SHAPES))
def test_every_field_of_the_schema_has_a_typed_field_and_vice_versa(crd_file: str) -> None:
    spec_cls, status_cls = r.SHAPES[crd_file]
    schema = schema_of(crd_file)
    check(spec_cls, schema["spec"], f"{crd_file}: spec")
    check(status_cls, schema["status"], f"{crd_file}: status")


def test_a_client_written_spec_round_trips_in_the_apis_json() -> None:
    spec = r.GPUObjectSpec(
        source=r.ObjectSource("src", pod_uid="u-1", incarnation="inc"),
        tensors=(r.TensorSpec.of(TensorLayout((2, 3), "float32", "cuda:0")),),
        object_id="o-1",
        shared_with=("b",),
        stream=r.StreamItem("s", 4),
    )
    data = spec.to_json()
    assert data == {
        "source": {"podName": "src", "podUID": "u-1", "incarnation": "inc"},
        "tensors": [{"shape": [2, 3], "dtype": "float32", "device": "cuda:0"}],
        "objectId": "o-1",
        "sharedWith": ["b"],
        "stream": {"name": "s", "index": 4},
    }
    assert r.GPUObjectSpec.from_json(data) == spec
    assert spec.layouts() == (TensorLayout((2, 3), "float32", "cuda:0"),)


def test_a_status_with_unknown_fields_parses_and_a_missing_required_field_is_a_value_error() -> None:
    status = r.GPUObjectStatus.from_json(
        {"state": "Lost", "conditions": [{"type": "SourceAvailable", "status": "False", "lastTransitionTime": "t",
                                          "reason": "PodGone", "message": "pod deleted"}], "futureField": 1}
    )  # fmt: skip
    assert status.state == "Lost" and status.condition("SourceAvailable").message == "pod deleted"  # type: ignore[union-attr]
    assert r.GPUObjectStatus.from_json(None) == r.GPUObjectStatus()
    with pytest.raises(ValueError, match="GPUObjectClaimSpec"):
        r.GPUObjectClaimSpec.from_json({"ttlSeconds": 5})


def test_a_0d_tensor_keeps_its_empty_shape_in_the_apis_json() -> None:
    # shape is required and [] means a 0-d tensor (a scalar): left out, the API server refuses the spec.
    spec = r.GPUObjectSpec(r.ObjectSource("src"), (r.TensorSpec.of(TensorLayout((), "float32", "cpu")),))
    data = spec.to_json()
    assert data["tensors"] == [{"shape": [], "dtype": "float32", "device": "cpu"}]
    assert r.GPUObjectSpec.from_json(data) == spec
    assert spec.layouts() == (TensorLayout((), "float32", "cpu"),)
