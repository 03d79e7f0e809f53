"""The CRDs in crds/ reject bad input at the API server, so `kubectl apply` of a bad object fails clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuobj_contract.layouts import DTYPE_BYTES
from gpuobj_dev.testing.cluster import CRDS_DIR, ClusterHandle

GOOD_OBJECT = {
    "apiVersion": "gpuobj.io/v1alpha1",
    "kind": "GPUObject",
    "metadata": {"name": "crd-check"},
    "spec": {"source": {"podName": "trainer-0"}, "tensors": [{"shape": [2, 3], "dtype": "float32"}]},
}


def _with(spec_patch: dict, drop: tuple[str, ...] = ()) -> str:
    doc = yaml.safe_load(yaml.safe_dump(GOOD_OBJECT))
    doc["spec"].update(spec_patch)
    for key in drop:
        del doc["spec"][key]
    return yaml.safe_dump(doc)


@pytest.mark.parametrize(
    ("case", "manifest", "message"),
    [
        ("missing source", _with({}, drop=("source",)), "spec.source: Required value"),
        ("negative dimension", _with({"tensors": [{"shape": [-4], "dtype": "float32"}]}), "greater than or equal to 0"),
        ("absurd size", _with({"tensors": [{"shape": [1 << 30, 1 << 30], "dtype": "int8"}]}), "at most 2^44 elements"),
        ("unknown dtype", _with({"tensors": [{"shape": [1], "dtype": "float33"}]}), "Unsupported value"),
        ("no tensors", _with({"tensors": []}), "spec.tensors"),
        (
            "bad device",
            _with({"tensors": [{"shape": [1], "dtype": "int8", "device": "tpu:0"}]}),
            "spec.tensors[0].device",
        ),
        ("bad object id", _with({"objectId": "has spaces"}), "spec.objectId"),
        (
            "claim naming nothing",
            "apiVersion: gpuobj.io/v1alpha1\nkind: GPUObjectClaim\nmetadata: {name: crd-check}\nspec: {}\n",
            "spec.objectName: Required value",
        ),
        (
            "claim naming the empty string",
            "apiVersion: gpuobj.io/v1alpha1\nkind: GPUObjectClaim\nmetadata: {name: crd-check}\n"
            "spec: {objectName: ''}\n",
            "spec.objectName",
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(
    gpuobj_cluster: ClusterHandle, case: str, manifest: str, message: str
) -> None:
    proc = gpuobj_cluster.kubectl("apply", "-n", "default", "-f", "-", input=manifest, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert message in proc.stderr, proc.stderr
    assert gpuobj_cluster.kubectl("get", "gobj,gclaim", "-n", "default", "crd-check", check=False).stdout == ""


def test_spec_is_immutable_and_printer_columns_answer_the_first_questions(gpuobj_cluster: ClusterHandle) -> None:
    k = gpuobj_cluster.kubectl
    k("apply", "-n", "default", "-f", "-", input=yaml.safe_dump(GOOD_OBJECT))
    try:
        proc = k(
            "patch", "-n", "default", "gobj", "crd-check", "--type", "merge", "-p", '{"spec":{"key":"x"}}', check=False
        )
        assert proc.returncode != 0 and "immutable" in proc.stderr
        header = k("get", "gpuobjects", "-n", "default").stdout.splitlines()[0].split()
        assert header == ["NAME", "STATE", "SOURCE", "BYTES", "REFS", "AGE"]
        wide = k("get", "gpuobjects", "-n", "default", "-o", "wide").stdout.splitlines()[0].split()
        assert {"TENSORS", "STREAM", "OBJECT-ID", "AGENT", "REASON"} <= set(wide)
        # The category lists every gpuobj kind.
        assert "gpuobject.gpuobj.io/crd-check" in k("get", "gpuobj", "-n", "default", "-o", "name").stdout
    finally:
        k("delete", "-n", "default", "gobj", "crd-check", "--wait=false")
        k(
            "patch",
            "-n",
            "default",
            "gobj",
            "crd-check",
            "--type",
            "merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )


def test_dtype_enum_matches_the_byte_sizes_the_code_knows() -> None:
    crd = yaml.safe_load(Path(CRDS_DIR / "gpuobj.io_gpuobjects.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    enum = schema["properties"]["spec"]["properties"]["tensors"]["items"]["properties"]["dtype"]["enum"]
    assert enum == list(DTYPE_BYTES)


def test_short_names_and_category_are_the_documented_contract() -> None:
    docs = {p.name: yaml.safe_load(p.read_text()) for p in CRDS_DIR.glob("gpuobj.io_*.yaml")}
    names = {d["spec"]["names"]["kind"]: d["spec"]["names"] for d in docs.values()}
    # `gpuobj` is the category only: as a short name too, kubectl would expand it to every kind and
    # `kubectl get gpuobj NAME` would fail with "you must specify only one resource".
    assert names["GPUObject"]["shortNames"] == ["gobj"]
    assert names["GPUObjectClaim"]["shortNames"] == ["gclaim"]
    assert all(n["categories"] == ["gpuobj"] for n in names.values())


def _fields(schema: dict, path: str = "") -> list[tuple[str, dict]]:
    out = []
    for key, sub in (schema.get("properties") or {}).items():
        p = f"{path}.{key}" if path else key
        out.append((p, sub))
        out += _fields(sub, p)
        if "items" in sub:
            out += _fields(sub["items"], p)
    return out


def test_every_field_kubectl_explain_shows_has_a_description() -> None:
    missing = []
    for crd in CRDS_DIR.glob("gpuobj.io_*.yaml"):
        schema = yaml.safe_load(crd.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        # metadata is ObjectMeta: the API server describes it, and a CRD may not.
        missing += [f"{crd.name}: {p}" for p, sub in _fields(schema) if p != "metadata" and not sub.get("description")]
    assert missing == []


def test_a_new_object_shows_pending_at_once_and_kubectl_get_by_name_works(gpuobj_cluster: ClusterHandle) -> None:
    k = gpuobj_cluster.kubectl
    claim = (
        "apiVersion: gpuobj.io/v1alpha1\nkind: GPUObjectClaim\nmetadata: {name: crd-pending}\nspec: {objectName: x}\n"
    )
    k("apply", "-n", "default", "-f", "-", input=yaml.safe_dump({**GOOD_OBJECT, "metadata": {"name": "crd-pending"}}))
    k("apply", "-n", "default", "-f", "-", input=claim)
    try:
        # No operator runs here: the State column comes from the schema's default, not from a status write.
        row = k("get", "gobj", "crd-pending", "-n", "default", "--no-headers").stdout.split()
        assert row[:3] == ["crd-pending", "Pending", "trainer-0"]
        # A claim reads Bound from its default (the operator writes a claim's status only when it is not
        # Bound: Pending here within status_delay once an operator runs, as no GPUObject x exists).
        assert k("get", "gclaim", "crd-pending", "-n", "default", "--no-headers").stdout.split()[1] == "Bound"
        # The category lists both kinds; a kind's name still addresses one object.
        listed = k("get", "gpuobj", "-n", "default", "-o", "name").stdout.split()
        assert {"gpuobject.gpuobj.io/crd-pending", "gpuobjectclaim.gpuobj.io/crd-pending"} <= set(listed)
        assert "Pending" in k("explain", "gpuobjects.status.state").stdout
        assert "source pod" in k("explain", "gobj.spec.source.podName").stdout
    finally:
        k("delete", "-n", "default", "gclaim", "crd-pending", "--wait=false")
        k("delete", "-n", "default", "gobj", "crd-pending", "--wait=false")
