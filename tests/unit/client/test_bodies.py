"""What a GPUObject the client library writes records of its tensors: every layout up to LISTED_TENSORS_MAX,
a count and bytes beyond (each listed entry costs the API server on every write of the object)."""

from __future__ import annotations

from gpuobj.client.bodies import Source, object_body
from gpuobj_contract import resources as crd
from gpuobj_contract.layouts import LISTED_TENSORS_MAX, TensorLayout

SOURCE = Source("trainer", "ml", "pod-uid", "10.0.0.5:8471", "inc-1")


def layouts(n: int) -> list[TensorLayout]:
    return [TensorLayout((32, 8 + i % 3), "bfloat16", "cpu") for i in range(n)]


def test_up_to_the_limit_every_layout_is_listed_with_its_name() -> None:
    items = layouts(LISTED_TENSORS_MAX)
    spec = object_body(SOURCE, "w", "o-1", items, entries=[("layer.0.weight", 0)])["spec"]
    assert len(spec["tensors"]) == LISTED_TENSORS_MAX and "tensorSummary" not in spec
    assert spec["tensors"][0]["name"] == "layer.0.weight"


def test_beyond_the_limit_a_count_and_bytes_stand_in_for_the_list() -> None:
    items = layouts(2000)
    spec = object_body(SOURCE, "w", "o-1", items)["spec"]
    assert "tensors" not in spec
    assert spec["tensorSummary"] == {"count": 2000, "bytes": sum(t.nbytes for t in items)}
    parsed = crd.GPUObjectSpec.from_json(spec)
    assert parsed.tensor_summary == crd.TensorSummary(2000, sum(t.nbytes for t in items)) and parsed.tensors == ()


def test_a_streams_item_keeps_its_layouts_however_many() -> None:
    spec = object_body(SOURCE, "s-3", "o-3", layouts(100), stream=("s", 3, "stream-uid"))["spec"]
    assert len(spec["tensors"]) == 100 and "tensorSummary" not in spec
