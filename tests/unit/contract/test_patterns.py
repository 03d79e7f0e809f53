"""One home per pattern (gpuobj_contract.patterns), pinned to every CRD field that carries it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuobj_contract import patterns as p
from gpuobj_contract.layouts import DEVICES_PATTERN

CRDS = Path(__file__).resolve().parents[3] / "crds"

# (CRD file, path of the field under the version's schema) -> the pattern it must carry.
PINNED: dict[tuple[str, str], p.TextPattern] = {
    ("gpuobj.io_gpuobjects.yaml", "spec.source.podName"): p.OBJECT_NAME,
    ("gpuobj.io_gpuobjects.yaml", "spec.source.incarnation"): p.INCARNATION,
    ("gpuobj.io_gpuobjects.yaml", "spec.objectId"): p.OBJECT_ID,
    ("gpuobj.io_gpuobjects.yaml", "spec.sharedWith[]"): p.NAMESPACE,
    ("gpuobj.io_gpuobjects.yaml", "spec.tensors[].device"): p.DEVICE,
    ("gpuobj.io_gpuobjects.yaml", "spec.stream.name"): p.STREAM_NAME,
    ("gpuobj.io_gpuobjectclaims.yaml", "spec.objectName"): p.OBJECT_NAME,
    ("gpuobj.io_gpuobjectclaims.yaml", "spec.holder.podName"): p.OBJECT_NAME,
    ("gpuobj.io_gpuobjectclaims.yaml", "spec.holder.incarnation"): p.INCARNATION,
    ("gpuobj.io_gpuobjectstreams.yaml", "spec.producer.podName"): p.OBJECT_NAME,
}


def spec_fields(crd_file: str) -> dict[str, dict[str, Any]]:
    """Every field under spec, by path (arrays' items as `name[]`)."""
    crd = yaml.safe_load((CRDS / crd_file).read_text())
    (version,) = crd["spec"]["versions"]
    out: dict[str, dict[str, Any]] = {}

    def walk(schema: dict[str, Any], path: str) -> None:
        out[path] = schema
        for name, sub in schema.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if "items" in schema:
            walk(schema["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec")
    return out


@pytest.mark.parametrize(("crd_file", "path"), sorted(PINNED))
def test_each_crd_field_carries_the_one_pattern_and_its_length_bound(crd_file: str, path: str) -> None:
    schema, pattern = spec_fields(crd_file)[path], PINNED[(crd_file, path)]
    assert schema.get("pattern") == pattern.regex, path
    if "maxLength" in schema:
        assert schema["maxLength"] == pattern.max_length, path


@pytest.mark.parametrize("crd_file", sorted({f for f, _ in PINNED}))
def test_no_spec_field_has_a_pattern_that_is_not_pinned(crd_file: str) -> None:
    patterned = {path for path, schema in spec_fields(crd_file).items() if "pattern" in schema}
    assert patterned == {path for f, path in PINNED if f == crd_file}


def test_patterns_match_in_full_and_within_their_bounds() -> None:
    assert p.OBJECT_ID.matches("o-" + "f" * 32) and not p.OBJECT_ID.matches("o-1\n")
    assert not p.OBJECT_ID.matches("x" * 129) and not p.OBJECT_ID.matches("")
    assert p.STREAM_NAME.matches("acts-1") and not p.STREAM_NAME.matches("Acts")
    assert not p.STREAM_NAME.matches("a" * 254) and not p.NAMESPACE.matches("a.b")
    assert p.INCARNATION.matches("") and not p.INCARNATION.matches("a b")
    assert p.DEVICE.matches("cuda:12") and not p.DEVICE.matches("cuda:123") and p.DEVICE.regex == DEVICES_PATTERN
