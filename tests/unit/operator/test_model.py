"""The operator's parse boundary: API bodies become ledger records through the contract's typed shapes."""

from __future__ import annotations

import pytest

from gpuobj_contract import names
from gpuobj_contract.layouts import TensorLayout
from gpuobj_contract.resources import Condition, GPUObjectStatus, Transport
from gpuobj_operator.model import parse_claim, parse_object, parse_stream
from gpuobj_operator.reconciler import _materialize_request

META = {"namespace": "ml", "name": "w", "uid": "obj-uid-1", "resourceVersion": "7", "generation": 2}
READY = {"type": "Ready", "status": "True", "lastTransitionTime": "t", "reason": "Ready", "message": "ok"}


def test_a_gpuobject_body_becomes_a_record_with_its_spec_and_typed_status() -> None:
    body = {
        "metadata": {**META, "finalizers": [names.FINALIZER_FREE], "creationTimestamp": "2026-12-01T12:00:00Z"},
        "spec": {
            "source": {"podName": "src", "podUID": "pod-uid-1", "incarnation": "i-1"},
            "tensors": [
                {"name": "w", "shape": [4, 4], "dtype": "float32", "device": "cuda:0"},
                {"shape": [], "dtype": "int64", "device": "cpu"},
            ],
            "objectId": "o-1",
            "key": "weights",
            "sharedWith": ["b"],
            "stream": {"name": "s", "index": 3},
        },
        "status": {
            "state": "Ready",
            "objectId": "o-1",
            "transport": {"agentIncarnation": "i-1"},
            "conditions": [READY],
            "futureField": 1,
        },
    }
    info = parse_object(body)
    assert (info.source_pod, info.source_pod_uid, info.spec_incarnation) == ("src", "pod-uid-1", "i-1")
    assert (info.spec_object_id, info.key_name, info.shared_with, info.stream) == ("o-1", "weights", ("b",), ("s", 3))
    assert (info.finalized, info.generation, info.resource_version) == (True, 2, "7")
    assert info.status == GPUObjectStatus(
        state="Ready",
        object_id="o-1",
        transport=Transport(agent_incarnation="i-1"),
        conditions=(Condition("Ready", "True", "t", "Ready", "ok"),),
    )
    assert info.bytes == 4 * 4 * 4 + 8
    # What the source agent is asked to hold: the layouts, a 0-d tensor's empty shape included.
    request = _materialize_request(info)
    assert request.tensors == (TensorLayout((4, 4), "float32", "cuda:0"), TensorLayout((), "int64", "cpu"))


def test_a_claim_and_a_stream_body_become_records() -> None:
    claim = parse_claim(
        {
            "metadata": {**META, "name": "c1", "annotations": {names.ANNOTATION_SHARED_BY: "src"}},
            "spec": {
                "objectName": "w",
                "objectUID": "obj-uid-1",
                "ttlSeconds": 30,
                "holder": {"podName": "reader", "incarnation": "i-9"},
            },
            "status": {"state": "Bound", "objectUID": "obj-uid-1"},
        }
    )
    assert (claim.object_name, claim.object_uid, claim.ttl_seconds) == ("w", "obj-uid-1", 30)
    assert (claim.holder_pod, claim.holder_incarnation, claim.shared_by) == ("reader", "i-9", "src")
    assert claim.status.state == "Bound" and claim.status.object_uid == "obj-uid-1"
    stream = parse_stream(
        {"metadata": {**META, "name": "s"}, "spec": {"producer": {"podName": "src"}}, "status": {"consumed": 5}}
    )
    assert (stream.producer_pod, stream.consumed, stream.status.consumed) == ("src", 5, 5)


def test_a_body_the_crd_schema_refuses_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="GPUObjectSpec"):
        parse_object({"metadata": META, "spec": {"tensors": [{"shape": [1], "dtype": "int8"}]}})  # no source
    with pytest.raises(ValueError, match="GPUObjectClaimSpec"):
        parse_claim({"metadata": META, "spec": {}})


def test_a_summed_up_gpuobject_counts_its_bytes_and_tensors_from_the_summary() -> None:
    body = {
        "metadata": {**META, "finalizers": [names.FINALIZER_FREE]},
        "spec": {"source": {"podName": "src"}, "tensorSummary": {"count": 2000, "bytes": 6_144_000}, "objectId": "o"},
    }
    info = parse_object(body)
    assert (info.tensors, info.bytes, info.tensor_count) == ([], 6_144_000, 2000)
